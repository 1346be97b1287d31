"""LoRA fine-tuning with peft under fgpsdp: a tiny GPT-2, its base frozen.

    pip install transformers peft
    torchrun --standalone --nproc_per_node 2 examples/peft_lora.py fgpsdp merged.pt

What differs from a torch DDP loop (checked with peft 0.21.2, transformers 5.25.0):

- Wrap after ``get_peft_model``: the frozen base stays out of the buckets, so each
  rank holds its share of the adapters' gradients and optimizer state only.
- Build the ShardedOptimizer over the trainable parameters, as a torch loop (and
  transformers' Trainer) builds its optimizer: by default it numbers every parameter
  of the module, frozen ones too, and its ``full_state_dict()`` would then not load
  into a torch optimizer over the adapters (torch's error says only that a group's
  size does not match).
- Merge and save from ``model.module`` after ``model.synchronize()``, which lands the
  last step's all-gathers.

``torch`` in place of ``fgpsdp`` runs torch DDP. Rank 0 writes the merged weights
(``merge_and_unload()``) to the output file. ``examples/peft_compare.py`` runs the
comparisons in docs/integrations.md.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

try:
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel
except ImportError as error:  # (not dependencies of fgpsdp_runtime)
    raise SystemExit(f"this example needs transformers and peft: {error}")

import fgpsdp_runtime as fgp

CLIP = 0.02  # max_norm: binds on every step here
VOCAB = 512


def base_model(checkpointing: str) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    if checkpointing != "none":
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
    return model


def clip_in_float64(params: list[torch.Tensor], max_norm: float) -> None:
    """torch's clip with the total norm summed in float64, as fgpsdp sums it (torch's
    own float32 sum rounds differently: the comparison's only difference)."""
    grads = [p.grad for p in params if p.grad is not None]
    total = sum(float(g.double().pow(2).sum()) for g in grads) ** 0.5
    coefficient = max_norm / (total + 1e-6)
    if coefficient < 1:
        torch._foreach_mul_(grads, torch.tensor(coefficient, dtype=torch.float64))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("system", choices=["fgpsdp", "torch"])
    parser.add_argument("out", help="where rank 0 writes the merged weights")
    parser.add_argument("--steps", type=int, default=12, help="the last step (1-based)")
    parser.add_argument("--checkpointing", default="none",
                        choices=["none", "reentrant", "nonreentrant"])
    parser.add_argument("--modules-to-save", default="",
                        help="peft's modules_to_save, comma separated (lm_head: trained whole)")
    parser.add_argument("--float64-clip", action="store_true",
                        help="torch: sum the clip's norm in float64, as fgpsdp does")
    parser.add_argument("--save", help="save the adapter and the optimizer here after --save-at")
    parser.add_argument("--save-at", type=int, default=6)
    parser.add_argument("--resume", help="resume from a --save directory")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    base = base_model(args.checkpointing)
    if args.resume:
        module = PeftModel.from_pretrained(base, os.path.join(args.resume, "adapter"),
                                           is_trainable=True)
    else:
        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, fan_in_fan_out=True,
                            target_modules=["c_attn", "c_proj"],
                            modules_to_save=[m for m in args.modules_to_save.split(",") if m])
        module = get_peft_model(base, config)
        # lora_B starts at zero, which leaves lora_A without a gradient at step 1.
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, param in module.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=g) * 0.02)
    trainable = [p for p in module.parameters() if p.requires_grad]

    if args.system == "fgpsdp":
        model = fgp.DistributedDataParallel(module)
        optimizer = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.01,
                                         param_groups=[{"params": trainable}],
                                         max_grad_norm=CLIP)
    else:
        model = torch.nn.parallel.DistributedDataParallel(module)
        optimizer = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.01)
    first = 0
    if args.resume:
        saved = torch.load(os.path.join(args.resume, "optimizer.pt"), weights_only=True)
        optimizer.load_state_dict(saved["optimizer"])
        first = saved["steps"]

    for step in range(first, args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        ids = torch.randint(0, VOCAB, (4, 32), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        if args.system == "torch" and args.float64_clip:
            clip_in_float64(trainable, CLIP)
        elif args.system == "torch":
            torch.nn.utils.clip_grad_norm_(trainable, CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.save and step + 1 == args.save_at:
            # The whole optimizer state, numbered as torch's over `trainable` (a collective).
            state = optimizer.full_state_dict() if args.system == "fgpsdp" \
                else optimizer.state_dict()
            if args.system == "fgpsdp":
                model.synchronize()  # the adapter's last all-gathers landed
            if rank == 0:
                module.save_pretrained(os.path.join(args.save, "adapter"))
                torch.save({"optimizer": state, "steps": step + 1},
                           os.path.join(args.save, "optimizer.pt"))
            dist.barrier()

    if args.system == "fgpsdp":
        model.synchronize()
    if rank == 0:
        merged = module.merge_and_unload()
        torch.save({k: v.detach().clone() for k, v in merged.state_dict().items()}, args.out)
    dist.barrier()
    del model, optimizer, module, base, trainable  # what holds the gloo group goes first
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
