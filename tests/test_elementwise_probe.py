"""The element-wise probe (fgpsdp_runtime/elementwise_probe.py): an optimizer class
from outside torch.optim is stepped at construction on small tensors, whole and in
flat pieces spread over instances, and refused where the two differ."""
import random
import warnings

import numpy
import pytest
import torch
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from fgpsdp_runtime import elementwise_probe
from fgpsdp_runtime.elementwise_probe import refuse_unless_elementwise

from . import elementwise_probe_scenarios as s
from .dist_harness import run_distributed
from .scenarios import AttributeCountingSGD, StepCountingSGD, TrainEvalSGD

CPU = torch.device("cpu")


def _probe(optimizer_class, groups=({},), **defaults):
    """The probe's verdict: None where accepted silently, else the refusal's or the
    warning's text (prefixed)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            refuse_unless_elementwise(optimizer_class, [dict(g) for g in groups], defaults, CPU)
        except TypeError as error:
            return "refused: " + str(error)
    ours = [w for w in caught if "fgpsdp" in str(w.message)]
    return "warned: " + str(ours[0].message) if ours else None


@pytest.fixture
def probing_torch_optim(monkeypatch):
    """torch.optim's classes are not probed (tested here directly instead): probed."""
    monkeypatch.setattr(elementwise_probe, "known_elementwise", lambda cls: False)


@pytest.mark.parametrize("optimizer_class, defaults", [
    (torch.optim.SGD, {"lr": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-2}),
    (torch.optim.Adam, {"lr": 1e-3, "amsgrad": True}),
    (torch.optim.AdamW, {"lr": 1e-5, "weight_decay": 0.1}),
    (torch.optim.AdamW, {"lr": 1e-3, "foreach": False}),
    (torch.optim.AdamW, {"lr": 1e-3, "fused": True}),
    (torch.optim.Adamax, {}), (torch.optim.NAdam, {"decoupled_weight_decay": True}),
    (torch.optim.RAdam, {}), (torch.optim.RMSprop, {"centered": True, "momentum": 0.9}),
    (torch.optim.Adagrad, {}), (torch.optim.Adadelta, {}), (torch.optim.ASGD, {}),
    (torch.optim.Rprop, {}),
])
def test_torch_optims_element_wise_classes_pass_the_probe(probing_torch_optim,
                                                           optimizer_class, defaults):
    """No false alarm where slices are known to train as whole tensors (fused
    kernels round by an element's place: float64 keeps that below the tolerance)."""
    assert _probe(optimizer_class, **defaults) is None


def test_torch_optims_adafactor_and_muon_are_told_apart_by_the_probe(probing_torch_optim):
    """(Refused by name before the probe; the probe would catch them too.)"""
    verdict = _probe(torch.optim.Adafactor)
    assert verdict.startswith("refused: Adafactor is not element-wise: stepped on flat "
                              "pieces"), verdict
    assert "129x33 tensor" in verdict
    verdict = _probe(torch.optim.Muon)
    assert verdict.startswith("refused: Muon cannot run on flat slices: its step raised on "
                              "1-D pieces"), verdict


def test_torch_optim_is_not_probed():
    assert elementwise_probe.known_elementwise(torch.optim.AdamW)
    assert not elementwise_probe.known_elementwise(s.HandWrittenLion)
    assert not elementwise_probe.known_elementwise(StepCountingSGD)


@pytest.mark.parametrize("optimizer_class", [
    s.HandWrittenLion, StepCountingSGD, AttributeCountingSGD,
    TrainEvalSGD,  # steps only in train mode: the probe enters it, as a loop would
])
def test_element_wise_optimizers_are_accepted(optimizer_class):
    assert _probe(optimizer_class) is None


@pytest.mark.parametrize("optimizer_class", [
    s.TrustRatioSGD, s.PerTensorClipSGD, s.MatrixDecaySGD, s.FactoredRMSProp,
    s.FactoredFrom32RMSProp,  # factors where two dimensions reach 32 (big_vision's rule)
    s.GlobalNormSGD,  # whole-instance sums: only the split over instances tells
    s.NormHistorySGD,  # acts only where the probe's gradients change scale between steps
    s.NoisySGD,
])
def test_optimizers_that_are_not_element_wise_are_refused(optimizer_class):
    verdict = _probe(optimizer_class)
    assert verdict is not None and verdict.startswith(
        f"refused: {optimizer_class.__name__} is not element-wise: stepped on flat pieces "
        "of its parameters spread over several instances"), verdict
    assert "check_elementwise=False runs it anyway" in verdict


def test_a_group_setting_is_probed_with_its_group():
    assert _probe(s.CentralizedSGD) is None
    assert _probe(s.CentralizedSGD, groups=({"centralize": False},)) is None
    verdict = _probe(s.CentralizedSGD, groups=({"centralize": False}, {"centralize": True}))
    assert verdict is not None and "CentralizedSGD is not element-wise" in verdict


def test_one_that_cannot_step_a_flat_piece_is_refused_with_its_error():
    verdict = _probe(s.MatrixOnlySGD)
    assert verdict is not None and verdict.startswith(
        "refused: MatrixOnlySGD cannot run on flat slices: its step raised on 1-D pieces"), \
        verdict
    assert "ValueError: only 2-D parameters" in verdict


def test_one_that_takes_fewer_shapes_is_compared_on_those_it_takes():
    """WholeShapeRefusingSGD refuses the 3-D tensor: compared on the matrix alone."""
    assert _probe(s.WholeShapeRefusingSGD) is None


@pytest.mark.parametrize("optimizer_class, error", [
    (s.VectorOnlySGD, "ValueError: only 1-D parameters"),
    # Raises on the pieces too, yet is not refused: the runtime's slices would be of
    # the model's dtype.
    (s.BFloat16OnlySGD, "TypeError: bfloat16 parameters only"),
    # Stepped the lone matrix without moving it: nothing to compare either.
    (s.PairedSGD, "its step moved none of the small tensors"),
])
def test_with_nothing_to_compare_it_is_accepted_with_a_warning(optimizer_class, error):
    verdict = _probe(optimizer_class)
    assert verdict is not None and verdict.startswith(
        f"warned: fgpsdp: could not check that {optimizer_class.__name__} is "
        "element-wise"), verdict
    assert error in verdict


def test_the_probe_leaves_no_trace():
    """The random stream (NoisySGD draws from it), the global optimizer hooks (not
    called, still registered) and a tensor in the user's group settings."""
    calls = []
    pre = register_optimizer_step_pre_hook(lambda *args: calls.append("pre"))
    post = register_optimizer_step_post_hook(lambda *args: calls.append("post"))
    try:
        rng, python_rng, numpy_rng = torch.get_rng_state(), random.getstate(), \
            numpy.random.get_state()
        assert _probe(s.NoisySGD) is not None
        assert _probe(s.NumPyNoisySGD) is not None
        assert torch.equal(rng, torch.get_rng_state())
        assert python_rng == random.getstate()
        assert all(numpy.array_equal(a, b) if isinstance(a, numpy.ndarray) else a == b
                   for a, b in zip(numpy_rng, numpy.random.get_state()))
        count = torch.zeros(())
        assert _probe(s.CountingGroupTensorSGD, groups=({"count": count},)) is None
        assert float(count) == 0.0
        assert calls == []
        probe = torch.nn.Parameter(torch.zeros(2))
        probe.grad = torch.ones(2)
        torch.optim.SGD([probe], lr=0.1).step()
        assert calls == ["pre", "post"]  # still registered
    finally:
        pre.remove()
        post.remove()


def test_objects_in_the_settings_are_copied_for_each_instance():
    """The user's schedule object is not called; each instance calls its own copy
    (shared, the pieces' three instances would advance it three times a step)."""
    schedule = s.Countdown()
    assert _probe(s.ScheduledSGD, groups=({"schedule": schedule},)) is None
    assert schedule.calls == 0
    generator = torch.Generator().manual_seed(3)
    state = generator.get_state()
    assert _probe(s.CentralizedSGD, groups=({"centralize": False, "generator": generator,
                                              "betas": (torch.tensor(0.9), 0.99)},)) is None
    assert torch.equal(state, generator.get_state())


def test_a_hook_the_class_registers_while_built_stays_registered():
    assert _probe(s.SelfRegisteringSGD) is None
    try:
        calls = s.SelfRegisteringSGD.calls
        probe = torch.nn.Parameter(torch.zeros(2))
        probe.grad = torch.ones(2)
        torch.optim.SGD([probe], lr=0.1).step()
        assert s.SelfRegisteringSGD.calls == calls + 1
    finally:
        s.SelfRegisteringSGD.registered.remove()


def test_a_compiled_step_is_not_compiled_for_the_probe():
    """(It would spend torch.compile's recompile limit on the probe's float64 tensors.)"""
    torch._dynamo.reset()
    assert _probe(s.CompiledStepSGD) is None
    assert s.CompiledStepSGD.graphs == 0
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.ones(4)
    s.CompiledStepSGD([p]).step()
    assert s.CompiledStepSGD.graphs == 1  # compiled outside the probe


def test_the_probe_draws_on_the_cpu_under_another_default_device():
    with torch.device("meta"):
        assert _probe(s.HandWrittenLion) is None


def test_a_class_that_draws_gets_the_same_verdict_whatever_the_random_state():
    """As on ranks seeded apart: the refusal's text (its figures) is the same, so every
    rank raises the same error (the constructor compares them)."""
    verdicts = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        numpy.random.seed(seed)
        verdicts.append((_probe(s.NoisySGD), _probe(s.NumPyNoisySGD)))
    assert verdicts[0] == verdicts[1] and None not in verdicts[0]


def test_the_cuts_fall_off_power_of_two_blocks():
    total = sum(torch.Size(shape).numel() for shape in elementwise_probe._SHAPES)
    cuts = elementwise_probe._cuts(total)
    assert cuts[0] == 0 and cuts[-1] == total and cuts == sorted(set(cuts))
    assert all(c % 2 == 1 for c in cuts[1:-1])
    # Every "rank" holds a piece of the largest tensor's flat range or of the rest.
    assert len(cuts) == elementwise_probe._RANKS + 1


def test_through_the_wrapper_refused_on_every_rank_or_skipped():
    for check, kwargs in ((True, {"lr": 0.1}), (False, {"lr": 0.1})):
        results = run_distributed(2, s.built_with, s.TrustRatioSGD, check, kwargs)
        if check:
            assert all(r is not None and "TrustRatioSGD is not element-wise" in r
                       for r in results), results
        else:
            assert results == [None, None]


def test_from_optimizer_probes_too():
    refused, built = (run_distributed(2, s.converted, check) for check in (True, False))
    assert all(r is not None and "TrustRatioSGD is not element-wise" in r for r in refused)
    assert built == [None, None]


def test_each_group_is_probed_with_its_settings_through_the_wrapper():
    refused = run_distributed(2, s.group_setting_reaches_the_probe, True)
    assert all(r is not None and "CentralizedSGD is not element-wise" in r for r in refused)
    assert run_distributed(2, s.group_setting_reaches_the_probe, False) == [None, None]


def test_an_accepted_optimizer_trains_as_under_torch_ddp():
    for res in run_distributed(2, s.lion_beside_torch_ddp):
        assert res["same rng"]
        assert res["max diff"] == 0.0, res


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("defaults", [{"lr": 1e-3}, {"lr": 1e-3, "fused": True},
                                      {"lr": 1e-3, "capturable": True}])
def test_on_cuda_torch_adamw_passes_and_a_layer_wise_one_does_not(probing_torch_optim,
                                                                  defaults):
    """The probe runs where the slices live (CUDA-only optimizers need it there), and
    leaves the device's random stream as it was."""
    cuda = torch.device("cuda")
    rng = torch.cuda.get_rng_state(cuda)
    refuse_unless_elementwise(torch.optim.AdamW, [{}], defaults, cuda)
    with pytest.raises(TypeError, match="TrustRatioSGD is not element-wise"):
        refuse_unless_elementwise(s.TrustRatioSGD, [{}], {"lr": 0.1}, cuda)
    assert torch.equal(rng, torch.cuda.get_rng_state(cuda))
