"""``osdp plan``: offline planning of a reference model for a device preset."""

import json

import pytest

from osdp import models
from osdp.plan import Plan
from osdp.plan_cli import main


def test_plan_cli_writes_a_loadable_plan_within_budget(tmp_path, capsys):
    out, png = tmp_path / "plan.json", tmp_path / "frontier.png"
    code = main(["--model", "gpt2-mini", "--world-size", "4", "--device", "a100-40gb-nvlink", "--device-mem", "64MiB",
                 "--batch-size", "2", "--json", str(out), "--frontier", str(png)])
    text = capsys.readouterr().out
    assert code == 0
    raw = json.loads(out.read_text())
    assert raw["search_seconds"] > 0
    plan = Plan.from_json(out.read_text())
    assert plan.world_size == 4 and plan.batch_size == 2
    assert plan.predicted_peak_bytes <= 64 * 2**20
    granularity = plan.meta["granularity"]
    per_layer = {"sub-block": ["attn", "mlp"], "block": [""]}[granularity]  # the search chose the unit size
    assert {u.path for u in plan.units} == {
        f"blocks.{i}" + (f".{part}" if part else "") for i in range(4) for part in per_layer
    } | {"wpe", ""}
    assert f"{granularity} units" in text and "tokens/s per rank" in text and "searched in" in text
    # a preset is planned offline: it says which calibration that assumes
    assert "calibration: ideal FSDP2 runtime (not measured" in text and plan.meta["calibration"].startswith("ideal")
    assert png.stat().st_size > 1000


def test_plan_cli_budget_below_minimum_names_the_minimum(capsys):
    assert main(["--model", "gpt2-mini", "--world-size", "4", "--device-mem", "1MiB", "--batch-size", "2"]) == 1
    err = capsys.readouterr().err
    assert "memory budget 1.00 MiB" in err and "the smallest plan needs a peak of" in err and "at micro-batch 2" in err


@pytest.mark.parametrize("flag, expected", [("--list-models", "gpt-48l-h1536"), ("--list-devices", "h100-nvlink")])
def test_plan_cli_lists_what_it_accepts(flag, expected, capsys):
    assert main([flag]) == 0
    out = capsys.readouterr().out
    assert expected in out
    if flag == "--list-models":
        assert out.split() == models.names()
