"""Undo records for speculative optimizer steps.

A stage-1 step runs before the global gradient norm is known. Before it, the
bucket's parameter slice and the optimizer state of its slice tensors are
copied; if the norm later asks for clipping (or is not finite, or a
parameter of the bucket turns out to be unused on every rank), the copies are
put back bit for bit and the step is redone with the true gradient.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch


class SliceBackup:
    def __init__(self, param_shard: torch.Tensor, pieces: Sequence[torch.Tensor],
                 state: dict[Any, dict]):
        self.param_shard = param_shard.clone()
        self.had_state = {id(p): p in state for p in pieces}
        self.state = {id(p): {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                              for k, v in state[p].items()}
                      for p in pieces if p in state}

    def restore(self, param_shard: torch.Tensor, pieces: Sequence[torch.Tensor],
                state: dict[Any, dict]) -> None:
        param_shard.copy_(self.param_shard)
        for p in pieces:
            if not self.had_state[id(p)]:
                state.pop(p, None)  # the speculative step created it
                continue
            saved = self.state[id(p)]
            current = state[p]
            for k, v in saved.items():
                if isinstance(v, torch.Tensor) and isinstance(current.get(k), torch.Tensor):
                    current[k].copy_(v)
                else:
                    current[k] = v
            for k in [k for k in current if k not in saved]:
                del current[k]
