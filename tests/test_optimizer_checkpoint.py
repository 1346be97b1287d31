"""full_state_dict() is torch.optim's state dict, and loads at another world size.

Trained side by side with torch DDP + the same torch optimizer: on 2 ranks the
gathered dict equals torch's bit for bit; saved on 4 ranks (two nodes of two,
so slices are not in rank order) it resumes on 3 with other buckets, as does
the dict torch DDP's optimizer saved, and the run goes on like torch DDP's.
"""
import pytest
import torch
from torch import nn

from . import checkpoint_scenarios
from .dist_harness import run_distributed

TOL = 2e-5  # max |param difference|, as in test_equivalence

CONFIGS = {
    "adamw_groups": {"model": "mlp", "optimizer": "adamw", "max_grad_norm": 0.5},
    # param_groups=None numbers module.parameters(), the frozen layer included.
    "adamw_default_groups_frozen": {"model": "bn_frozen", "optimizer": "adamw",
                                    "groups": "default"},
    "amsgrad_small_buckets": {"model": "mlp", "optimizer": "adamw_amsgrad",
                              "bucket_cap_mb": 0.0001},
    "sgd_momentum_tied": {"model": "tied", "optimizer": "sgd_momentum"},
    "sgd_stateless": {"model": "mlp", "optimizer": "sgd"},
    "custom_optimizer_python_number": {"model": "mlp", "optimizer": "counting_sgd"},
    # Frozen parameters' state comes from an optimizer built with the same arguments.
    "custom_optimizer_lr_required_frozen": {"model": "bn_frozen",
                                            "optimizer": "counting_sgd_lr_required",
                                            "groups": "default"},
    # Adagrad makes state at construction, for the frozen layer too.
    "adagrad_frozen": {"model": "bn_frozen", "optimizer": "adagrad", "groups": "default",
                       "schedule": "serial"},
    "adagrad_initial_sum_frozen": {"model": "bn_frozen", "optimizer": "adagrad_initial_sum",
                                   "groups": "default"},
    "nadam_scalar_param": {"model": "temperature", "optimizer": "nadam"},
    "adamw_named_params": {"model": "mlp", "optimizer": "adamw", "groups": "named"},
    # Counted once per step (not per bucket), saved and resumed.
    "step_counters": {"model": "mlp", "optimizer": "step_counters", "bucket_cap_mb": 0.0001},
    # State laid out as its parameters (channels_last convs, a column-major weight).
    "adamw_channels_last": {"model": "channels_last", "optimizer": "adamw",
                            "bucket_cap_mb": 0.0001},
}


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    return run_distributed(2, checkpoint_scenarios.train_and_save_many, CONFIGS,
                           str(tmp_path_factory.mktemp("two")))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_full_state_dict_equals_torch_ddp_optimizer_bitwise(two_rank_results, name):
    for rank, results in enumerate(two_rank_results):
        res = results[name]
        assert res["same_groups"] and res["same_layout"] and not res["mismatched"], (rank, res)
        assert res["bitwise"], (rank, res)
        assert res["on_cpu"]


HIERARCHICAL = {name: {**cfg, "local_size": 2} for name, cfg in CONFIGS.items()
                if name in ("adamw_groups", "sgd_momentum_tied", "nadam_scalar_param",
                            "adamw_channels_last", "step_counters")}


@pytest.fixture(scope="module")
def saved_on_four(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("four"))
    results = run_distributed(4, checkpoint_scenarios.train_and_save_many, HIERARCHICAL,
                              directory)
    return directory, results


def test_full_state_dict_on_two_nodes_matches_torch(saved_on_four):
    _, results = saved_on_four
    for rank, per_config in enumerate(results):
        for name, res in per_config.items():
            assert res["same_groups"] and res["same_layout"] and not res["mismatched"], \
                (rank, name, res)
            # Four ranks sum gradients in another order than torch's ring: rounding only.
            assert res["max_diff"] <= 1e-6, (rank, name, res)


@pytest.mark.parametrize("which", ["ours", "torch"])
def test_resume_on_another_world_size_and_buckets(saved_on_four, which):
    """Saved on 4 ranks (fgpsdp's dict, or torch DDP's optimizer's), resumed on 3
    with one bucket per parameter: what is loaded gathers back bit for bit, and
    training goes on as torch DDP's does from the same dict."""
    directory, _ = saved_on_four
    resumed = {name: {k: v for k, v in cfg.items() if k != "local_size"}
               | {"bucket_cap_mb": 0.0001} for name, cfg in HIERARCHICAL.items()}
    results = run_distributed(3, checkpoint_scenarios.resume_many, resumed, directory, which)
    for rank, per_config in enumerate(results):
        for name, res in per_config.items():
            assert res["round_trip"]["bitwise"], (rank, name, res["round_trip"])
            assert res["param_diff"] <= TOL, (rank, name, res)
            assert res["after"]["same_layout"] and res["after"]["same_groups"], (rank, name, res)


def test_resume_channels_last_checkpoint_in_row_major_layout(saved_on_four):
    """Optimizer state saved from channels_last convs loads into row-major ones."""
    directory, _ = saved_on_four
    cfg = {**HIERARCHICAL["adamw_channels_last"], "row_major": True}
    del cfg["local_size"]
    results = run_distributed(3, checkpoint_scenarios.resume_many,
                              {"adamw_channels_last": cfg}, directory, "ours")
    for rank, per_config in enumerate(results):
        res = per_config["adamw_channels_last"]
        assert res["round_trip"]["bitwise"], (rank, res["round_trip"])
        assert res["param_diff"] <= TOL, (rank, res)


def test_rank0_only_leaves_the_other_ranks_empty(tmp_path):
    cfg = {"model": "mlp", "optimizer": "adamw", "rank0_only": True}
    results = run_distributed(3, checkpoint_scenarios.train_and_save, cfg,
                              str(tmp_path / "rank0.pt"))
    assert not results[0]["empty"] and results[0]["same_layout"]
    assert all(res["empty"] for res in results[1:])


@pytest.mark.parametrize("to", [0, 2])
def test_consolidate_state_dict_saves_as_for_torchs_zero_optimizer_and_resumes(tmp_path, to):
    """A trainer saving a sharded optimizer from one rank (PyTorch Lightning's
    checkpoints) calls consolidate_state_dict() on every rank, then state_dict() there:
    the whole state, full_state_dict()'s; it resumes at another world size. Before, it
    saved rank 0's shard, which loads on rank 0 alone."""
    cfg = {"model": "mlp", "optimizer": "adamw", "max_grad_norm": 0.5}
    path = str(tmp_path / "consolidated.pt")
    results = run_distributed(3, checkpoint_scenarios.consolidate_and_save, cfg, path, to)
    for rank, res in enumerate(results):
        assert res["shard"] == (rank != to), (rank, res)  # the others' stays their shard
        assert res["shard_after_a_step"], (rank, res)  # the step dropped it
    kept = results[to]
    assert kept["as_full_state_dict"], kept
    assert kept["lr_now"] == 0.125 and kept["new_dict_same_state"], kept
    to_torch = kept["to_torch"]  # (3 ranks: torch DDP sums in another order)
    assert to_torch["same_groups"] and to_torch["same_layout"], to_torch
    assert not to_torch["mismatched"] and to_torch["max_diff"] <= TOL, to_torch
    for rank, res in enumerate(run_distributed(2, checkpoint_scenarios.resume, cfg, path,
                                               "ours")):
        assert res["round_trip"]["bitwise"], (rank, res["round_trip"])
        assert res["param_diff"] <= TOL, (rank, res)


def test_consolidate_state_dict_to_a_rank_outside_the_group_is_refused_on_every_rank():
    for error in run_distributed(2, checkpoint_scenarios.consolidate_to, 2):
        assert "consolidate_state_dict(to=2): to is a rank of the optimizer's group, 0 to 1" \
            in error, error


def test_full_state_dict_on_rank_0_alone_says_what_it_waits_for(monkeypatch):
    monkeypatch.setenv("FGPSDP_COLLECTIVE_WARN_S", "1")
    results = run_distributed(2, checkpoint_scenarios.full_state_dict_on_rank_0_alone,
                              pg_timeout_s=6, timeout_s=60)
    warned = results[0]["warnings"]
    assert len(warned) == 1 and "opt.full_state_dict() has waited 1 s" in warned[0][0], warned
    assert "every rank must call it" in warned[0][0] and "rank0_only=True" in warned[0][0]
    assert warned[0][1] == "checkpoint_scenarios.py", warned  # the caller's line
    assert results[0]["error"] is not None  # then the collective timed out
    assert results[1] == {"warnings": [], "error": None}


@pytest.mark.parametrize("raw, expected, warns", [
    (None, 60.0, False), ("2.5", 2.5, False), ("inf", None, False), ("1e12", None, False),
    ("abc", 60.0, True), ("", 60.0, True), ("nan", 60.0, True), ("0", 60.0, True),
    ("-3", 60.0, True)])
def test_collective_warn_setting(monkeypatch, raw, expected, warns):
    """A diagnostic's setting never breaks the call it watches: a bad value is named
    and the default used; inf (or beyond a timer's range) turns it off."""
    import warnings
    from fgpsdp_runtime.collective_watch import warn_after_s
    if raw is None:
        monkeypatch.delenv("FGPSDP_COLLECTIVE_WARN_S", raising=False)
    else:
        monkeypatch.setenv("FGPSDP_COLLECTIVE_WARN_S", raw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert warn_after_s() == expected
    assert bool(caught) == warns and all("FGPSDP_COLLECTIVE_WARN_S" in str(w.message)
                                         for w in caught)


def test_model_parameter_lookups_in_opt_state_keep_it_saveable():
    for res in run_distributed(2, checkpoint_scenarios.look_up_model_params_in_state,
                               timeout_s=120):
        assert res["entries_found"] == 0
        assert len(res["warnings"]) == 1 and "opt.full_state_dict()" in res["warnings"][0]
        assert res["state_keys"] == res["pieces"] > 0  # only the slice pieces
        assert "reset the entries of its pieces" in res["assignment"]


def test_opt_state_reset_by_assignment_and_model_parameter_lookups():
    for res in run_distributed(2, checkpoint_scenarios.reset_state_the_torch_ways,
                               timeout_s=120):
        assert res["bitwise"]  # the reset reached the inner optimizer's moments
        assert res["answers"] == [None, False, None]
        assert len(res["warnings"]) == 1 and "opt.full_state_dict()" in res["warnings"][0]
        assert all("reset the entries of its pieces" in r for r in res["refused"])
        assert res["entries"][0] == res["entries"][1] > 0


def test_state_dict_hooks_run_as_on_a_torch_optimizer():
    for res in run_distributed(2, checkpoint_scenarios.state_dict_hooks, timeout_s=120):
        assert res["calls"] == ["before save", "save"] * 2 + ["load", "loaded"] * 2
        assert res["tags"] == ["written by a hook"] * 2
        assert res["lrs"] == [[0.123], [0.123]]


def test_shard_of_another_slice_is_refused():
    errors = run_distributed(4, checkpoint_scenarios.shard_under_another_topology,
                             timeout_s=120)
    for rank in (0, 3):  # slices 0 and 3 under both: they raise as well, not hang later
        assert "optimizer shards of 2 other rank(s) do not fit" in errors[rank]
    for rank, slice_saved in ((1, 2), (2, 1)):
        assert f"optimizer shard of slice {slice_saved} loading on rank {rank}" in errors[rank]
        assert "full_state_dict() loads under any topology" in errors[rank]


def test_rank0s_shard_loaded_everywhere_is_refused_saying_what_works():
    errors = run_distributed(2, checkpoint_scenarios.rank0_shard_loaded_everywhere,
                             timeout_s=120)
    assert "optimizer shards of 1 other rank(s) do not fit" in errors[0]
    assert errors[1].startswith("fgpsdp: optimizer shard saved by rank/world (0, 2), "
                                "loading on (1, 2)"), errors[1]
    assert "opt.state_dict() is one rank's shard" in errors[1]
    assert "call opt.consolidate_state_dict() on every rank first" in errors[1]
    assert "opt.full_state_dict(), called on every rank" in errors[1]


def test_torchs_checkpoint_helpers_are_refused_saying_what_works():
    """get_state_dict & co. map opt.param_groups to the model's parameter names, and
    ours are slices: before, a bare KeyError: 'state'. (Before the first step torch's
    helper calls opt.step() with lr 0 to create state, as for any optimizer: with no
    reduced gradient that steps nothing, and training goes on as torch DDP's.)"""
    for rank, res in enumerate(run_distributed(2, checkpoint_scenarios.torchs_checkpoint_helpers,
                                               timeout_s=120)):
        assert len(res["said"]) == 6, res
        for call, message in res["said"].items():
            assert message is not None and message.startswith("TypeError: fgpsdp: torch.") \
                and "opt.full_state_dict()" in message and "model.module" in message, \
                (rank, call, message)
        assert res["params_equal"], rank


def test_distributed_checkpoint_saves_and_loads_the_full_state_dict(tmp_path):
    for res in run_distributed(2, checkpoint_scenarios.distributed_checkpoint_round_trip,
                               str(tmp_path / "dcp"), timeout_s=120):
        assert res["changed_before_load"]  # the load has something to undo
        assert res["after_load"]["bitwise"], res["after_load"]


@pytest.mark.parametrize("optimizer", ["adamw", "step_counters"])
def test_distributed_checkpoint_resumes_into_a_fresh_optimizer(tmp_path, optimizer):
    # Saved on 2 ranks, loaded on 3 in new processes: a fresh optimizer's plain
    # full_state_dict() has no state entries, so dcp.load would fill none (and the
    # resumed run would restart Adam's moments from zero, silently).
    directory = str(tmp_path / "dcp")
    run_distributed(2, checkpoint_scenarios.distributed_checkpoint_save, directory, optimizer,
                    timeout_s=120)
    for res in run_distributed(3, checkpoint_scenarios.distributed_checkpoint_into_fresh_optimizer,
                               directory, optimizer, timeout_s=120):
        if optimizer == "adamw":
            assert res["plain_template_entries"] == 0 and res["template_entries"] > 0, res
        assert res["left_as_it_was"], res
        assert res["after_load"]["bitwise"], res["after_load"]


@pytest.mark.parametrize("optimizer", ["adamw", "step_counters"])
def test_a_template_before_the_first_step_changes_nothing(optimizer):
    for res in run_distributed(2, checkpoint_scenarios.template_leaves_training_unchanged,
                               optimizer, timeout_s=120):
        assert res["bitwise"]


def test_shard_saved_with_other_trainable_parameters_is_refused(tmp_path):
    # Layer a frozen at the save, b at the load: the buckets have the same sizes, and
    # the shard would have loaded b's Adam moments into a.
    path = str(tmp_path / "shard")
    run_distributed(2, checkpoint_scenarios.shard_save_with_frozen, path, "a", timeout_s=120)
    results = run_distributed(2, checkpoint_scenarios.shard_load_with_frozen, path, "b",
                              timeout_s=120, allow_errors=True)
    for res in results.values():
        assert not res["ok"] and "other parameters in the buckets" in res["message"], res
    run_distributed(2, checkpoint_scenarios.shard_load_with_frozen, path, "a", timeout_s=120)


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.main = nn.Linear(16, 2)
        self.aux = nn.Linear(16, 2)  # unused so far: its slices have no optimizer state

    def forward(self, x):
        return self.main(torch.tanh(self.body(x)))


def _template_after_a_step(rank, world_size, optimizer):
    import fgpsdp_runtime as fgp
    finals = []
    for template in (False, True):
        torch.manual_seed(0)
        model = fgp.DistributedDataParallel(_TwoHeads(), schedule="serial")
        kind, kw = ((torch.optim.AdamW, {"lr": 1e-2}) if optimizer == "adamw"
                    else (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}))
        opt = fgp.ShardedOptimizer(model, kind, **kw)
        g = torch.Generator().manual_seed(rank)
        for step in range(4):
            opt.zero_grad()  # at the loop's top, as torch's recipes do
            model(torch.randn(4, 8, generator=g)).square().mean().backward()
            opt.step()
            if step == 1 and template:
                # the pieces still hold their slice gradients here
                opt.full_state_dict(init_state=True)
        model.synchronize()
        finals.append([p.detach().clone() for p in model.module.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*finals))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd_momentum"])
def test_template_after_a_step_leaves_the_live_state_alone(optimizer):
    # Before: the lr=0 run also stepped the pieces that had state (their slice gradients
    # were still set): SGD's momentum changed silently; AdamW's step count moved on one
    # rank only, and the next full_state_dict() raised "disagree on its optimizer state".
    assert run_distributed(2, _template_after_a_step, optimizer) == [True, True]


class _NoLR(torch.optim.Optimizer):
    def __init__(self, params, step_size=0.1):
        super().__init__(params, {"step_size": step_size})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    if not state:
                        state["m"] = torch.zeros_like(p)
                    state["m"].mul_(0.9).add_(p.grad)
                    p.add_(state["m"], alpha=-group["step_size"])


def _template_without_lr(rank, world_size):
    import fgpsdp_runtime as fgp
    model = fgp.DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)))
    opt = fgp.ShardedOptimizer(model, _NoLR, step_size=0.1)
    return len(opt.full_state_dict(init_state=True)["state"])


def test_template_for_an_optimizer_without_lr():
    # Before: KeyError 'lr' (torch's _init_optim_state sets lr only where a group has one).
    assert run_distributed(2, _template_without_lr) == [4, 4]


@pytest.mark.parametrize("optimizer,entry", [("adamw", "exp_avg_sq"),
                                             # built with its arguments to learn the entries
                                             ("counting_sgd_lr_required", "trace")])
def test_a_dict_whose_parameter_lacks_an_entry_is_refused_on_every_rank(optimizer, entry):
    for errors in run_distributed(3, checkpoint_scenarios.load_dict_lacking_an_entry,
                                  optimizer, entry, timeout_s=120):
        assert len(errors) == 2, errors
        for edited, error in errors.items():
            assert error is not None, f"the dict lacking parameter {edited}'s entry loaded"
            assert f"saved parameter {edited} has no state ['{entry}']" in error, error


def test_a_dict_whose_parameters_started_under_other_settings_loads():
    """Fewer entries in one parameter's state, where the group's settings create no
    more (torch loads it): not the hand-edited dict above."""
    for errors in run_distributed(
            2, checkpoint_scenarios.load_dict_whose_parameters_started_under_other_settings,
            timeout_s=120):
        assert errors == {"rmsprop_momentum_off": None, "adam_amsgrad_off": None}, errors
