"""What an inner step writes outside its pieces' state (step_wide_state.py), without
processes: written entries are kept once per step, untouched tensor entries are told
apart by their version counters, without reading their values."""
import torch

from fgpsdp_runtime.step_wide_state import StepWideState

from .scenarios import AttributeCountingSGD, StepCountingSGD
from .test_speculation import _CountingEqual


def _params():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(3))]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def test_a_tensor_learning_rate_nothing_writes_is_neither_read_nor_replaced(monkeypatch):
    params = _params()
    lr = torch.tensor(1e-2)
    opt = torch.optim.AdamW(params, lr=lr, foreach=False)
    wide = StepWideState(opt)
    equal = _CountingEqual(monkeypatch)
    for _ in range(2):  # two runs of one step (two chunks of buckets)
        with wide.run():
            opt.step()
    wide.end_step(stepped=True)
    assert equal.calls == 0  # on a GPU each would wait for the device
    assert opt.param_groups[0]["lr"] is lr  # the loop's tensor, which its scheduler fills


def test_entries_written_in_place_are_kept_once_per_step(monkeypatch):
    """StepCountingSGD counts in a tensor group entry and a tensor of the optimizer's
    own state, both in place (apex's capturable FusedAdam, MADGRAD): two runs of one
    step count once, and the counts are the step's."""
    opt = StepCountingSGD(_params())
    wide = StepWideState(opt)
    equal = _CountingEqual(monkeypatch)
    for step in range(1, 3):
        for _ in range(2):
            with wide.run():
                opt.step()
        wide.end_step(stepped=True)
        assert float(opt.param_groups[0]["t"]) == step
        assert opt.param_groups[0]["k"] == step
        assert int(opt.state["steps"]) == step
    assert equal.calls > 0  # written in place: told by value
    with wide.run():
        opt.step()
    wide.end_step(stepped=False)  # a skipped step (an overflow) counts nothing
    assert float(opt.param_groups[0]["t"]) == 2 and int(opt.state["steps"]) == 2


def test_plain_numbers_on_the_optimizer_object_count_once_per_step():
    """AttributeCountingSGD counts in ``self.n_steps`` (set at construction) and
    ``self.calls`` (created by its first step): two runs of one step count once, a
    skipped step and discarded runs count nothing, and the runs step with the count
    the step started from. Its flag ``self.ready`` (a bool) stays as the first run
    set it."""
    params = _params()
    opt = AttributeCountingSGD(params)
    wide = StepWideState(opt)
    seen = []
    for step in range(1, 3):
        for _ in range(2):
            with wide.run():
                opt.step()
                seen.append((opt.n_steps, opt.calls))
            assert opt.n_steps == step - 1  # put back after each run
            assert opt.ready
        wide.end_step(stepped=True)
        assert (opt.n_steps, opt.calls) == (step, step)
    assert seen == [(1, 1), (1, 1), (2, 2), (2, 2)]
    with wide.run():
        opt.step()
    wide.end_step(stepped=False)  # a skipped step (an overflow)
    with wide.run():
        opt.step()
    wide.discard()  # speculative runs undone without a step
    wide.end_step(stepped=True)
    assert (opt.n_steps, opt.calls) == (2, 2)
    fresh = AttributeCountingSGD(_params())
    fresh_wide = StepWideState(fresh)
    with fresh_wide.run():
        fresh.step()
    assert not hasattr(fresh, "calls")  # created by the run: gone until the step ends
    fresh_wide.end_step(stepped=True)
    assert fresh.calls == 1
