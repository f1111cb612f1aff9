"""The experiment scripts (experiments/): CSV schema, 'does not fit (needs X)', budgets, the shaped link, the GPU script's smoke path."""

from __future__ import annotations

import csv
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
sys.path.insert(0, str(EXPERIMENTS))

import netns  # noqa: E402
import run as run_mod  # noqa: E402
import sweep  # noqa: E402
import sweep_nodes  # noqa: E402

MiB = 2**20


@pytest.fixture(scope="module")
def tiny():
    """gpt2-tiny on 2 ranks of the cpu-loopback preset, described analytically (no process group, ~1 s)."""
    from osdp import models
    from osdp.cost.problem import build_problem
    from osdp.describe.analytic import describe_analytic
    from osdp.machine.presets import device_preset

    info = device_preset("cpu-loopback", 2, memory="1GiB")
    with torch.device("meta"):
        model = models.build("gpt2-tiny")
    example = torch.zeros(8, 64, dtype=torch.long, device="meta")
    description = describe_analytic(model, (example, example), info, world_size=2, batch_sizes=(8,), progress=False)
    return model, description, info, build_problem(description, info, 8)


def _record(strategy, plan, predicted, measured_peak, tokens_per_s, budget=None, **extra):
    rec = {"model": "gpt2-tiny", "world_size": 2, "batch_size": 8, "seq_len": 64, "link": "loopback",
           "strategy": strategy, "budget_bytes": budget, "status": "ran", "plan_hash": plan.hash if plan else None,
           "plan_summary": plan.summary() if plan else None, "replicated_fraction": 0.0 if plan else None,
           "predicted_peak_bytes": predicted.peak_bytes if predicted else None,
           "predicted_step_s": predicted.step_s if predicted else None,
           "predicted_tokens_per_s": 512 / predicted.step_s if predicted else None, "reduce_scatter": "pairwise",
           **extra}
    if tokens_per_s:
        rec["measured"] = {"tokens_per_s": tokens_per_s, "tokens_per_s_rounds": [tokens_per_s * 0.9, tokens_per_s],
                           "step_s_median": 512 / tokens_per_s, "peak_bytes": measured_peak,
                           "efficiency": tokens_per_s / 2000, "timed_steps": [20, 21],
                           "per_rank": [{"rank": 0, "peak_bytes": measured_peak, "peak_breakdown": {
                               "parameters": measured_peak // 2, "activations": measured_peak - measured_peak // 2}}]}
    return rec


@pytest.fixture(scope="module")
def result(tiny):
    """A sweep part for gpt2-tiny as run.work returns it, with the measurements made up: the six baselines
    (torch-ddp fits only at the top budget), the ablation, OSDP at four budgets (the first below any plan,
    the second measured over its budget)."""

    import osdp
    from osdp.cost.schedule import predict
    from osdp.planner import find_plan, least_budget
    from osdp.search import BudgetTooSmall

    model, description, info, problem = tiny
    lowest = least_budget(description, info, [8])
    settings = dict(batch_size=8, world_size=2, model_signature=description.signature)
    ddp_plan = osdp.strategy_plan(model, "ddp", **settings)
    ddp_needs = predict(description, ddp_plan, info).peak_bytes
    records = []
    for i, s in enumerate(sweep.BASELINES):  # torch-ddp fastest and largest, the others below it
        records.append(_record(s, None, None, ddp_needs - 50_000 * i, 1000.0 - 10 * i))
    for s, mode in run_mod.ABLATIONS.items():
        plan = osdp.strategy_plan(model, mode, **settings)
        pred = predict(description, plan, info)
        records.append(_record(s, plan, pred, pred.peak_bytes - 1000, 700.0))
    budgets = run_mod.auto_budgets(lowest - 4096, ddp_needs, 4)
    for i, budget in enumerate(budgets):
        try:
            plan = find_plan(description, info, [8], budget=budget,
                          model_signature=description.signature).plan
        except BudgetTooSmall as e:
            records.append({**_record("osdp", None, None, None, None, budget), "status": "budget too small",
                            "needs_bytes": e.min_peak_bytes})
            continue
        pred = predict(description, plan, info)
        over = i == 1  # pretend this one measured over its budget
        records.append(_record("osdp", plan, pred, budget + 10 if over else pred.peak_bytes, 1100.0, budget))
    return {"model": "gpt2-tiny", "records": records, "link": {"name": "loopback"}, "lowest_budget_bytes": lowest,
            "ddp_needs_bytes": ddp_needs, "compute_only": {"step_s_median": 0.25, "tokens_per_s": 2048.0}}


def test_budgets_span_least_to_ddp():
    budgets = run_mod.auto_budgets(1000 * 1024, 2000 * 1024, 5)
    assert budgets[0] == 1000 * 1024 and budgets[-1] == 2000 * 1024 and len(budgets) == 5
    assert all(b % 1024 == 0 for b in budgets)


def test_csv_schema_and_does_not_fit(result, tmp_path):
    rows = sweep.rows_of(result)
    path = tmp_path / "sweep.csv"
    sweep.write_csv(rows, path)
    with path.open() as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames
        table = list(reader)
    required = "model,world_size,link,strategy,budget_bytes,fits,tokens_per_s,peak_bytes,predicted_tokens_per_s,predicted_peak_bytes"
    assert header[:10] == required.split(",")
    assert header == sweep.CSV_COLUMNS and {"efficiency", "compute_step_s", "timed_steps", "reduce_scatter",
                                                            "all_gather"} <= set(header)
    budgets = sorted({r["budget_bytes"] for r in result["records"] if r["strategy"] == "osdp"})
    # every baseline and ablation at every budget: none dropped
    for s in (*sweep.BASELINES, *run_mod.ABLATIONS, "osdp"):
        assert sorted(int(r["budget_bytes"]) for r in table if r["strategy"] == s) == budgets, s
    for r in table:
        needs = int(r["needs_bytes"]) if r["needs_bytes"] else None
        if r["fits"] == "True":
            assert needs <= int(r["budget_bytes"]) and r["status"] == "fits"
        else:
            assert r["status"].startswith(f"does not fit (needs {needs / MiB:.1f} MiB)")
        if r["tokens_per_s"]:
            assert float(r["efficiency"]) == pytest.approx(float(r["tokens_per_s"]) / 2000)
            assert r["timed_steps"] == "20;21" and float(r["compute_step_s"]) == 0.25
    ddp = [r for r in table if r["strategy"] == "torch-ddp"]
    assert ddp[-1]["fits"] == "True" and ddp[0]["fits"] == "False"  # fits exactly at the top budget
    assert all(r["predicted_peak_bytes"] == "" for r in ddp)  # a baseline is no plan: nothing predicted
    # the lowest budget is below what any plan needs: OSDP has no plan, and says what it needs
    first = next(r for r in table if r["strategy"] == "osdp" and int(r["budget_bytes"]) == budgets[0])
    assert first["fits"] == "False" and "no plan" in first["status"]
    assert int(first["needs_bytes"]) == result["lowest_budget_bytes"]
    # planned to fit but measured over: does not fit, needs the measured peak
    second = next(r for r in table if r["strategy"] == "osdp" and int(r["budget_bytes"]) == budgets[1])
    assert second["fits"] == "False" and int(second["needs_bytes"]) == budgets[1] + 10


def test_summary_ratios_and_targets(result):
    rows = sweep.rows_of(result)
    comparison = sweep.compare(rows)
    top = comparison[-1]
    assert top["best"]["strategy"] == "torch-ddp" and top["vs_best"] == pytest.approx(1.1)
    assert set(top["ablation"]) == set(run_mod.ABLATIONS)  # shown apart, never the best baseline
    v = sweep.verdicts(comparison, rows)
    assert not v["peak_within_budget_ok"]  # the made-up over-budget point
    assert v["osdp_gain_ok"] and v["osdp_vs_best_max"] == pytest.approx(1.1)
    assert v["budgets_without_osdp_plan"] == [comparison[0]["budget_bytes"]]
    # where OSDP measured over its budget and a baseline fits, OSDP misses the every-budget target
    second = comparison[1]
    if second["best"] is not None:
        assert second["vs_best"] is None and not v["osdp_vs_best_ok"]
    text = sweep.summary_markdown([{**result, "device_info": {"flops": {"float32": 1e9}}}], rows, {
        "profile": "test", "command": "x", "date": "today", "seconds": 60, "world_size": 2, "rounds": 2,
        "min_steps": 20, "time_per_run_s": 1.0, "reduce_scatter": "pairwise", "parts": [],
        "machine": {"cpu": "cpu", "cores": 2, "platform": "linux", "python": "3", "torch": "2"}})
    assert "| OSDP efficiency |" in text and "torch-ddp+ac" in text and "native all-gather, pairwise reduce-scatter" in text

    # predicted against measured tokens/s: one point per distinct plan that ran
    ran = {}
    for r in rows:  # a plan run once however many rows show it (in a real sweep they show the same numbers)
        if r["tokens_per_s"] and r.get("predicted_tokens_per_s"):
            ran.setdefault(r.get("plan_hash") or r["strategy"], r)
    errors = [r["predicted_tokens_per_s"] / r["tokens_per_s"] - 1 for r in ran.values()]
    assert sorted(sweep.prediction_errors(rows)) == pytest.approx(sorted(errors))
    assert v["prediction_error_median"] == pytest.approx(statistics.median(abs(e) for e in errors))
    assert v["prediction_ok"] == (statistics.median(abs(e) for e in errors) <= 0.10)


def test_a_sweep_part_end_to_end_on_two_ranks(tmp_path):
    """run.launch as the sweep calls it, at a tiny size: baselines, the ablation and OSDP at two budgets (each
    its own run) with the compute-only reference, in interleaved repeats; then the CSV of the real result."""
    import os

    from osdp import models

    spec = {"model": "gpt2-tiny", "batch_size": 2, "seq_len": 32, "link": run_mod.resolve_link("loopback"),
            "strategies": ["torch-ddp", "fsdp2+ac", "osdp-uniform-fsdp"], "auto_budgets": 2, "rounds": 2,
            "groups": [["torch-ddp", "osdp-uniform-fsdp"]],  # as bench_modes pairs twins; the rest one group
            "time_per_run_s": 0.05, "min_steps": 2, "collective_time_s": 0.5}
    lines = []
    env = dict(os.environ)  # the session's cache: the tests' tiny calibration of 2 ranks, measured once
    run_mod.launch({**spec, "calibrate": "if missing"}, on_line=lines.append, timeout_s=400, env=env)
    result = run_mod.launch(spec, on_line=lines.append, timeout_s=400, env=env)
    assert result["reduce_scatter"] == result["all_gather"] == "pairwise"
    assert "pairwise all-gather, pairwise reduce-scatter" in result["device_info"]["collectives"]["source"]
    assert len(result["compute_only"]["step_s_rounds"]) == 2
    records = result["records"]
    assert {r["strategy"] for r in records} == {"torch-ddp", "fsdp2+ac", "osdp-uniform-fsdp", "osdp"}
    osdp_runs = [r for r in records if r["strategy"] == "osdp" and r["status"] == "ran"]
    assert len(osdp_runs) == 2 and len({r["run"] for r in osdp_runs}) == 2  # every budget its own run
    for r in records:
        m = r["measured"]
        assert len(m["step_s_rounds"]) == 2 and all(n >= 2 for n in m["timed_steps"]), r["strategy"]
        assert m["peak_bytes"] > 0 and 0 < m["efficiency"] and len(m["efficiency_rounds"]) == 2, r["strategy"]
        assert ("predicted_peak_bytes" in r) == (r["strategy"] != "torch-ddp" and r["strategy"] != "fsdp2+ac")
    ddp = next(r for r in records if r["strategy"] == "torch-ddp")
    uniform = next(r for r in records if r["strategy"] == "osdp-uniform-fsdp")
    # a group's members step in turn, as many steps each: their i-th steps pair
    assert [len(x) for x in ddp["measured"]["step_s_each"]] == [len(x) for x in uniform["measured"]["step_s_each"]]
    assert [len(x) for x in ddp["measured"]["step_s_each"]] == ddp["measured"]["timed_steps"]
    params = sum(p.numel() * 4 for p in models.build("gpt2-tiny", seq_len=32).parameters())
    # DDP's buckets (counted by osdp.machine.memory from DDP's record) and the gradients the optimizer steps on
    assert all(x["peak_breakdown"]["gradients"] >= params for x in ddp["measured"]["per_rank"])
    assert result["ddp_needs_bytes"] >= params
    rows = sweep.rows_of(result)
    sweep.write_csv(rows, tmp_path / "sweep.csv")
    assert len(rows) == 4 * 2  # three runs placed at both budgets, and OSDP at each


def test_validation_spread_over_runs(tmp_path):
    import validate_cost_model as vcm

    def run(step_median, under):
        # five plans 1..5 s predicted, their errors step_median three times and +-0.15 (the ranking kept); one
        # measured ``under``% over its predicted peak. The summary written is stale: the spread recomputes it.
        errors = [step_median, step_median, step_median, 0.15, -0.15]
        records = [{"plan": f"p{i}", "predicted_step_s": i + 1.0, "measured_step_s": (i + 1.0) / (1 + e),
                    "step_error": e, "predicted_peak_bytes": 100, "measured_peak_bytes": 100 + under * (i == 0),
                    "peak_error": 100 / (100 + under * (i == 0)) - 1} for i, e in enumerate(errors)]
        return {"seconds": 900, "calibration": {"calibration": {"compute_scale": 1.1}},
                "results": {"gpt2-tiny": {"summary": {"stale": True}, "records": records}},
                "train": {"step_error": 0.05}}

    paths = []
    for i, (median, under) in enumerate([(0.05, 0), (0.12, 1), (0.08, 3)]):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(run(median, under)))
    text = vcm.spread(paths)
    rows = {line.split(" | ")[1]: line for line in text.splitlines() if line.startswith("| gpt2-tiny")}
    # met in two runs of three is not met
    assert rows["time err median"].endswith("| 5.0% | 12.0% | 8.0% | NO |")
    assert rows["time err worst"].endswith("| yes |") and rows["Kendall tau"].endswith("| 1.00 | 1.00 | 1.00 | yes |")
    assert rows["peak under measured, worst"].endswith("| +0.0% | +1.0% | +3.0% | NO |")
    assert "| default `osdp train` | predicted vs measured step | within 15% | +5.0% | +5.0% | +5.0% | yes |" in text


def test_plots_from_a_results_folder(result, tmp_path):
    import plots

    rows = sweep.rows_of(result)
    sweep.write_csv(rows, tmp_path / "sweep.csv")
    meta = {"date": "today", "parts": [{"model": "gpt2-tiny", "link": "loopback", "load_before": [1.0]}]}
    (tmp_path / "runs.json").write_text(json.dumps({"meta": meta, "results": [result]}))
    for p in plots.plot_all(tmp_path):
        assert p.stat().st_size > 10_000


def test_gpu_ratio_rate():
    ratio = run_mod.gpu_flop_per_byte()
    assert 1000 < ratio < 2000  # 8x H100 NVLink: bf16 FLOP/s over all-gather busbw
    assert netns.rate_for_ratio(100e9, 1250) == 640_000_000  # 100 GFLOP/s at 1250 FLOP/byte: 80 MB/s
    link = run_mod.resolve_link("tbf:600mbit")
    assert link["kind"] == "veth" and link["rate_bit_per_s"] == 600_000_000


def test_inter_node_link_rate(monkeypatch):
    # h100-nvlink-ndr400: 0.45 x 989 TFLOP/s bf16 per GPU over 46 GB/s per rank across nodes (8 NICs, 8 GPUs)
    assert run_mod.inter_node_flop_per_byte() == pytest.approx(0.45 * 989e12 / 46e9)
    monkeypatch.setattr(run_mod.os, "cpu_count", lambda: 2)
    link = run_mod.resolve_link("inter-node-ratio", flops=100e9, ratio=10_000, ranks_per_node=2)
    # 4 ranks on 2 cores get half a core each: 50 GFLOP/s at 10,000 FLOP/byte is 5 MB/s per rank, and the
    # namespace's egress carries both ranks of the node
    assert link["rank_flops"] == 50e9 and link["rate_bit_per_s"] == 2 * 40_000_000
    assert link["level"] == "inter" and run_mod.link_nproc(link) == 4
    assert run_mod.link_nproc(run_mod.resolve_link("gpu-ratio", flops=100e9)) == 2  # one rank per namespace


def test_two_node_summary_targets_and_figures(result, tmp_path):
    """sweep_nodes' report of a made-up part: the multi-node baselines, OSDP against the best and against FSDP2
    across the world, the targets, the files."""
    hybrid = {"fsdp2-zero2": "fsdp2-hsdp", "fsdp2-zero2+ac": "fsdp2-hsdp+ac"}
    records = [{**r, "world_size": 4, "link": "inter-node-ratio", "strategy": hybrid.get(r["strategy"], r["strategy"])}
               for r in result["records"] if not r["strategy"].startswith("osdp-uniform")]
    part = {**result, "records": records, "nodes": 2, "ranks_per_node": 2,
            "link": {"name": "inter-node-ratio", "label": "veth", "measured_busbw_bytes_per_s": {"all_gather": 4e6},
                     "measured_inter_busbw_bytes_per_s": {"all_gather": 2e6}},
            "device_info": {"flops": {"float32": 2e10}},
            "machine": {"cpu": "cpu", "cores": 2, "platform": "linux", "python": "3", "torch": "2"}}
    meta = {"profile": "test", "command": "x", "date": "today", "seconds": 60, "machine": part["machine"],
            "rounds": 2, "min_steps": 3, "time_per_run_s": 0.3, "reduce_scatter": "pairwise", "osdp_source": "x",
            "link": {"label": "veth", "target_flop_per_byte": 9675.0, "ratio_of": "h100-nvlink-ndr400"},
            "parts": [{"model": "gpt2-tiny", "link": "inter-node-ratio", "load_before": [1.0], "load_after": [1.0]}]}
    (tmp_path / "runs.json").write_text(json.dumps({"meta": meta, "results": [part]}))
    sweep_nodes.report(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())["gpt2-tiny"]
    top = summary["budgets"][-1]
    # at the top budget every baseline fits: torch-ddp is the best, fsdp2 the faster FSDP2 across the world
    assert top["best"] == "torch-ddp" and top["vs_best"] == pytest.approx(1.1)
    assert top["fsdp_world"] == "fsdp2" and top["vs_fsdp_world"] == pytest.approx(1100 / 990)
    assert top["hsdp"] == "fsdp2-hsdp" and top["vs_hsdp"] == pytest.approx(1100 / 980)
    v = summary["verdicts"]
    assert not v["vs_fsdp_world_ok"] and v["vs_fsdp_world_max"] == pytest.approx(1100 / 990)  # below 1.2
    assert not v["peak_within_budget_ok"]  # the made-up over-budget point
    with (tmp_path / "sweep.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {r["nodes"] for r in rows} == {"2"} and "fsdp2-hsdp+ac" in {r["strategy"] for r in rows}
    text = (tmp_path / "summary.md").read_text()
    assert "| OSDP / FSDP2 world |" in text and "across nodes 2.0 MB/s" in text
    assert (tmp_path / "throughput_gpt2-tiny.png").stat().st_size > 10_000


@pytest.mark.skipif(netns.missing_tools() is not None, reason=f"{netns.missing_tools()}")
def test_veth_link_setup_and_teardown():
    try:
        link = netns.VethLink(rate_bit=200_000_000)
        link.__enter__()
    except netns.NetnsUnavailable as e:  # root and tools, but a kernel without netns/veth/tbf
        pytest.skip(str(e))
    names = list(link.namespaces)
    try:
        assert set(names) <= set(netns.list_namespaces())
        assert "tbf" in link.qdisc(0) and "tbf" in link.qdisc(1)
        out = subprocess.run(link.exec_prefix(1) + ["ip", "-4", "addr", "show", "dev", netns.IFNAME],
                             capture_output=True, text=True).stdout
        assert "10.77.0.2/24" in out
        # a node's ranks reach each other over its loopback (unshaped), the other node through the shaped veth
        assert link.route_device(0, link.addresses[0]) == "lo" == link.route_device(1, link.addresses[1])
        assert link.route_device(0, link.addresses[1]) == netns.IFNAME == link.route_device(1, link.addresses[0])
    finally:
        link.__exit__(None, None, None)
    assert not set(names) & set(netns.list_namespaces())
    # a failure inside the block still removes the namespaces
    with pytest.raises(RuntimeError):
        with netns.VethLink(rate_bit=None) as link:
            names = list(link.namespaces)
            raise RuntimeError("boom")
    assert not set(names) & set(netns.list_namespaces())


@pytest.mark.skipif(netns.missing_tools() is not None, reason=f"{netns.missing_tools()}")
def test_stale_namespaces_of_dead_runs_are_removed():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    name = f"{netns.PREFIX}{dead.pid}r0a"
    if subprocess.run(["ip", "netns", "add", name]).returncode != 0:
        pytest.skip("cannot create network namespaces here")
    try:
        assert name in netns.cleanup_stale()
        assert name not in netns.list_namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_gpu_paper_config_smoke(tmp_path):
    cmd = [sys.executable, str(EXPERIMENTS / "gpu_paper_config.py"), "--model", "gpt2-tiny", "--device", "cpu",
           "--budget", "5MiB", "--batch-sizes", "4", "--steps", "1", "--warmup", "1", "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    record = json.loads((tmp_path / "gpu_paper_config.json").read_text())
    assert record["world_size"] == 8 and "collectives not executed" in record["note"]
    names = [x["name"] for x in record["runs"]]
    assert names == ["osdp", "fsdp"]
    for x in record["runs"]:
        assert 0 < x["peak_bytes"] and x["step_s_median"] > 0
    osdp_run = record["runs"][0]
    assert osdp_run["predicted_peak_bytes"] <= record["budget_bytes"]
    assert (tmp_path / "gpu_paper_config.png").stat().st_size > 10_000


def test_gpu_check_dry_run(tmp_path):
    """experiments/gpu_check.py --dry-run: every part set up and run on the CPU at tiny sizes (fake process
    group, stand-in gathers, guarded compile), and the record holds everything the GPU run reports."""
    cmd = [sys.executable, str(EXPERIMENTS / "gpu_check.py"), "--dry-run", "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    record = json.loads((tmp_path / "cpu-dry-run.json").read_text())
    assert record["dry_run"] and record["device"] == "cpu" and record["torch"] == torch.__version__
    assert set(record["parts"]) == {"tests", "user_path", "overlap", "paper_config", "flops", "mfu"}
    assert not [p for p in record["parts"].values() if "error" in p]
    # 1. the CUDA tests are collected under the gpu marker (the dry run does not run them)
    collected = record["tests"]["collected"]
    for test in ("test_split.py::test_cuda_stream_path_matches_linear",
                 "test_bad_inputs.py::test_a_model_on_two_devices_or_on_another_device_is_refused",
                 "test_gpu.py::test_peak_memory_on_cuda_is_the_allocators_peak_over_the_block",
                 "test_gpu.py::test_bf16_training_of_gpt2_small_on_one_rank_matches_fp32",
                 "test_gpu.py::test_a_checkpoint_saved_on_cuda_loads_on_cpu"):
        assert any(c.endswith(test) for c in collected), test
    assert not record["tests"]["ran"] and len(collected) < 20  # the marker selects, not the whole suite
    # the user's path: osdp train on one rank, DDP and then OSDP below DDP's measured peak, within its budget
    runs = record["user_path"]["runs"]
    assert set(runs) == {"ddp", "osdp@0.90"} and all(r["returncode"] == 0 for r in runs.values())
    osdp_run = runs["osdp@0.90"]
    assert osdp_run["budget_bytes"] < runs["ddp"]["measured_peak_bytes"]
    assert 0 < osdp_run["measured_peak_bytes"] <= osdp_run["budget_bytes"] and osdp_run["within_budget"]
    assert osdp_run["predicted_step_s"] > 0 and osdp_run["measured_step_s"] > 0
    assert record["targets"]["user_path_within_budget"]
    # 2. the stand-in drives the C++ op: each k's output equals nn.Linear's
    assert set(record["split_hidden_fraction"]) == {"2", "4", "8"}
    for k, row in record["split_overlap"]["per_k"].items():
        assert row["matches_linear"] and 0 <= row["hidden_fraction"] <= 1, k
        assert row["hideable_fraction"] == 1 - 1 / int(k)
    # 3. OSDP at three budgets, FSDP, ZeRO-2 and five more, rank 0 of 8; predicted and measured peaks
    plans = record["paper_config"]
    assert {"osdp", "osdp@4MiB", "osdp@3MiB", "fsdp", "zero2"} <= set(plans) and len(plans) >= 10
    for name, p in plans.items():
        assert p["measured_peak_bytes"] > 0 and p["predicted_peak_bytes"] > 0, name
        assert p["measured_compute_s"] > 0 and p["predicted_compute_s"] > 0, name
    assert record["over_budget"] == [] and record["targets"]["no_plan_over_budget"]
    assert 0 <= record["memory_error_median"] <= record["memory_error_worst"]
    assert "collectives not executed" in record["paper_config_setting"]["note"]
    assert (tmp_path / "cpu-dry-run.paper_config.png").stat().st_size > 10_000
    # 4. compute ranking, and the measured matmul rate against the preset
    assert -1 <= record["compute_kendall_tau"] <= 1
    assert record["flops"]["preset"] == "cpu-loopback" and record["flops"]["float32"]["measured"] > 0
    # 5. tokens/s and MFU, eager and compiled (dynamo, guarded as on the GPU)
    for model in ("gpt2-tiny", "llama-tiny"):
        for mode in ("eager", "compiled"):
            run = record["training"][model][mode]
            assert run["tokens_per_s"] > 0 and record["mfu"][model][mode] > 0, (model, mode)
    assert record["training"]["gpt2-tiny"]["compiled"]["compile_backend"] == "eager"
    md = (tmp_path / "cpu-dry-run.md").read_text()
    assert "(dry run)" in md and "## 5. One GPU's limit" in md


_SIGNAL_CHILD = """
import os, signal, sys, time
sys.path.insert(0, {experiments!r})
import netns
link = netns.VethLink(rate_bit=100_000_000).__enter__()
p = netns.spawn(link.exec_prefix(0) + ["sleep", "60"], dict(os.environ))
print(" ".join(link.namespaces), p.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(netns.missing_tools() is not None, reason=f"{netns.missing_tools()}")
def test_sigterm_removes_namespaces_and_stops_ranks():
    import os
    import signal
    import time

    child = subprocess.Popen([sys.executable, "-c", _SIGNAL_CHILD.format(experiments=str(EXPERIMENTS))],
                             stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline().split()
        if not line:
            pytest.skip("could not make the link here")
        *names, pid = line
        assert set(names) <= set(netns.list_namespaces())
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=30) == -signal.SIGTERM  # dies of the signal, as without the handler
    finally:
        if child.poll() is None:
            child.kill()
    assert not set(names) & set(netns.list_namespaces())
    for _ in range(50):  # the rank it started (here: sleep) is stopped too
        if not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"process {pid} started in the namespace is still running")


def test_bench_modes_ratio_is_the_median_over_paired_steps():
    """A twin pair's speed ratio pairs each native step with the OSDP step taken beside it, over every repeat;
    the bracketed per-repeat figures are the same medians within each repeat."""
    import bench_modes

    def record(strategy, each, peak):
        flat = [t for r in each for t in r]
        return {"strategy": strategy, "measured": {
            "step_s_each": each, "step_s_median": statistics.median(flat), "peak_bytes": peak, "efficiency": 0.5}}

    native_each = [[1.0, 2.0, 1.0], [1.2, 1.0]]
    osdp_each = [[1.0, 1.0, 2.0], [1.0, 1.0]]  # slower on its own steps 3, faster in repeat 2
    records = []
    for ours, native in bench_modes.PAIRS:
        records += [record(ours, osdp_each, 100), record(native, native_each, 100)]
    rows = bench_modes.pair_rows({"model": "m", "link": {"name": "loopback"}, "records": records})
    ratios = [1.0, 2.0, 0.5, 1.2, 1.0]
    assert len(rows) == len(bench_modes.PAIRS)
    for row in rows:
        assert row["speed_ratio"] == pytest.approx(statistics.median(ratios))
        assert row["speed_ratio_rounds"] == pytest.approx([1.0, 1.1])
        assert row["paired_steps"] == 5 and row["peak_ratio"] == 1.0 and row["meets_targets"]


def test_bench_modes_report_is_rebuilt_from_the_parts_a_run_saved(tmp_path):
    import bench_modes

    def part(model, link, native_s):
        records = []
        for ours, native in bench_modes.PAIRS:
            for strategy, each in ((ours, [[1.0, 1.0]]), (native, [[native_s, native_s]])):
                records.append({"strategy": strategy, "measured": {
                    "step_s_each": each, "step_s_median": each[0][0], "peak_bytes": 2**20, "efficiency": 0.5}})
        return {"model": model, "link": {"name": link}, "records": records, "machine": {"cpu": "Some CPU", "cores": 2},
                "rounds": 1, "min_steps": 2, "reduce_scatter": "pairwise", "loadavg_before": [0.5], "seconds": 60.0}

    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "part-1-m-loopback.json").write_text(json.dumps(part("m", "loopback", 1.0)))
    (parts / "part-2-m-gpu-ratio.json").write_text(json.dumps(part("m", "gpu-ratio", 0.9)))
    assert bench_modes.main(["--from-runs", str(parts), "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_modes.json").read_text())
    assert [(r["link"], r["speed_ratio"]) for r in report["pairs"]] == \
        [("loopback", 1.0)] * len(bench_modes.PAIRS) + [("gpu-ratio", 0.9)] * len(bench_modes.PAIRS)
    assert not report["all_met"] and report["seconds"] == 120.0
    md = (tmp_path / "bench_modes.md").read_text()
    assert md.count("| missed |") == len(bench_modes.PAIRS) and "2 min." in md


def test_sweeps_run_a_part_at_a_time_merge_into_one_report(result, tmp_path):
    meta = {"profile": "full", "command": "x", "date": "today", "seconds": 60, "world_size": 2, "rounds": 2,
            "min_steps": 20, "time_per_run_s": 1.0, "reduce_scatter": "pairwise", "budgets": 4, "calibrations": {},
            "machine": {"cpu": "cpu", "cores": 2, "platform": "linux", "python": "3", "torch": "2"}}
    parts = []
    for link, source in (("gpu-ratio", "aaa"), ("gpu-ratio", "bbb")):  # two models' parts on one link
        part = {**result, "link": {"name": link}, "records": [{**r, "link": link} for r in result["records"]],
                "device_info": {"flops": {"float32": 1e9}}}
        folder = tmp_path / source
        folder.mkdir()
        (folder / "runs.json").write_text(json.dumps({"meta": {
            **meta, "osdp_source": source, "links": [{"name": link}], "calibrations": {link: {"measured_at": source}},
            "parts": [{"model": "gpt2-tiny", "link": link, "load_before": [0.0] * 3, "load_after": [0.0] * 3,
                       "seconds": 30.0}]}, "results": [part]}))
        parts.append(folder)
    out = tmp_path / "merged"
    assert sweep.merge(parts, out, plots=False) == 0
    merged = json.loads((out / "runs.json").read_text())
    assert [r["link"]["name"] for r in merged["results"]] == ["gpu-ratio", "gpu-ratio"]
    assert merged["meta"]["osdp_source"] == "aaa, bbb" and merged["meta"]["seconds"] == 120
    assert [p["osdp_source"] for p in merged["meta"]["parts"]] == ["aaa", "bbb"]
    assert merged["meta"]["calibrations"] == {"aaa gpu-ratio": {"measured_at": "aaa"},  # each part's kept
                                              "bbb gpu-ratio": {"measured_at": "bbb"}}
    with (out / "sweep.csv").open() as f:
        table = list(csv.DictReader(f))
    assert {r["link"] for r in table} == {"gpu-ratio"}
    assert len(table) == 2 * len(sweep.rows_of(result))
    # parts of different settings are not one sweep
    (parts[1] / "runs.json").write_text(json.dumps({"meta": {**meta, "rounds": 5, "osdp_source": "bbb", "links": [],
                                                             "parts": []}, "results": []}))
    with pytest.raises(SystemExit, match="different settings"):
        sweep.merge(parts, tmp_path / "refused", plots=False)


def test_same_plans_replans_a_part_from_its_stored_calibration(result, tiny, tmp_path):
    """experiments/same_plans.py: from a part's runs.json, the plan at each budget as this osdp's search makes
    it (every granularity: at most GRANULARITY_TOLERANCE slower than the one-granularity search that made the
    part's plans, where fewer units are taken at a near-tie), within the budget, the same lines on every call
    (so two commits' outputs can be diffed)."""
    import same_plans

    from osdp.cost.terms import Calibration
    from osdp.planner import GRANULARITY_TOLERANCE

    _, _, info, _ = tiny
    part = {**result, "device_info": info.to_dict(), "calibration": {"calibration": Calibration().to_dict()}}
    path = tmp_path / "runs.json"
    path.write_text(json.dumps({"meta": {}, "results": [part]}))
    lines = same_plans.plan_lines(str(path))
    assert lines == same_plans.plan_lines(str(path))
    at_budgets = [r for r in result["records"] if r["strategy"] == "osdp"]
    assert len(lines) == len(at_budgets)
    for line, record in zip(lines, at_budgets):
        fields = line.split()
        assert fields[:3] == ["gpt2-tiny", "loopback", str(record["budget_bytes"])]
        if record["status"] == "budget too small":
            assert "budget too small" in line
            continue
        step, peak = float(fields[5]), int(fields[8])
        slowest = record["predicted_step_s"] / (1 - GRANULARITY_TOLERANCE) * (1 + 1e-6)  # 1e-6: as printed
        assert peak <= record["budget_bytes"] and step <= slowest


def _fake_link_probes(monkeypatch, flop_per_byte_at):
    """Probes that answer ``flop_per_byte_at(rate, n)`` for the n-th probe at that rate, on a 1e11 FLOP/s core."""
    seen: dict[int, int] = {}

    def probe(link, **kwargs):
        rate = link["rate_bit_per_s"]
        seen[rate] = seen.get(rate, 0) + 1
        return {"busbw": 1e11 / flop_per_byte_at(rate, seen[rate])}

    monkeypatch.setattr(run_mod, "probe_link", probe)
    monkeypatch.setattr(run_mod, "shaped_busbw", lambda link, info: info["busbw"])
    return {"name": "gpu-ratio", "target_flop_per_byte": 1000.0, "core_flops": 1e11, "rate_bit_per_s": 800_000_000}


def test_the_link_rate_is_kept_only_when_two_probes_in_a_row_are_within_tolerance(monkeypatch):
    """A first probe within 10% followed by one 40% off (the shaped veth did that) is not trusted: the rate is
    rescaled by the mean of both, and the next rate is kept once two probes in a row are within 10%."""
    def answer(rate, n):
        if rate == 800_000_000:
            return 1050.0 if n == 1 else 600.0
        return 1020.0

    link = _fake_link_probes(monkeypatch, answer)
    out = run_mod.calibrate_gpu_ratio(link, on_line=lambda line: None)
    assert [(p["rate_bit_per_s"], round(p["flop_per_byte"])) for p in out["calibration"]] == [
        (800_000_000, 1050), (800_000_000, 600), (int(800_000_000 * 1e8 / ((1e11 / 1050 + 1e11 / 600) / 2)), 1020),
        (int(800_000_000 * 1e8 / ((1e11 / 1050 + 1e11 / 600) / 2)), 1020)]
    assert out["calibrated"] and out["rate_bit_per_s"] == out["calibration"][-1]["rate_bit_per_s"]
    assert out["probe_flop_per_byte"] == pytest.approx(1020.0)


def test_a_link_rate_never_confirmed_is_the_closest_mean_and_says_so(monkeypatch):
    """Probes that alternate in and out of tolerance at every rate: after max_probes the rate whose probes'
    mean is closest to the aim is kept, marked not calibrated."""
    link = _fake_link_probes(monkeypatch, lambda rate, n: 1080.0 if n % 2 else 1400.0)
    out = run_mod.calibrate_gpu_ratio(link, on_line=lambda line: None, max_probes=4)
    assert len(out["calibration"]) == 4 and not out["calibrated"]
    means = {}
    for p in out["calibration"]:
        means.setdefault(p["rate_bit_per_s"], []).append(1e11 / p["flop_per_byte"])
    closest = min(means, key=lambda r: abs(1e11 / statistics.fmean(means[r]) / 1000 - 1))
    assert out["rate_bit_per_s"] == closest
    assert out["probe_flop_per_byte"] == pytest.approx(1e11 / statistics.fmean(means[closest]))


def _shaped_device_info(flops: float, rate: float) -> dict:
    """A device_info whose collectives were measured on a link that passes 96 KB bursts at once and the rest
    at ``rate`` bytes/s per direction (2 ranks)."""
    from osdp.machine.collective_model import COLLECTIVES, CollectiveModel
    from osdp.machine.device_info import DeviceInfo

    samples = {c: [(n, 1e-4 + max(0.0, n / 2 - 96e3) / rate) for n in (4096, 32768, 262144, 2**21, 2**24)]
               for c in COLLECTIVES}
    return DeviceInfo(name="cpu", memory_bytes=None, world_size=2, device_type="cpu",
                      collectives=CollectiveModel.fit(2, samples, "synthetic"), flops={"float32": flops}).to_dict()


def test_the_shaped_link_is_measured_by_its_largest_message_not_the_fit():
    info = _shaped_device_info(1e11, 90e6)
    assert run_mod.shaped_busbw({"name": "gpu-ratio"}, info) == pytest.approx(0.5 * 2**24 / (1e-4 + (2**23 - 96e3) / 90e6))
    assert run_mod.shaped_busbw({"name": "gpu-ratio"}, info) == pytest.approx(90e6, rel=0.02)


def test_the_sweep_checks_its_calibration_against_the_link_target(capsys):
    link = {"name": "gpu-ratio", "target_flop_per_byte": 1000.0}
    near = sweep.check_calibrated_link(link, {"device_info": _shaped_device_info(1e11, 1.05e8)})
    assert near == pytest.approx(1e11 / 1.05e8, rel=0.02) and "WARNING" not in capsys.readouterr().out
    far = sweep.check_calibrated_link(link, {"device_info": _shaped_device_info(1e11, 0.7e8)})
    assert far == pytest.approx(1e11 / 0.7e8, rel=0.02)
    assert "WARNING: the calibration's link gives 14" in capsys.readouterr().out
    assert sweep.check_calibrated_link({"name": "loopback"}, {}) is None
