"""The benchmark driver's own arithmetic (bench/ is not a package: imported by path)."""
import os
import sys
import threading
import time

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


@pytest.fixture(scope="module")
def bench_modules():
    sys.path.insert(0, BENCH)
    try:
        import emulated
        import systems
        import train_rank
        yield systems, emulated, train_rank
    finally:
        sys.path.remove(BENCH)


def test_system_names(bench_modules):
    systems, _, _ = bench_modules
    assert systems.fgpsdp_variant("fgpsdp") == {}
    assert systems.fgpsdp_variant("fgpsdp_flat") == {"topology": "flat"}
    assert systems.fgpsdp_variant("fgpsdp_gloo_intra")["topology"].shared_memory is False
    assert systems.fgpsdp_variant("fgpsdp_gloo_barrier") == {"shm_barrier": "gloo"}
    assert systems.fgpsdp_variant("fgpsdp_next_forward") == {"schedule": "next_forward"}
    assert systems.fgpsdp_variant("fgpsdp_one_call_in_flight") == {"calls_in_flight": 1}
    assert systems.fgpsdp_variant("fgpsdp_first_bucket_at_cap") == {"first_bucket_at_cap": True}
    assert systems.fgpsdp_variant("fgpsdp_comm_first") == {"training_thread_nice": 10}
    assert systems.fgpsdp_variant("fgpsdp_sideways") is None
    assert systems.fgpsdp_variant("ddp") is None
    assert systems.split_bucket_suffix("fgpsdp_next_forward_bucket8") == ("fgpsdp_next_forward", 8.0)
    assert systems.split_bucket_suffix("ddp_bucket2.5") == ("ddp", 2.5)
    assert systems.split_bucket_suffix("fsdp_hybrid_zero2") == ("fsdp_hybrid_zero2", None)
    assert systems.is_system("ddp") and systems.is_system("fsdp_grad_op_bucket4")
    assert not systems.is_system("fgpsdp_bucket") and not systems.is_system("mpi_bucket8")
    assert systems.split_reduce_dtype_suffix("ddp_bucket8_bf16grads") == ("ddp_bucket8",
                                                                          torch.bfloat16)
    assert systems.system_base("fsdp_hybrid_zero2_bucket8_bf16grads") == "fsdp_hybrid_zero2"
    assert systems.is_system("fgpsdp_next_forward_bf16grads")
    assert not systems.is_system("compute_bf16grads")  # nothing is reduced
    assert systems.fgpsdp_variant("fgpsdp_muon") == {"muon": True}
    assert systems.is_system("ddp_muon") and systems.is_system("fgpsdp_muon")


def test_muon_systems_split_the_blocks_matrices_from_the_rest(bench_modules):
    systems, _, _ = bench_modules
    from workloads import CONFIGS, build_model
    model = build_model(CONFIGS[("gpt2", "cpu")])
    matrices, rest = systems.muon_split(model)
    assert len(matrices) == 16 and all(p.ndim == 2 for p in matrices)
    assert len(matrices) + len(rest) == len(list(model.parameters()))
    with pytest.raises(ValueError, match="blocks of 2-D weights"):
        systems.muon_split(torch.nn.Linear(3, 4))


def test_thread_cpu_seconds_names_python_threads(bench_modules):
    _, _, train_rank = bench_modules
    spun = threading.Event()

    def spin_then_sleep():
        stop = time.thread_time() + 0.2
        while time.thread_time() < stop:
            pass
        spun.set()
        time.sleep(0.5)

    worker = threading.Thread(target=spin_then_sleep, name="fgpsdp-test-spinner")
    worker.start()
    spun.wait()
    seconds = train_rank.thread_cpu_seconds()
    worker.join()
    assert seconds.get("fgpsdp-test-spinner", 0.0) >= 0.1  # kernel ticks: 0.2 s spun
    assert "MainThread" in seconds


def test_cpu_roles_split_threads(bench_modules):
    _, emulated, _ = bench_modules
    ranks = [{"cpu_s_per_step_by_thread": {"MainThread": 1.0, "fgpsdp-inter-rs": 0.25,
                                           "native:gloo_tcp_loop": 0.5}},
             {"cpu_s_per_step_by_thread": {"MainThread": 2.0, "fgpsdp-scheduler": 0.25}}]
    assert emulated.cpu_roles(ranks) == {"training thread": 3.0, "fgpsdp threads": 0.5,
                                         "other threads": 0.5}


def test_rank_skew_lines_up_traces(tmp_path):
    """Two ranks' traces with different first spans land on one time axis."""
    sys.path.insert(0, BENCH)
    try:
        import rank_skew
    finally:
        sys.path.remove(BENCH)
    from fgpsdp_runtime.tracing import Timeline

    paths = []
    for rank, late, wait in ((0, 0.0, 0.2), (1, 0.25, 0.05)):
        timeline = Timeline(rank=rank)
        base = 1000.0 + 0.01 * rank  # perf_counter seconds: one clock for both ranks
        for step in range(2):
            t = base + 2.0 * step
            timeline.add("compute", "forward", t, t + 0.5)
            timeline.add("compute", "backward (from first gradient)", t + 0.6 + late,
                         t + 1.0 + late)
            timeline.add("compute", "optimizer step", t + 1.2 + late, t + 1.5 + late)
            timeline.add("compute", "wait reduce-scatters", t + 1.2 + late,
                         t + 1.2 + late + wait)
        path = tmp_path / f"trace-rank{rank}.json"
        timeline.save_chrome_trace(str(path))
        paths.append(str(path))
    loaded = dict(rank_skew.load(p) for p in paths)
    steps = {rank: rank_skew.steps_of(spans) for rank, spans in loaded.items()}
    assert len(steps[0]) == len(steps[1]) == 2
    for step in range(2):
        starts0, starts1 = steps[0][step]["start"], steps[1][step]["start"]
        assert starts1["forward"] - starts0["forward"] == pytest.approx(0.01)
        assert starts1["backward"] - starts0["backward"] == pytest.approx(0.26)
        assert steps[0][step]["RS wait"] == pytest.approx(0.2)
        assert steps[1][step]["RS wait"] == pytest.approx(0.05)


def _compute_synced_step(rank, world_size):
    sys.path.insert(0, BENCH)
    import copy
    import torch
    import systems
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    reference = copy.deepcopy(model)
    system = systems.build_system("compute_synced", model, torch.nn.functional.mse_loss, batch=2)
    torch.manual_seed(1 + rank)  # different data per rank, as in training
    x, y = torch.randn(2, 8), torch.randn(2, 4)
    torch.nn.functional.mse_loss(reference(x), y).backward()
    local_sq = sum(float(p.grad.double().pow(2).sum()) for p in reference.parameters())
    system.train_step(x, y)
    return {"packet": float(system._norm_packet), "local_sq": local_sq,
            "weight": system.model.module.weight.detach().clone()}


def test_compute_synced_all_reduces_the_norm_and_nothing_else():
    from tests.dist_harness import run_distributed
    results = run_distributed(2, _compute_synced_step)
    # The packet is the sum of both ranks' squared norms (the one synchronisation) ...
    assert results[0]["packet"] == pytest.approx(results[1]["packet"])
    assert results[0]["packet"] == pytest.approx(results[0]["local_sq"] + results[1]["local_sq"],
                                                 rel=1e-5)
    # ... and the gradients were not: the ranks' updates differ.
    assert not results[0]["weight"].equal(results[1]["weight"])


def _tiny_gpt():
    sys.path.insert(0, os.path.join(os.path.dirname(BENCH), "examples"))
    from gpt import GPT, GPTConfig
    return GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, d_model=16,
                         tie_embeddings=True))


def test_fsdp_wrap_policy_never_splits_a_tied_parameter(bench_modules):
    systems = bench_modules[0]
    model = _tiny_gpt()
    splitting = systems._modules_splitting_a_tie(model)
    # The embedding and the output layer each hold one user of the tied weight; the
    # root holds both; a block holds no tied parameter.
    assert splitting == {id(model.tok), id(model.head)}
    policy = systems._size_wrap_policy(model, bucket_cap_mb=1e-6)  # every module is "big"
    assert not policy(model.tok, recurse=False, nonwrapped_numel=10**9)
    assert policy(model.blocks[0], recurse=False, nonwrapped_numel=10**9)


def _fsdp_small_units_step(rank, world_size):
    sys.path.insert(0, BENCH)
    import copy
    import torch
    import systems
    torch.manual_seed(0)
    model = _tiny_gpt()
    reference = copy.deepcopy(model)
    loss_fn = lambda logits, y: torch.nn.functional.cross_entropy(  # noqa: E731
        logits.flatten(0, 1), y.flatten())
    fsdp = systems.build_system("fsdp_grad_op_bucket0.001", model, loss_fn, batch=2)
    ddp = systems.build_system("ddp", reference, loss_fn, batch=2)
    units = sum(isinstance(m, fsdp.FSDP) for m in fsdp.model.modules())
    for step in range(2):
        torch.manual_seed(100 * step + rank)
        x = torch.randint(0, 64, (2, 8))
        y = torch.randint(0, 64, (2, 8))
        fsdp.train_step(x, y)
        ddp.train_step(x, y)
    return {"units": units,
            "max_diff": max(float((a - b).abs().max())
                            for a, b in zip(fsdp.final_params(), ddp.final_params()))}


def test_fsdp_small_wrap_units_train_a_tied_model_like_ddp():
    # Before the tie-aware policy, FSDP units this small split GPT-2's tied
    # embedding and failed in the first forward ("mat2 must be a matrix").
    from tests.dist_harness import run_distributed
    results = run_distributed(2, _fsdp_small_units_step)
    for r in results:
        assert r["units"] > 2  # really wrapped in small units, not just the root
        assert r["max_diff"] < 1e-5


def test_steal_share_reads_the_machine_line_of_proc_stat(bench_modules, tmp_path):
    _, emulated, train_rank = bench_modules
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 0 20 860 0 0 0 20 50 0\ncpu0 50 0 10 430 0 0 0 10 25 0\n")
    start = train_rank.machine_cpu_ticks(str(stat))
    assert start == (20, 1000)  # guest time is inside user: not counted twice
    stat.write_text("cpu  200 0 40 1660 0 0 0 100 80 0\n")
    end = train_rank.machine_cpu_ticks(str(stat))
    assert train_rank.steal_share(start, end) == pytest.approx(80 / 1000)
    assert train_rank.steal_share(start, start) is None
    assert train_rank.machine_cpu_ticks(str(tmp_path / "missing")) == (0, 0)
    # The report: the worst rank of each round, in percent.
    ranks = [{"steal_share": 0.01}, {"steal_share": 0.25}, {}]
    assert emulated.round_steal_share(ranks) == 0.25
    assert emulated.round_steal_share([{}]) is None
    assert emulated.steal_cell([0.001, 0.25]) == "0.1 / 25.0"
    assert emulated.steal_cell([None, 0.05]) == "- / 5.0"
    assert emulated.steal_cell([None]) == "-" and emulated.steal_cell(None) == "-"
    assert emulated.rounds_cell([3.14159, None], "{:.1f}") == "3.1 / -"


def test_host_speed_probe_is_a_positive_rate_and_keeps_the_thread_count(bench_modules):
    import torch
    _, emulated, _ = bench_modules
    threads = torch.get_num_threads()
    assert emulated.host_gflops(size=32, reps=2, tries=1) > 0
    assert torch.get_num_threads() == threads


def test_breakdown_counts_only_the_waits_inside_a_step(bench_modules):
    import timeline_report  # on the path while bench_modules is alive
    spans = [("compute", "forward", 0.0, 1.0), ("compute", "wait AG b3", 0.2, 0.5),
             ("compute", "backward (from first gradient)", 1.1, 2.0),
             ("compute", "optimizer step", 2.0, 3.0), ("compute", "wait reduce-scatters", 2.0, 2.4),
             ("inter-ag", "AG b3", 0.0, 0.5),
             # The harness's synchronize() after the last step: not a forward's wait.
             ("compute", "wait AG b0", 3.0, 3.8)]
    out = timeline_report.breakdown(spans, steps=1)
    assert out["forward waits for all-gathers"] == pytest.approx(0.3)
    assert out["step waits for reduce-scatters"] == pytest.approx(0.4)
    assert out["forward_s"] == pytest.approx(1.0) and out["backward_s"] == pytest.approx(0.9)
    assert out["window_s"] == pytest.approx(3.8)
    assert "Muon's exchanges" not in out
    # MuonWithAdamW's parts of the step.
    out = timeline_report.breakdown(spans + [
        ("compute", "Muon's whole matrices", 2.4, 2.5), ("compute", "Newton-Schulz", 2.5, 2.8),
        ("compute", "Muon's orthogonalised matrices", 2.8, 2.85)], steps=1)
    assert out["Muon's exchanges"] == pytest.approx(0.15)
    assert out["Newton-Schulz (compute)"] == pytest.approx(0.3)


def test_a_trace_counts_its_own_steps(bench_modules):
    """Before, --steps defaulted to 1: a trace of several steps read as one long one."""
    import timeline_report  # on the path while bench_modules is alive
    step = [("compute", "forward", 0.0, 1.0), ("compute", "optimizer step", 2.0, 3.0)]
    later = [(lane, name, start + 3, end + 3) for lane, name, start, end in step]
    # (An optimizer step before the first forward is the step before the trace's.)
    assert timeline_report.traced_steps([("compute", "optimizer step", -1.0, -0.5)]
                                        + step + later) == 2
    assert timeline_report.traced_steps([("compute", "forward", 0.0, 1.0)]) == 1


def test_span_lines_list_the_chosen_lanes_from_the_first_span(bench_modules):
    import timeline_report  # on the path while bench_modules is alive
    spans = [("inter-rs", "RS b1", 10.5, 10.7), ("compute", "forward", 10.0, 10.4),
             ("inter-ag", "AG b0", 10.1, 10.3)]
    lines = timeline_report.span_lines(spans, {"inter-rs", "inter-ag"})
    assert [line.split() for line in lines] == [
        ["0.100", "0.300", "0.200", "inter-ag", "AG", "b0"],
        ["0.500", "0.700", "0.200", "inter-rs", "RS", "b1"]]
    assert len(timeline_report.span_lines(spans, None)) == 3
    assert timeline_report.span_lines([], None) == []


def test_encoder_forward_order_switch(bench_modules, monkeypatch):
    """FGPSDP_BENCH_ENCODER_ORDER=forward: reverse registration order becomes the order
    backward makes an encoder layer's gradients ready (what the buckets are filled by)."""
    import workloads  # on the path while bench_modules is alive
    cfg = workloads.WorkloadConfig("vit", "cpu", 1, {"image": 16, "patch": 8, "d_model": 16,
                                                     "n_layer": 2, "n_head": 2, "num_classes": 3},
                                   "image", image=16, classes=3)

    def layer_param_order(model):
        prefix = "encoder.layers.layers.0."
        return [n[len(prefix):] for n, _ in model.named_parameters() if n.startswith(prefix)]

    def ready_order(model):
        names = {id(p): n for n, p in model.named_parameters()}
        seen = []
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: seen.append(names[id(p)]))
        x, y = workloads.make_batch(cfg, 0, 0)
        workloads.loss_fn(cfg)(model(x), y).backward()
        prefix = "encoder.layers.layers.0."
        return [n[len(prefix):] for n in seen if n.startswith(prefix)]

    monkeypatch.delenv(workloads.ENCODER_ORDER_ENV, raising=False)
    built = workloads.build_model(cfg)
    assert layer_param_order(built)[0] == "self_attn.in_proj_weight"  # torch's own order
    monkeypatch.setenv(workloads.ENCODER_ORDER_ENV, "forward")
    reordered = workloads.build_model(cfg)
    assert layer_param_order(reordered)[:2] == ["norm1.weight", "norm1.bias"]
    assert sorted(layer_param_order(reordered)) == sorted(layer_param_order(built))

    def modules_of(names):  # weight and bias of one module are ready together
        return [n.rsplit(".", 1)[0] for n in names]

    expected = modules_of(reversed(layer_param_order(reordered)))
    assert list(dict.fromkeys(modules_of(ready_order(reordered)))) == \
        list(dict.fromkeys(expected))
    assert list(dict.fromkeys(modules_of(ready_order(built)))) != \
        list(dict.fromkeys(modules_of(reversed(layer_param_order(built)))))


def test_steady_state_reads_every_rank_and_prints_a_row():
    """bench/steady_state.py end to end, briefly: 2 ranks, 70 steps, readings at steps
    50, 60 and 70 (the record runs 4,050)."""
    import subprocess
    out = subprocess.run(
        [sys.executable, os.path.join(BENCH, "steady_state.py"), "--steps", "70", "--every",
         "10", "--configs", "two_stage,torch_ddp"],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1]
            for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line}
    assert set(rows) == {"config", "two_stage", "torch_ddp"}
    for name in ("two_stage", "torch_ddp"):
        rss, tensors = rows[name][0].strip(), rows[name][1].strip()
        assert len(rss.split("/")) == 3 and all(float(v) > 0 for v in rss.split("/"))
        first, last = (int(v) for v in tensors.split(" / "))
        assert first > 0 and last > 0


@pytest.mark.parametrize("arguments, message", [
    (["--steps", "0"], "--steps must be at least 1"),
    (["--world-size", "3", "--local-size", "2"], "--local-size must divide --world-size"),
    (["--world-size", "2", "--local-size", "0"], "--local-size must divide --world-size")])
def test_print_plan_refuses_arguments_it_cannot_plan_for(arguments, message):
    """Before: a NameError after the profile (--steps 0), a ZeroDivisionError after
    it (--local-size 0, or above --world-size), or a plan for one node of 2 ranks
    where 3 were asked for."""
    import subprocess
    done = subprocess.run([sys.executable, os.path.join(BENCH, "print_plan.py"), *arguments],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr
