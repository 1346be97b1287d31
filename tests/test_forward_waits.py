"""Where the forward waits for each bucket (one process, no all-gathers: the waits are logged)."""
import pytest
import torch
from torch import nn

from fgpsdp_runtime.forward_waits import ForwardParamWaiter


class ThreeLayers(nn.Module):
    def __init__(self, read: str, log: list):
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.mid = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)
        self.read = read
        self.log = log

    def forward(self, x):
        if self.read == "values":
            scale = self.out.weight.norm()  # the values, before self.out runs
        else:
            scale = torch.ones((), dtype=self.out.weight.dtype)  # metadata only
        h = self.inp(x)
        if self.read == "skip mid":  # mid not called, its weight read in its place
            self.log.append("read mid")
            h = torch.nn.functional.linear(h, self.mid.weight, self.mid.bias)
        else:
            h = self.mid(h)
        return self.out(h) / scale


def waits_in_a_followed_forward(read: str, deviations: int = 0) -> list:
    """The log of the second forward: the first records (``read`` as "metadata"
    there when it is "skip mid"), the second follows the recording."""
    log = []
    model = ThreeLayers("metadata" if read == "skip mid" else read, log)
    bucket_of = {id(p): [2] for p in model.inp.parameters()}
    bucket_of.update({id(p): [1] for p in model.mid.parameters()})
    bucket_of.update({id(p): [0] for p in model.out.parameters()})
    waiter = ForwardParamWaiter(model, bucket_of, lambda b: log.append(f"wait b{b}"),
                                lambda: log.append("wait all"),
                                lambda: log.append("direct call"))
    for name in ("inp", "mid", "out"):  # after the waiter's hooks, which run first
        getattr(model, name).register_forward_pre_hook(lambda *_, n=name: log.append(f"run {n}"))
    for forward in range(2):
        log.clear()
        if forward == 1:
            model.read = read
        waiter.begin_forward()
        model(torch.ones(1, 3))
        waiter.end_forward()
    assert waiter.deviations == deviations
    return log


@pytest.mark.parametrize("read, expected", [
    # Only the dtype is read early: each layer's bucket is waited for as the module
    # before it returns (inp's, called from inside the root, at the root's pre-hook).
    ("metadata", ["wait b2", "run inp", "wait b1", "run mid", "wait b0", "run out",
                  "wait all"]),
    # The parent reads out's weight before calling anything: the parent waits for it.
    ("values", ["wait b0", "wait b2", "run inp", "wait b1", "run mid", "run out",
                "wait all"]),
])
def test_a_parameter_is_waited_for_before_its_first_read(read, expected):
    assert waits_in_a_followed_forward(read) == expected


def test_a_skipped_module_read_in_its_place_is_waited_for():
    # The forward skips mid and reads its weight; the other order is seen only at
    # out's pre-hook, after the read, but mid's bucket was waited for as inp
    # returned (before: the read came first, of the old values).
    log = waits_in_a_followed_forward("skip mid", deviations=1)
    assert log == ["wait b2", "run inp", "wait b1", "read mid", "wait all", "run out",
                   "wait all"]


@pytest.mark.parametrize("first_forward_builds_a_graph", [False, True])
def test_an_eval_forward_before_the_first_recording_takes_torchs_fast_path(
        first_forward_builds_a_graph):
    # The recording forward runs under a torch function mode, which turns off the
    # fast paths of nn.MultiheadAttention and nn.TransformerEncoderLayer (their
    # fused kernels round apart from the slow path): an eval under no_grad (a
    # Lightning sanity check, an eval before training) is not the recording one, and
    # gives the module's own output bit for bit; the next forward with autograd
    # records.
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, batch_first=True).eval()
    x = torch.randn(3, 5, 16)
    with torch.no_grad():
        alone = layer(x)
    bucket_of = {id(p): [0] for p in layer.parameters()}
    waiter = ForwardParamWaiter(layer, bucket_of, lambda b: None, lambda: None, lambda: None)
    if first_forward_builds_a_graph:
        waiter.begin_forward()
        layer(x)
        waiter.end_forward()
        assert waiter._recorded is not None
    with torch.no_grad():  # (as a loop calls the wrapper)
        waiter.begin_forward()
        wrapped = layer(x)
        waiter.end_forward()
    assert torch.equal(wrapped, alone)
    if not first_forward_builds_a_graph:
        assert waiter._recorded is None  # not learnt there
        waiter.begin_forward()
        layer(x).sum().backward()
        waiter.end_forward()
        assert waiter._recorded
