"""Groups priced as one unit: k consecutive identical blocks pay the per-unit fixed costs (overhead, the collectives'
latency) once, gather the k blocks' parameters at once, and compute what the k blocks compute."""

import dataclasses
import math

import pytest
import torch

from osdp import models
from osdp.cost.schedule import predict
from osdp.cost.terms import Calibration
from osdp.describe import granularity
from osdp.describe.analytic import describe_analytic
from osdp.machine.collective_model import COLLECTIVES, AlphaBeta, CollectiveModel
from osdp.machine.device_info import DeviceInfo
from osdp.schema.plan import ROOT, Plan, PlanError, UnitPlan

BATCH = 2
ALPHA = {"all_gather": 1e-4, "reduce_scatter": 2e-4, "all_reduce": 3e-4}  # per collective, seconds
CALIBRATION = Calibration(unit_overhead_s={"replicate": 1e-4, "zero2": 2e-4, "zero3": 3e-4}, param_overhead_s=1e-5,
                          checkpoint_overhead_s=5e-5, optimizer_tensor_s=1e-6, overlap=0.0, margin_bytes=12345)


def two_ranks() -> DeviceInfo:
    costs = {c: AlphaBeta(ALPHA.get(c, 1e-4), 1e-9) for c in COLLECTIVES}
    return DeviceInfo("synthetic", 2**34, 2, "cpu", CollectiveModel(2, costs, "synthetic"),
                      {"float32": 1e11, "bfloat16": 1e11})


@pytest.fixture(scope="module")
def blocks():
    """gpt2-mini described analytically with each block one unit."""
    with torch.device("meta"):
        model = models.build("gpt2-mini")
    example = torch.zeros(BATCH, models.get_config("gpt2-mini").seq_len, dtype=torch.long, device="meta")
    return describe_analytic(model, (example, example), two_ranks(), batch_sizes=(BATCH,), granularity="block",
                             progress=False)


def block_paths(description):
    return [p for p in description.paths if p.startswith("blocks.")]


def plan_of(description, k, mode="zero3", checkpoint=False):
    blocks = block_paths(description)
    first = {p: blocks[i - i % k] for i, p in enumerate(blocks)} if k > 1 else {}
    return Plan([UnitPlan(p, mode if p != ROOT else "zero3", checkpoint=checkpoint and p in first or
                          (checkpoint and k == 1 and p in blocks), group=first.get(p))
                 for p in description.paths], batch_size=BATCH)


def test_a_group_is_one_unit_of_all_its_blocks_parameters(blocks):
    paths = block_paths(blocks)
    assert len(paths) >= 4 and len(paths) % 2 == 0
    runs = granularity.group_runs(blocks, 2)
    assert runs == {paths[i]: paths[i:i + 2] for i in range(0, len(paths), 2)}
    grouped = granularity.grouped(blocks, runs)
    first = grouped.unit(paths[0])
    assert first.group == tuple(paths[:2]) and first.blocks == 2
    assert first.param_shapes == blocks.unit(paths[0]).param_shapes * 2
    assert paths[1] not in grouped.paths and len(grouped.units) == len(blocks.units) - len(paths) // 2
    assert [p for p in grouped.forward_order if p.startswith("blocks.")] == paths[::2]
    assert granularity.grouped(grouped, runs) is grouped  # merged already
    expanded = granularity.expand_groups(Plan([UnitPlan(p) for p in grouped.paths]), grouped)
    assert expanded.groups() == runs


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("mode, checkpoint", [("zero3", False), ("zero2", True)])
def test_a_group_pays_the_per_unit_fixed_costs_once(blocks, k, mode, checkpoint):
    device = two_ranks()
    apart = predict(blocks, plan_of(blocks, 1, mode, checkpoint), device, calibration=CALIBRATION)
    together = predict(blocks, plan_of(blocks, k, mode, checkpoint), device, calibration=CALIBRATION)
    saved_units = len(block_paths(blocks)) - len(block_paths(blocks)) // k  # (k - 1) per group
    gathers = 2 if mode == "zero3" else 1
    per_unit = CALIBRATION.unit_overhead_s[mode] + gathers * ALPHA["all_gather"] + ALPHA["reduce_scatter"]
    assert apart.step_s - together.step_s == pytest.approx(saved_units * per_unit, rel=1e-9)
    a, t = apart.breakdown["totals"], together.breakdown["totals"]
    for same in ("compute_s", "optimizer_s", "persistent_bytes", "activation_bytes", "gradient_bytes"):
        assert a[same] == pytest.approx(t[same], rel=1e-12), same  # k blocks' work, only grouped
    # more gathered at once: the group's whole parameters in every phase
    assert together.peak_bytes > apart.peak_bytes
    unit = together.breakdown["units"][block_paths(blocks)[0]]
    one = apart.breakdown["units"][block_paths(blocks)[0]]
    assert unit["gather_output_bytes"] == k * one["gather_output_bytes"]


def test_the_ranks_meet_once_per_group():
    device = two_ranks()
    with torch.device("meta"):
        model = models.build("gpt2-mini")
    example = torch.zeros(BATCH, models.get_config("gpt2-mini").seq_len, dtype=torch.long, device="meta")
    d = describe_analytic(model, (example, example), device, batch_sizes=(BATCH,), granularity="block", progress=False)
    calibration = Calibration(meeting_wait_s_per_sqrt_s=1e-3)
    apart = predict(d, plan_of(d, 1), device, calibration=calibration).breakdown["units"]
    together = predict(d, plan_of(d, 2), device, calibration=calibration).breakdown["units"]
    first, second = block_paths(d)[:2]
    # one meeting for both blocks' forward (and backward): sqrt(2 t) instead of 2 sqrt(t)
    assert together[first]["meeting_wait_s"] == pytest.approx(
        math.sqrt(2) * apart[first]["meeting_wait_s"], rel=1e-9)
    assert together[first]["meeting_wait_s"] < apart[first]["meeting_wait_s"] + apart[second]["meeting_wait_s"]


def test_groups_the_description_cannot_have_are_refused_naming_the_units(blocks):
    paths = block_paths(blocks)
    with pytest.raises(PlanError, match=f"group '{paths[0]}' \\('{paths[0]}', '{paths[2]}'\\) is not of consecutive"):
        granularity.grouped(blocks, {paths[0]: [paths[0], paths[2]]})
    wider = dataclasses.replace(blocks.unit(paths[1]), param_shapes=((7, 7), *blocks.unit(paths[1]).param_shapes))
    other = dataclasses.replace(blocks, units=[wider if u.path == paths[1] else u for u in blocks.units])
    with pytest.raises(PlanError, match=f"group '{paths[0]}' \\('{paths[0]}', '{paths[1]}'\\) is not of identical"):
        granularity.grouped(other, {paths[0]: paths[:2]})
    with pytest.raises(PlanError, match="a group is of units that enclose no other"):
        granularity.grouped(blocks, {paths[-1]: [paths[-1], ROOT]})
    assert granularity.group_runs(other, 2) == {paths[2]: paths[2:4]}  # the search groups identical blocks only
