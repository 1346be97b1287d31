"""ShardedOptimizer.from_optimizer: a torch.optim optimizer built over the module's
parameters, converted once the module is wrapped, trains as that optimizer does
under torch DDP (bitwise, 2 CPU ranks). Refusals: tests/test_bad_input.py."""
import inspect

import pytest
import torch

from fgpsdp_runtime.optimizer_conversion import (constructor_defaults, conversion_problem,
                                                 param_groups_to_give)

from .dist_harness import run_distributed
from .optimizer_conversion_scenarios import converted_beside_torch_ddp

# torch.optim takes (name, parameter) pairs since 2.6.
NAMED_PARAMS = "param_names" in inspect.getsource(torch.optim.Optimizer.add_param_group)


@pytest.mark.parametrize("schedule, stepped_before, named", [
    ("two_stage", True, True),
    ("next_forward", False, False),
    ("serial", True, False),
])
def test_a_converted_optimizer_trains_as_it_does_under_torch_ddp(schedule, stepped_before,
                                                                 named):
    if named and not NAMED_PARAMS:
        pytest.skip("this torch's optimizers take no named parameters")
    for rank, res in enumerate(run_distributed(2, converted_beside_torch_ddp, schedule,
                                               stepped_before, named, timeout_s=180)):
        assert res["class"] == "AdamW"
        assert res["same object again"], "a ShardedOptimizer given again was converted"
        assert res["max diff"] == 0.0, (rank, res["max diff"])
        # Both groups' hyperparameters, as given (lr, weight decay and betas differ
        # from AdamW's defaults).
        assert res["groups"] == res["torch groups"]
        assert res["groups"][1]["lr"] == 3e-3 and res["groups"][0]["betas"] == (0.8, 0.99)
        # torch's numbering, the frozen weight (index 0) numbered but never stepped.
        assert res["state keys"][0] == res["state keys"][1] == [1, 2, 3, 4, 5]
        assert res["moments diff"] == 0.0, (rank, res["moments diff"])
        assert not res["frozen weight moved"]
        if named:
            assert res["param_names"][0] == res["param_names"][1]
            assert res["param_names"][0][0] == ["net.0.weight", "net.2.weight", "net.4.weight"]


def test_constructor_defaults_are_the_arguments_the_constructor_takes():
    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.5)
    given = constructor_defaults(torch.optim.AdamW, adamw.defaults)
    assert given["lr"] == 0.5 and "params" not in given
    if "decoupled_weight_decay" in adamw.defaults:  # torch >= 2.7: AdamW is an Adam
        assert "decoupled_weight_decay" not in given  # AdamW's constructor refuses it
    # A subclass passing **kwargs on (HF's and timm's pattern): read with AdamW's.
    assert constructor_defaults(KwargsAdamW, adamw.defaults) == given
    KwargsAdamW([torch.nn.Parameter(torch.zeros(2))], **given)  # (found by an audit:
    # every entry was given, and AdamW refused decoupled_weight_decay)

    class SelfDefaults(torch.optim.Optimizer):  # its defaults are its **kwargs
        def __init__(self, params, **kwargs):
            super().__init__(params, kwargs)

    # (Found by a review: none were given, and its step read self.defaults["lr"].)
    assert constructor_defaults(SelfDefaults, {"lr": 1, "extra": 2}) == {"lr": 1, "extra": 2}

    class FixedSGD(torch.optim.SGD):  # takes no hyperparameter
        def __init__(self, params):
            super().__init__(params, lr=0.1)

    assert constructor_defaults(FixedSGD, torch.optim.SGD([adamw.param_groups[0]["params"][0]],
                                                          lr=0.1).defaults) == {}


class KwargsAdamW(torch.optim.AdamW):
    def __init__(self, params, lr=1e-3, **kwargs):
        super().__init__(params, lr=lr, **kwargs)


class FusedAdamLike(torch.optim.Adam):
    """apex's FusedAdam keeps adam_w_mode as an attribute, outside its defaults."""

    def __init__(self, params, lr=1e-3, adam_w_mode=True, **kwargs):
        super().__init__(params, lr=lr, **kwargs)
        self.adam_w_mode = adam_w_mode


class TimmLikeScheduler:
    """timm's schedulers are not torch's: a step(), the optimizer, the bases."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self.base_values = [g["initial_lr"] for g in optimizer.param_groups]

    def step(self, epoch):
        pass


def test_param_groups_are_given_as_torch_optim_takes_them():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    sgd = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": 0.2}], lr=0.1)
    groups = param_groups_to_give(sgd)
    assert [g["params"] for g in groups] == [[a], [b]]
    assert groups[1]["lr"] == 0.2 and groups[0]["lr"] == 0.1
    assert groups[0]["params"] is not sgd.param_groups[0]["params"]  # a copy
    if NAMED_PARAMS:
        named = torch.optim.SGD([("a", a), ("b", b)], lr=0.1)
        assert param_groups_to_give(named)[0]["params"] == [("a", a), ("b", b)]
        assert "param_names" not in param_groups_to_give(named)[0]


def test_a_plain_optimizer_converts_and_what_would_be_lost_is_named():
    p = torch.nn.Parameter(torch.zeros(2))
    assert conversion_problem(torch.optim.Adam([p])) is None
    assert conversion_problem(object())[0] is TypeError
    scheduled = torch.optim.Adam([p])
    scheduler = torch.optim.lr_scheduler.LambdaLR(scheduled, lambda step: 1.0)
    assert "lr scheduler (LambdaLR)" in conversion_problem(scheduled)[1]
    assert scheduler.optimizer is scheduled
    hooked = torch.optim.Adam([p])
    hooked.register_load_state_dict_post_hook(lambda opt: None)
    assert conversion_problem(hooked)[1].startswith(
        "this optimizer has hooks registered on it (load_state_dict_post_hooks): "
        "register them on the optimizer from_optimizer returns instead")


@pytest.mark.parametrize("make", [
    lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt),  # leaves no mark on opt
    TimmLikeScheduler,
    lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2),
], ids=["ReduceLROnPlateau", "timm-like", "StepLR"])
@pytest.mark.parametrize("state_dict_read", [False, True])
def test_every_kind_of_live_lr_scheduler_holding_the_optimizer_is_found(make, state_dict_read):
    """Found by an audit: a ReduceLROnPlateau built before fabric.setup went on
    scheduling the old optimizer (0.233 from torch DDP), silently. Once its
    state_dict() was read, torch's scheduler is referred to through its __dict__."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    scheduler = make(opt)
    if state_dict_read and hasattr(scheduler, "state_dict"):
        scheduler.state_dict()
    problem = conversion_problem(opt)
    assert problem is not None and problem[0] is ValueError
    assert f"an lr scheduler ({type(scheduler).__name__}) was built on this optimizer" \
        in problem[1]
    # Dropped, it schedules nothing: its marks (initial_lr, its wrapper on step) are
    # no refusal (found by a review: a checkpoint's groups carry initial_lr).
    del scheduler
    assert conversion_problem(opt) is None


def test_a_scheduler_in_a_reference_cycle_once_dropped_is_not_found():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    scheduler.itself = scheduler  # freed by the collector alone, at its own time
    del scheduler
    assert conversion_problem(opt) is None


def test_objects_referring_to_the_optimizer_are_read_without_their_properties():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)

    class Logger:  # found by a review: its property raised on one rank alone
        def __init__(self, optimizer):
            self.optimizer = optimizer

        @property
        def step(self):
            raise RuntimeError("not now")

        last_epoch = 0

    logger = Logger(opt)
    assert conversion_problem(opt) is None
    assert logger.optimizer is opt


class _Odd:
    """Slots, and a __getattr__ that raises what getattr() does not catch."""

    __slots__ = ("held",)

    def __getattr__(self, name):
        raise RuntimeError(f"not now: {name}")


def test_objects_referring_to_a_dict_holding_the_optimizer_are_read_safely():
    """Found by an audit: such an object's __getattr__ raised out of the search."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    odd = _Odd()
    odd.held = {"optimizer": opt}
    assert conversion_problem(opt) is None
    assert odd.held["optimizer"] is opt


def test_a_stepped_fused_optimizer_converts():
    """Found by a review: torch's private flags set by a step read as settings lost."""
    p = torch.nn.Parameter(torch.ones(4))
    for cls in (torch.optim.SGD, torch.optim.Adagrad, torch.optim.Adam):
        opt = cls([p], lr=0.1, fused=True)
        p.grad = torch.ones(4)
        opt.step()
        assert conversion_problem(opt) is None, cls


def test_settings_kept_outside_the_defaults_are_refused():
    """Found by an audit: apex's FusedAdam with adam_w_mode=False was rebuilt with
    True, its default (0.112 from torch DDP), silently."""
    p = torch.nn.Parameter(torch.zeros(2))
    assert conversion_problem(FusedAdamLike([p])) is None  # its default: nothing lost
    problem = conversion_problem(FusedAdamLike([p], adam_w_mode=False, weight_decay=0.5))
    assert problem[0] is ValueError
    assert "FusedAdamLike was built with arguments it keeps outside its defaults " \
        "(adam_w_mode=False, default: True)" in problem[1]


def _restore_state(optimizer):
    """A hook an optimizer's class registers on every instance (torch-optimi's)."""


class RegistersItsOwnHook(torch.optim.AdamW):
    def __init__(self, params, lr=1e-3):
        super().__init__(params, lr=lr)
        self.register_load_state_dict_post_hook(_restore_state)


def test_every_hook_is_refused_and_the_message_says_what_to_do_with_a_classs_own():
    """A review found the loop's hook defined beside its optimizer class dropped
    silently when hooks defined beside the class passed for the class's own."""
    opt = RegistersItsOwnHook([torch.nn.Parameter(torch.zeros(2))])
    problem = conversion_problem(opt)
    assert problem[0] is ValueError
    assert "hooks registered on it (load_state_dict_post_hooks)" in problem[1]
    assert "build fgp.ShardedOptimizer(model, RegistersItsOwnHook, ...) directly" in problem[1]


def _named(name: str, base=torch.optim.SGD) -> type:
    return type(name, (base,), {})


class UsesGC(torch.optim.SGD):
    """pytorch_optimizer's Ranger keeps use_gc (gradient centralization) as an attribute."""

    def __init__(self, params, lr=0.1, use_gc=True):
        super().__init__(params, lr=lr)
        self.use_gc = use_gc


def test_which_optimizers_are_refused_as_not_element_wise():
    """A review found jettify's Ranger, RangerQH and RangerVA element-wise
    (RAdam / QHAdam with Lookahead: refused by a name part before), and AdamP, SGDP,
    Nero and Fromage not (1e-5 to 1.49 from the whole tensor's update on slices);
    sharpness-aware ones (SAM) scale by the whole model's gradient norm."""
    from fgpsdp_runtime.optimizer_kinds import refuse_unsliceable, refuse_unsliceable_settings
    for name in ("Ranger", "RangerQH", "RangerVA", "AdamW"):
        refuse_unsliceable(_named(name))
    for name in ("AdamP", "SGDP", "Nero", "Fromage", "Ranger21", "GrokAdamW", "StableAdamW",
                 "SAM", "GSAM", "LookSAM", "DAdaptAdan", "ScalableShampoo", "SWATS"):
        with pytest.raises(TypeError, match=f"{name} is not element-wise"):
            refuse_unsliceable(_named(name))
    with pytest.raises(TypeError, match="SophiaH is a second-order optimizer"):
        refuse_unsliceable(_named("SophiaH"))
    p = torch.nn.Parameter(torch.zeros(3, 4))
    refuse_unsliceable_settings(UsesGC([p], use_gc=False))
    with pytest.raises(TypeError, match="UsesGC was built with use_gc=True: gradient "
                                        "centralization"):
        refuse_unsliceable_settings(UsesGC([p]))
    assert conversion_problem(UsesGC([p]))[0] is TypeError
