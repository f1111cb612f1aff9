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

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
sys.path.insert(0, str(EXPERIMENTS))

import netns  # noqa: E402
import run as run_mod  # noqa: E402
import sweep  # noqa: E402

MiB = 2**20


@pytest.fixture(scope="module")
def tiny():
    """gpt2-tiny on 2 ranks of the cpu-loopback preset, described analytically (no process group, ~1 s)."""
    from osdp import models
    from osdp.analytic import describe_analytic
    from osdp.cost import build_problem
    from osdp.device import device_preset

    info = device_preset("cpu-loopback", 2, memory="1GiB")
    with torch.device("meta"):
        model = models.build("gpt2-tiny")
    example = torch.zeros(8, 64, dtype=torch.long, device="meta")
    description = describe_analytic(model, (example, example), info, world_size=2, batch_sizes=(8,), progress=False)
    return model, description, info, build_problem(description, info, 8)


def _record(strategy, plan, predicted, measured_peak, tokens_per_s, budget=None, **extra):
    rec = {"model": "gpt2-tiny", "world_size": 2, "batch_size": 8, "seq_len": 64, "link": "loopback",
           "strategy": strategy, "budget_bytes": budget, "status": "ran", "plan_hash": plan.hash if plan else None,
           "plan_summary": plan.summary() if plan else None, "replicated_fraction": 0.0,
           "predicted_peak_bytes": predicted.peak_bytes if predicted else None,
           "predicted_step_s": predicted.step_s if predicted else None,
           "predicted_tokens_per_s": 512 / predicted.step_s if predicted else None, **extra}
    if tokens_per_s:
        rec["measured"] = {"tokens_per_s": tokens_per_s, "tokens_per_s_rounds": [tokens_per_s * 0.9, tokens_per_s],
                           "step_s_median": 512 / tokens_per_s, "peak_bytes": measured_peak,
                           "per_rank": [{"rank": 0, "peak_bytes": measured_peak, "peak_breakdown": {
                               "parameters": measured_peak // 2, "activations": measured_peak - measured_peak // 2}}]}
    return rec


@pytest.fixture(scope="module")
def result(tiny):
    """A sweep part for gpt2-tiny as run.work returns it, with the measurements made up."""

    import osdp
    from osdp.cost import predict
    from osdp.planner import search
    from osdp.search import BudgetTooSmall, min_peak

    model, description, info, problem = tiny
    lowest, _ = min_peak(problem)
    settings = dict(batch_size=8, world_size=2, model_signature=description.signature)
    records = []
    preds = {}
    for s, tps in (("ddp", 1000.0), ("zero2", 900.0), ("fsdp", 800.0)):
        plan = osdp.strategy_plan(model, s, **settings)
        preds[s] = predict(description, plan, info)
        records.append(_record(s, plan, preds[s], preds[s].peak_bytes - 1000, tps))
    ddp_needs = preds["ddp"].peak_bytes
    budgets = run_mod.auto_budgets(lowest - 4096, ddp_needs, 4)
    for i, budget in enumerate(budgets):
        try:
            plan = search(description, info, [8], budget=budget,
                          model_signature=description.signature).plan
        except BudgetTooSmall as e:
            records.append({**_record("osdp", None, None, None, None, budget), "status": "budget too small",
                            "needs_bytes": e.min_peak_bytes})
            continue
        pred = predict(description, plan, info)
        over = i == 1  # pretend this one measured over its budget
        records.append(_record("osdp", plan, pred, budget + 10 if over else pred.peak_bytes, 1100.0, budget))
    return {"model": "gpt2-tiny", "records": records, "link": {"name": "loopback"}, "lowest_budget_bytes": lowest,
            "ddp_needs_bytes": ddp_needs, "half_replicated_peak_bytes": run_mod.half_replicated_peak(problem, description)}


def test_budgets_span_least_to_ddp(tiny):
    from osdp.search import min_peak

    _, description, _, problem = tiny
    budgets = run_mod.auto_budgets(1000 * 1024, 2000 * 1024, 5)
    assert budgets[0] == 1000 * 1024 and budgets[-1] == 2000 * 1024 and len(budgets) == 5
    assert all(b % 1024 == 0 for b in budgets)
    lowest, _ = min_peak(problem)
    half = run_mod.half_replicated_peak(problem, description)
    assert lowest <= half  # replicating half the parameters costs memory


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
    budgets = sorted({r["budget_bytes"] for r in result["records"] if r["strategy"] == "osdp"})
    # every baseline at every budget: none dropped
    for s in ("ddp", "zero2", "fsdp", "osdp"):
        assert sorted(int(r["budget_bytes"]) for r in table if r["strategy"] == s) == budgets
    for r in table:
        needs = int(r["needs_bytes"]) if r["needs_bytes"] else None
        if r["fits"] == "True":
            assert needs <= int(r["budget_bytes"]) and r["status"] == "fits"
        else:
            assert r["status"].startswith(f"does not fit (needs {needs / MiB:.1f} MiB)")
    ddp = [r for r in table if r["strategy"] == "ddp"]
    assert ddp[-1]["fits"] == "True" and ddp[0]["fits"] == "False"  # fits exactly at the top budget
    # the lowest budget is below what any plan needs: OSDP has no plan, and says what it needs
    first = next(r for r in table if r["strategy"] == "osdp" and int(r["budget_bytes"]) == budgets[0])
    assert first["fits"] == "False" and "no plan" in first["status"]
    assert int(first["needs_bytes"]) == result["lowest_budget_bytes"]
    # planned to fit but measured over: does not fit, needs the measured peak
    second = next(r for r in table if r["strategy"] == "osdp" and int(r["budget_bytes"]) == budgets[1])
    assert second["fits"] == "False" and int(second["needs_bytes"]) == budgets[1] + 10


def test_summary_ratios_and_targets(result):
    rows = sweep.rows_of(result)
    comparison = sweep.compare(rows, result)
    top = comparison[-1]
    assert top["best"]["strategy"] == "ddp" and top["vs_best"] == pytest.approx(1.1)
    v = sweep.verdicts(comparison, rows)
    assert not v["peak_within_budget_ok"]  # the made-up over-budget point
    assert v["budgets_without_osdp_plan"] == [comparison[0]["budget_bytes"]]
    # predicted against measured tokens/s: one point per distinct plan that ran
    ran = {}
    for r in rows:  # a plan run once however many rows show it (in a real sweep they show the same numbers)
        if r["tokens_per_s"]:
            ran.setdefault(r["plan_hash"], r)
    errors = [r["predicted_tokens_per_s"] / r["tokens_per_s"] - 1 for r in ran.values()]
    assert sorted(sweep.prediction_errors(rows)) == pytest.approx(sorted(errors))
    assert v["prediction_error_median"] == pytest.approx(statistics.median(abs(e) for e in errors))
    assert v["prediction_ok"] == (statistics.median(abs(e) for e in errors) <= 0.10)


def test_validation_spread_over_runs(tmp_path):
    import validate_cost_model as vcm

    def run(step_median, under):
        records = [{"measured_peak_bytes": 100 + under, "predicted_peak_bytes": 100}]
        summary = {"step_error_median": step_median, "step_error_worst": 0.15, "kendall_tau_step": 0.9,
                   "peak_error_median": 0.01, "peak_error_worst": 0.03}
        return {"seconds": 900, "calibration": {"calibration": {"compute_scale": 1.1}},
                "results": {"gpt2-tiny": {"summary": summary, "records": records}},
                "train": {"step_error": 0.05}}

    paths = []
    for i, (median, under) in enumerate([(0.05, 0), (0.12, 1), (0.08, 3)]):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(run(median, under)))
    text = vcm.spread(paths)
    rows = {line.split(" | ")[1]: line for line in text.splitlines() if line.startswith("| gpt2-tiny")}
    # met in two runs of three is not met
    assert rows["time err median"].endswith("| 5.0% | 12.0% | 8.0% | NO |")
    assert rows["time err worst"].endswith("| yes |") and rows["Kendall tau"].endswith("| 0.90 | 0.90 | 0.90 | yes |")
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
