"""osdp.calibration: the fit recovers known runtime costs, the cache is keyed by everything and never
confuses jobs, and ``osdp calibrate`` measures on live ranks once and then reads its cache."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from dist_harness import run_ranks

from osdp.calibration.fit import fit_calibration, pooled_compute_scale
from osdp.calibration.nets import PROFILES, CalibrationError, calibration_jobs
from osdp.calibration.store import (
    CalibrationKey,
    MachineCalibration,
    cached_calibration,
    calibration_path,
    other_calibrations,
    read_calibration,
)
from osdp.cost.schedule import predict
from osdp.cost.terms import Calibration
from osdp.describe.analytic import describe_analytic
from osdp.machine.presets import device_preset
from osdp.schema.plan import MODES

KNOWN = Calibration(
    compute_scale=1.25,
    unit_overhead_s={"replicate": 0.4e-3, "zero2": 0.7e-3, "zero3": 1.1e-3},
    root_overhead_s={"replicate": 2.5e-3, "zero2": 1.5e-3, "zero3": 1.8e-3},
    unit_s_per_byte={"replicate": 0.2e-9, "zero2": 0.5e-9, "zero3": 0.9e-9},
    param_overhead_s=60e-6,
    checkpoint_overhead_s=0.3e-3,
    optimizer_tensor_s=90e-6,
    slice_overhead_s=0.2e-3,
    slice_s_per_byte=0.4e-9,
    slice_contention=0.5,
    overlap=0.0,
    ddp_overlap=0.4,
    meeting_wait_s_per_sqrt_s=8e-3,
    margin_bytes=4096,
)


@pytest.mark.parametrize("profile_name", ["full", "quick"])
def test_fit_recovers_the_costs_that_made_the_measurements(profile_name):
    """Jobs 'measured' as the cost model with known runtime costs predicts them: the fit gives those back (the
    quick profile, which has no net to hide DDP's all-reduce on, all but that fraction)."""
    device = device_preset("cpu-loopback", 2)
    profile = PROFILES[profile_name]
    jobs = calibration_jobs(torch.device("cpu"), profile)
    descriptions = {
        spec.name: describe_analytic(spec.build(),
                                     (torch.randn(spec.batch, spec.width),), device, world_size=2,
                                     batch_sizes=(spec.batch,), progress=False)
        for spec in profile.nets
    }
    for d in descriptions.values():  # the optimizer's step per byte, as a measured description has it
        d.optimizer_s_per_byte = {"adamw": 2e-10}
    measured = {}
    for name, job in jobs.items():
        pred = predict(descriptions[name.split("-")[1]], job.plan, device, calibration=KNOWN)
        optimizer_s = pred.breakdown["totals"]["optimizer_s"]
        measured[name] = {"measured_step_s": pred.step_s, "measured_fwd_bwd_s": pred.step_s - optimizer_s,
                          "measured_peak_bytes": pred.peak_bytes}
    fitted = fit_calibration(profile, KNOWN.compute_scale, descriptions, jobs, measured, device, overlap=0.0,
                             meeting_wait=KNOWN.meeting_wait_s_per_sqrt_s)
    assert fitted.ddp_overlap == pytest.approx(KNOWN.ddp_overlap if profile_name == "full" else 0.0)
    for field in ("param_overhead_s", "checkpoint_overhead_s", "optimizer_tensor_s", "slice_overhead_s",
                  "slice_s_per_byte", "slice_contention", "meeting_wait_s_per_sqrt_s"):
        assert getattr(fitted, field) == pytest.approx(getattr(KNOWN, field), rel=1e-6, abs=1e-12), field
    for mode in MODES:
        # the quick fit lays the little all-reduce the wide net's replicated job hides (its 16 MiB fill DDP's
        # buckets) on the replicated overheads: -1.3% of the per-byte cost here, 0.04% of the per-unit one
        rel = 0.02 if profile_name == "quick" and mode == "replicate" else 1e-6
        assert fitted.unit_overhead_s[mode] == pytest.approx(KNOWN.unit_overhead_s[mode], rel=rel)
        assert fitted.root_overhead_s[mode] == pytest.approx(KNOWN.root_overhead_s[mode], rel=rel)
        assert fitted.unit_s_per_byte[mode] == pytest.approx(KNOWN.unit_s_per_byte[mode], rel=rel)
    assert fitted.margin_bytes == KNOWN.margin_bytes and fitted.compute_scale == KNOWN.compute_scale


@pytest.mark.parametrize("model_name, needs", [("gpt2-tiny", False), ("gpt2-mini", True)])
def test_a_model_within_ddps_first_bucket_is_priced_alike_without_the_hidden_all_reduce(model_name, needs):
    """What lets a small model's job use the quick calibration: the one term it lacks prices nothing for it."""
    from osdp import models
    from osdp.calibration.nets import needs_ddp_overlap
    from osdp.models.data import synthetic_batch
    from osdp.schema.plan import Plan, UnitPlan

    model = models.build(model_name, seq_len=16)
    assert needs_ddp_overlap(model) == needs
    description = describe_analytic(model, synthetic_batch(models.get_config(model_name, seq_len=16), 2),
                                    device_preset("cpu-loopback", 2), world_size=2, batch_sizes=(2,), progress=False)
    plan = Plan([UnitPlan(u.path, "replicate") for u in description.units], batch_size=2)
    device = device_preset("cpu-loopback", 2)
    with_, without = (predict(description, plan, device, calibration=dataclasses.replace(KNOWN, ddp_overlap=f))
                      for f in (KNOWN.ddp_overlap, 0.0))
    assert (with_.breakdown["totals"]["ddp_hideable_s"] > 0) == needs
    assert (with_.step_s < without.step_s) == needs and with_.peak_bytes == without.peak_bytes


def _fake_measurement(device, profile, progress=None):
    """A calibration record standing in for ``measure_calibration`` (which takes a minute): the lookup is tested."""
    from osdp.calibration.store import MachineCalibration

    key = CalibrationKey.current(device, profile.name)
    return MachineCalibration(key, device_preset("cpu-loopback", 1), KNOWN, 1.0, "now", {"measured": profile.name})


def test_a_job_uses_the_fullest_cached_calibration_and_measures_only_what_it_needs(tmp_path, monkeypatch):
    import osdp.calibration.measured as measured

    monkeypatch.setenv("OSDP_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("OSDP_CALIBRATION_PROFILE")
    monkeypatch.setattr(measured, "measure_calibration", _fake_measurement)
    cpu = torch.device("cpu")
    # a small model's first job measures the quick one; a larger model's needs the full one, then every job uses it
    assert measured.calibrate(cpu, ddp_overlap=False, progress=False).key.profile == "quick"
    assert measured.calibrate(cpu, ddp_overlap=False, progress=False).details == {"measured": "quick"}
    assert measured.calibrate(cpu, ddp_overlap=True, progress=False).key.profile == "full"
    assert measured.calibrate(cpu, ddp_overlap=False, progress=False).key.profile == "full"
    assert measured.calibrate(cpu, profile="quick", progress=False).key.profile == "quick"  # asked by name
    with pytest.raises(CalibrationError, match=r"osdp calibrate --full --nproc 1"):  # validate's, in a new cache
        monkeypatch.setenv("OSDP_CACHE_DIR", str(tmp_path / "empty"))
        measured.calibrate(cpu, measure=False)


def test_the_compute_scale_is_the_median_over_both_moments_rounds():
    # a validation run's calibration (run 20): seven of the first fifteen rounds under a passing load
    before = [1.61, 1.4, 1.41, 1.45, 1.9, 1.5, 2.12, 1.19, 1.08, 1.16, 1.05, 1.05, 1.04, 1.09, 1.08]
    after = [1.04, 1.02, 1.07, 1.11, 1.07, 1.1, 1.1, 1.1, 1.19, 1.1, 1.24, 1.07, 1.09, 1.11, 1.03]
    assert pooled_compute_scale({"ratios": before}, {"ratios": after}) == pytest.approx(1.1)  # before alone: 1.19
    assert pooled_compute_scale({"ratios": after}, None) == pytest.approx(1.1)  # no second moment: its own median


def _key(**changes) -> CalibrationKey:
    key = CalibrationKey(hosts=("node-a",), device="Some CPU", device_type="cpu", backend="gloo", world_size=2,
                         threads=1, interface="", torch="2.13.0+cpu", profile="tiny")
    return dataclasses.replace(key, **changes)


def _record(key: CalibrationKey) -> MachineCalibration:
    return MachineCalibration(key, device_preset("cpu-loopback", key.world_size), KNOWN, 12.0, "2026-01-01 00:00")


def test_a_calibration_for_another_job_is_never_used(tmp_path, monkeypatch):
    monkeypatch.setenv("OSDP_CACHE_DIR", str(tmp_path))
    theirs = _key(world_size=4, torch="2.11.0", hosts=("node-b",))
    path = calibration_path(theirs)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(_record(theirs).to_dict()))
    mine = _key()
    assert read_calibration(path, theirs) == _record(theirs)  # round trip under its own key
    assert cached_calibration(mine) is None  # looked up by the whole key: another's is not found
    with pytest.raises(CalibrationError) as e:  # and given by hand, it is refused, naming what differs
        read_calibration(path, mine)
    text = str(e.value)
    assert "hosts ('node-b',) (this job: ('node-a',))" in text and "world_size 4 (this job: 2)" in text
    assert "torch '2.11.0' (this job: '2.13.0+cpu')" in text and "osdp calibrate --nproc 2" in text
    assert [line.split(":")[0] for line in other_calibrations(mine)] == [path.name]
    # a tiny calibration (tests) is keyed apart from a real one on the same machine
    assert calibration_path(_key(profile="full")) != calibration_path(mine)
    path.write_text("{not json")
    with pytest.raises(CalibrationError, match="is not a calibration osdp can read"):
        read_calibration(path)


def _calibrate(rank, world_size):
    from osdp.calibration.measured import calibrate

    record = calibrate(torch.device("cpu"))
    key = CalibrationKey.current(torch.device("cpu"))
    return record.to_dict(), dataclasses.asdict(key), str(calibration_path(key))


def test_calibrate_on_two_ranks_is_cached_and_read_back(tmp_path):
    first = run_ranks(_calibrate, 2, timeout=300)
    second = run_ranks(_calibrate, 2, timeout=300)
    assert first[0] == first[1] and second[0] == second[1]  # every rank holds the same calibration
    record, key, path = first[0]
    assert second[0] == first[0]  # the second job read the first one's cache
    assert key["world_size"] == 2 and key["threads"] == 1 and key["backend"] == "gloo"
    assert key["profile"] == "tiny" and key["torch"] == torch.__version__
    assert record["key"] == key and os.path.exists(path)
    c = record["calibration"]
    assert c["compute_scale"] > 0.5 and sum(c["unit_overhead_s"].values()) > 0  # FSDP2 costs something
    assert c["source"].startswith("measured")
    # the command reads the same cache and says what it holds
    out = tmp_path / "calibration.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "osdp.cli", "calibrate", "--nproc", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "calibration of" in proc.stdout and f"cached in {path}" in proc.stdout
    assert json.loads(out.read_text()) == json.loads(json.dumps(record))


def _calibrate_on_a_machine_with_spreads(rank, world_size, cache, spreads):
    """calibrate() where the fixed step's measured spread is, call after call, ``spreads`` (the rest real)."""
    import osdp.calibration.measured as measured
    from osdp.calibration.nets import PROFILES

    os.environ["OSDP_CACHE_DIR"] = cache
    real, given = measured.measure_compute_scale, iter(spreads)
    measured.measure_compute_scale = lambda device, spec, rounds: {**real(device, spec, 3), "spread": next(given)}
    measured.BUSY_WAIT_S = 0.0
    # the decisions on the spreads are what this test checks: the jobs' timings may be as short as they come
    PROFILES["tiny"] = dataclasses.replace(PROFILES["tiny"], busy_spread=1.3, run_s=0.05, min_steps=2, refits=1,
                                           compute_rounds=3, describe_repeats=1, collectives_s=0.1)
    record = measured.calibrate(torch.device("cpu"), progress=False)
    cached = cached_calibration(CalibrationKey.current(torch.device("cpu")))
    return record.details["busy"], record.details["busy_spread"], cached is not None, len(list(given))


def test_a_calibration_measured_on_a_busy_machine_is_measured_again_then_cached_with_its_noise(tmp_path):
    # busy at first (2.0x, over the profile's 1.3x): measured again, quiet (1.1x); busy by the end (1.6x): the
    # job plans with it and the cache keeps it with that spread, so that a machine that stays busy (a shared
    # cloud VM) does not calibrate again on every run (osdp calibrate --force does)
    out = run_ranks(_calibrate_on_a_machine_with_spreads, 2, str(tmp_path), [2.0, 1.1, 1.6, 9.0], timeout=300)
    assert out[0] == out[1] == (True, 1.6, True, 1)  # both ranks decided alike; one spread left unused
