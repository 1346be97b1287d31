"""Where the forward waits for each bucket (one process, no all-gathers: the waits are logged)."""
import pytest
import torch
from torch import nn

from fgpsdp_runtime.forward_waits import ForwardParamWaiter


class TwoLayers(nn.Module):
    def __init__(self, read: str):
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.out = nn.Linear(4, 2)
        self.read = read

    def forward(self, x):
        if self.read == "values":
            scale = self.out.weight.norm()  # the values, before self.out runs
        else:
            scale = torch.ones((), dtype=self.out.weight.dtype)  # metadata only
        return self.out(self.inp(x)) / scale


def waits_in_a_followed_forward(read: str) -> list:
    model = TwoLayers(read)
    bucket_of = {id(p): [1] for p in model.inp.parameters()}
    bucket_of.update({id(p): [0] for p in model.out.parameters()})
    log = []
    waiter = ForwardParamWaiter(model, bucket_of, lambda b: log.append(f"wait b{b}"),
                                lambda: log.append("wait all"),
                                lambda: log.append("direct call"))
    for name in ("inp", "out"):  # after the waiter's hooks, which run first
        getattr(model, name).register_forward_pre_hook(lambda *_, n=name: log.append(f"run {n}"))
    for _ in range(2):  # the first forward records, the second follows the recording
        log.clear()
        waiter.begin_forward()
        model(torch.ones(1, 3))
        waiter.end_forward()
    assert waiter.deviations == 0
    return log


@pytest.mark.parametrize("read, expected", [
    # Only the dtype is read early: each layer waits for its own bucket.
    ("metadata", ["wait b1", "run inp", "wait b0", "run out", "wait all"]),
    # The parent reads out's weight before calling it: the parent waits for it.
    ("values", ["wait b0", "wait b1", "run inp", "run out", "wait all"]),
])
def test_a_parameter_is_waited_for_before_its_first_read(read, expected):
    assert waits_in_a_followed_forward(read) == expected
