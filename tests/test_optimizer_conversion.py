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

    assert constructor_defaults(SelfDefaults, {"lr": 1, "extra": 2}) == {}


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
        self.base_values = [g["lr"] for g in optimizer.param_groups]

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
    torch.optim.lr_scheduler.LambdaLR(scheduled, lambda step: 1.0)
    assert "lr scheduler" in conversion_problem(scheduled)[1]
    hooked = torch.optim.Adam([p])
    hooked.register_load_state_dict_post_hook(lambda opt: None)
    assert conversion_problem(hooked) == (
        ValueError, "this optimizer has hooks registered on it (load_state_dict_post_hooks): "
        "register them on the optimizer from_optimizer returns instead")


@pytest.mark.parametrize("make", [
    lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt),  # leaves no mark on opt
    TimmLikeScheduler,
    lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2),
], ids=["ReduceLROnPlateau", "timm-like", "StepLR"])
def test_every_kind_of_lr_scheduler_holding_the_optimizer_is_found(make):
    """Found by an audit: a ReduceLROnPlateau built before fabric.setup went on
    scheduling the old optimizer (0.233 from torch DDP), silently."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    scheduler = make(opt)
    problem = conversion_problem(opt)
    assert problem is not None and problem[0] is ValueError
    assert f"an lr scheduler ({type(scheduler).__name__}) was built on this optimizer" \
        in problem[1]


def test_a_scheduler_dropped_is_still_refused_where_it_left_its_mark():
    marked = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    torch.optim.lr_scheduler.StepLR(marked, 2)  # (dropped at once)
    assert "an lr scheduler (one not found, which left its mark" in conversion_problem(marked)[1]
    unmarked = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    torch.optim.lr_scheduler.ReduceLROnPlateau(unmarked)
    assert conversion_problem(unmarked) is None  # nothing holds it: nothing to lose


def test_settings_kept_outside_the_defaults_are_refused():
    """Found by an audit: apex's FusedAdam with adam_w_mode=False was rebuilt with
    True, its default (0.112 from torch DDP), silently."""
    p = torch.nn.Parameter(torch.zeros(2))
    assert conversion_problem(FusedAdamLike([p])) is None  # its default: nothing lost
    problem = conversion_problem(FusedAdamLike([p], adam_w_mode=False, weight_decay=0.5))
    assert problem[0] is ValueError
    assert "FusedAdamLike keeps settings outside its defaults" in problem[1]
    assert "adam_w_mode=False, built: True" in problem[1]
