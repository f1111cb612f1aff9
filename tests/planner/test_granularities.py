"""The model is described once per unit granularity that gives units of its own: a granularity whose units a
finer one already gave is not measured again (a small CNN's blocks are its units at 'block' and 'nested')."""

import dataclasses

import model_styles as styles
import torch

import osdp.describe.analytic as analytic
import osdp.describe.measured as measured
from osdp.describe.batch import call_model
from osdp.describe.units import GRANULARITIES, discover_units, trace_calls
from osdp.planner import describe_granularities, planning_descriptions


def _example():
    return styles.inputs_of("cnn", styles.STYLES["cnn"][1](4, torch.Generator().manual_seed(0)))


def _loss(out):
    logits, aux = out
    return logits.square().mean() + aux.square().mean()


def _distinct_unit_sets(model, example):
    calls = trace_calls(model, lambda: call_model(model, example))
    sets = []
    for granularity in GRANULARITIES:
        paths = frozenset(u.path for u in discover_units(model, calls, granularity))
        if paths not in sets:
            sets.append(paths)
    return sets


def _counting(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_a_granularity_with_the_units_of_a_finer_one_is_not_measured_again(monkeypatch):
    model, example = styles.build("cnn"), _example()
    expected = _distinct_unit_sets(model, example)
    assert 1 < len(expected) < len(GRANULARITIES)  # the case this checks: a granularity adds nothing
    measuring = _counting(monkeypatch, measured, "_measure_precision")
    descriptions = planning_descriptions(model, example, loss_fn=_loss)
    assert [frozenset(d.paths) for d in descriptions] == expected
    assert len(measuring) == len(expected)
    assert [d.granularity for d in descriptions] == list(GRANULARITIES[:len(expected)])


def test_the_analytic_descriptions_are_those_described_one_by_one(monkeypatch):
    """Against the brute force: every granularity described, those with a finer one's units dropped."""
    model, example = styles.build("cnn"), _example()
    settings = dict(device="cpu-loopback", world_size=2, loss_fn=_loss, progress=False, cache=False)
    one_by_one = []
    for granularity in GRANULARITIES:
        d = analytic.describe_analytic(model, example, granularity=granularity, **settings)
        if all(d.paths != kept.paths for kept in one_by_one):
            one_by_one.append(d)
    tracing = _counting(monkeypatch, analytic, "_costs_at")
    skipping = describe_granularities(lambda **g: analytic.describe_analytic(model, example, **settings, **g))
    assert len(tracing) == len(skipping) == len(one_by_one) < len(GRANULARITIES)
    plain = lambda d: dataclasses.replace(d, profile_seconds=0.0)  # noqa: E731
    assert [plain(d) for d in skipping] == [plain(d) for d in one_by_one]
