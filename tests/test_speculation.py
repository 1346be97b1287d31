"""Undo records of speculative steps and the hyperparameters they ran with (no processes)."""
import torch

from fgpsdp_runtime.speculation import (PackedCopies, SliceBackup, hyperparameters,
                                        same_hyperparameters)


def _adamw(lr=1e-2):
    params = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(3))]
    opt = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "lr": 3e-3}], lr=lr)
    return params, opt


def test_restore_puts_back_parameters_and_state_bit_for_bit():
    params, opt = _adamw()
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # state exists for both
    shard = torch.cat([p.detach() for p in params])
    backup = SliceBackup(shard, torch.randn(8), params, opt.state)
    saved_shard = shard.clone()
    saved_state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    shard.add_(1.0)
    opt.step()
    backup.restore(shard, params, opt.state)
    assert torch.equal(shard, saved_shard)
    for p in params:
        for k, v in saved_state[id(p)].items():
            assert torch.equal(opt.state[p][k], v), k


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def test_packed_copies_are_bit_for_bit_and_independent():
    """1-D and 0-dim tensors are packed per dtype, others cloned; -0.0, NaN payloads
    and subnormals survive (also with subnormals flushed, as the benchmarks run)."""
    odd = torch.tensor([-0.0, float("nan"), 1e-40, -1e-45, 3.0])
    odd.view(torch.int32)[1] = 0x7FA00001  # a signalling NaN's payload
    tensors = [odd, torch.tensor(7.0), torch.arange(4, dtype=torch.int64),
               torch.randn(2, 3), torch.tensor(2, dtype=torch.int64), torch.zeros(0),
               torch.randn(6)[::2], torch.tensor(-0.0)]
    torch.set_flush_denormal(True)  # (a CPU without it still checks the rest)
    try:
        packed = PackedCopies(tensors)
    finally:
        torch.set_flush_denormal(False)
    originals = [_bits(t).clone() for t in tensors]
    for t in tensors:
        t.fill_(1)
    copies = packed.unpacked()
    assert len(copies) == len(tensors)
    for copy, original, t in zip(copies, originals, tensors):
        assert copy.shape == t.shape and copy.dtype == t.dtype
        assert torch.equal(_bits(copy), original)


class _Marked(torch.Tensor):
    """A tensor subclass (as a DTensor or a quantisation library's would be)."""


def test_packed_copies_keep_each_tensors_type():
    """torch.cat of a subclass and a plain tensor returns the subclass for both: only
    plain tensors are packed."""
    tensors = [torch.randn(3).as_subclass(_Marked), torch.randn(4), torch.tensor(1.0)]
    copies = PackedCopies(tensors).unpacked()
    assert [type(c) for c in copies] == [type(t) for t in tensors]
    assert all(torch.equal(c.as_subclass(torch.Tensor), t.as_subclass(torch.Tensor))
               for c, t in zip(copies, tensors))


def test_restore_puts_back_state_of_every_kind():
    """Tensor entries of several shapes and dtypes, a plain number and an entry the
    step replaced by a number, or added: each as it was."""
    pieces = [torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(2))]
    state = {pieces[0]: {"step": torch.tensor(3.0), "m": torch.randn(4),
                         "table": torch.randn(2, 2), "count": 5},
             pieces[1]: {"step": torch.tensor(1, dtype=torch.int64), "m": torch.randn(2)}}
    saved = {p: {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                 for k, v in entries.items()} for p, entries in state.items()}
    shard = torch.randn(6)
    backup = SliceBackup(shard, torch.zeros(6), pieces, state)
    for entries in state.values():
        for v in entries.values():
            if isinstance(v, torch.Tensor):
                v.add_(1)
    state[pieces[0]]["count"] = 6
    state[pieces[0]]["m"] = 0.5  # a tensor entry replaced by a number
    state[pieces[1]]["new"] = torch.ones(2)
    backup.restore(shard, pieces, state)
    for p, entries in saved.items():
        assert list(state[p]) == list(entries)
        for k, v in entries.items():
            got = state[p][k]
            assert torch.equal(got, v) if isinstance(v, torch.Tensor) else got == v, k


def test_restore_drops_state_the_speculative_step_created():
    params, opt = _adamw()
    shard = torch.zeros(8)
    backup = SliceBackup(shard, torch.zeros(8), params, opt.state)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert all(p in opt.state for p in params)
    backup.restore(shard, params, opt.state)
    assert not any(p in opt.state for p in params)


def test_the_step_writes_a_copy_of_the_gradient_kept_only_on_commit():
    """torch's foreach SGD with nesterov adds momentum * buf into the gradient: the
    reduced gradient must stay for a redone step; a committed step leaves what it
    wrote, as torch leaves it in param.grad."""
    params = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(3))]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, foreach=True)
    grad_shard = torch.randn(8)
    reduced = grad_shard.clone()
    backup = SliceBackup(torch.zeros(8), grad_shard, params, opt.state)
    params[0].grad, params[1].grad = backup.grad[:5], backup.grad[5:]  # as speculative_step
    opt.step()
    assert torch.equal(grad_shard, reduced) and not torch.equal(backup.grad, reduced)
    backup.keep_written_gradient(grad_shard)
    assert torch.equal(grad_shard, backup.grad)


def test_hyperparameters_are_a_copy_and_changes_are_seen():
    _, opt = _adamw()
    before = hyperparameters(opt.param_groups, cpu_arithmetic=True)
    assert all("params" not in g for g in before.groups)
    assert same_hyperparameters(before, hyperparameters(opt.param_groups, cpu_arithmetic=True))
    opt.param_groups[1]["lr"] = 1e-3
    assert before.groups[1]["lr"] == 3e-3  # a copy, not the live groups
    assert not same_hyperparameters(before, hyperparameters(opt.param_groups, cpu_arithmetic=True))
    opt.param_groups[1]["lr"] = 3e-3
    opt.param_groups[0]["betas"] = (0.9, 0.95)
    assert not same_hyperparameters(before, hyperparameters(opt.param_groups, cpu_arithmetic=True))


def test_a_new_entry_a_new_group_or_an_unknown_record_differ():
    _, opt = _adamw()
    before = hyperparameters(opt.param_groups, cpu_arithmetic=True)
    opt.param_groups[0]["initial_lr"] = 1e-2  # as an lr scheduler built later adds
    assert not same_hyperparameters(before, hyperparameters(opt.param_groups, cpu_arithmetic=True))
    _, opt = _adamw()
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))]})
    assert not same_hyperparameters(before, hyperparameters(opt.param_groups, cpu_arithmetic=True))
    assert not same_hyperparameters(None, before)


def test_tensor_learning_rates_compare_by_value():
    _, opt = _adamw(lr=torch.tensor(1e-2))
    before = hyperparameters(opt.param_groups, cpu_arithmetic=True)
    assert same_hyperparameters(before, hyperparameters(opt.param_groups, cpu_arithmetic=True))
    opt.param_groups[0]["lr"].fill_(5e-3)  # changed in place: the copy must not follow
    assert not same_hyperparameters(before, hyperparameters(opt.param_groups, cpu_arithmetic=True))
    opt.param_groups[0]["lr"] = 1e-2  # the same value as a float is another type
    assert not same_hyperparameters(before, hyperparameters(opt.param_groups, cpu_arithmetic=True))


class _CountingEqual:
    """torch.equal, counting its calls: on a GPU each one waits for the device."""

    def __init__(self, monkeypatch):
        self.calls = 0
        original = torch.equal

        def counting(a, b):
            self.calls += 1
            return original(a, b)
        monkeypatch.setattr(torch, "equal", counting)


def test_an_untouched_tensor_hyperparameter_is_not_read(monkeypatch):
    """Two records of the same tensor, unwritten in between, are equal by its version
    counter; one written in place, or another tensor, is compared by value."""
    _, opt = _adamw(lr=torch.tensor(1e-2))
    opt.param_groups[0]["betas"] = (torch.tensor(0.9), 0.999)  # a tensor in a tuple too
    equal = _CountingEqual(monkeypatch)
    before = hyperparameters(opt.param_groups, cpu_arithmetic=True)
    assert same_hyperparameters(before, hyperparameters(opt.param_groups, cpu_arithmetic=True))
    assert equal.calls == 0
    opt.param_groups[0]["betas"][0].fill_(0.9)  # written, the same value
    assert same_hyperparameters(before, hyperparameters(opt.param_groups, cpu_arithmetic=True))
    assert equal.calls == 1
    opt.param_groups[0]["lr"].fill_(5e-3)
    assert not same_hyperparameters(before, hyperparameters(opt.param_groups, cpu_arithmetic=True))
    opt.param_groups[0]["lr"] = torch.tensor(1e-2)  # another tensor, the recorded value
    assert same_hyperparameters(before, hyperparameters(opt.param_groups, cpu_arithmetic=True))
