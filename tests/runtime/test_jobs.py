"""run_jobs keeps at most ``at_once`` models alive and measures every job as it would all at once."""

import gc
import weakref

import pytest
import torch
from dist_harness import run_ranks

from osdp.cli.validate import build_parser
from osdp.runtime.jobs import run_jobs


def _three_jobs(rank, world_size):
    from osdp import models, strategy_plan
    from osdp.models.data import synthetic_batch
    from osdp.runtime.jobs import Job, run_jobs

    alive, most = weakref.WeakSet(), [0]

    def build():
        torch.manual_seed(0)
        model = models.build("gpt2-tiny", seq_len=32)
        gc.collect()
        alive.add(model)
        most[0] = max(most[0], len(alive))
        return model

    config = models.get_config("gpt2-tiny", seq_len=32)
    batch = synthetic_batch(config, 4, generator=torch.Generator().manual_seed(rank))
    plans = {s: strategy_plan(build(), s) for s in ("ddp", "zero2", "fsdp")}
    gc.collect()
    out = {}
    for at_once, passes in ((None, 1), (2, 2)):
        most[0] = 0
        jobs = {s: Job(build, p, batch) for s, p in plans.items()}
        measured = run_jobs(jobs, device=torch.device("cpu"), time_budget_s=0.0, warmup=1, min_steps=2,
                            at_once=at_once, passes=passes)
        out[at_once] = {"most_alive": most[0], "peaks": {s: r["measured_peak_bytes"] for s, r in measured.items()},
                        "steps": {s: r["steps"] for s, r in measured.items()},
                        "each": {s: len(r["step_s_each"]) for s, r in measured.items()}}
    return out


def test_run_jobs_keeps_at_most_at_once_models_alive_and_pools_its_passes():
    out = run_ranks(_three_jobs, 2, timeout=240)[0]
    assert out[None]["most_alive"] == 3
    assert out[2]["most_alive"] == 2
    # every job measured in both, the same peak (CPU: live tensor bytes, deterministic)
    assert out[2]["peaks"] == out[None]["peaks"]
    assert list(out[2]["peaks"]) == ["ddp", "zero2", "fsdp"]
    assert out[None]["steps"] == {s: 2 for s in ("ddp", "zero2", "fsdp")}
    # two passes of two steps each, pooled
    assert out[2]["steps"] == out[2]["each"] == {s: 4 for s in ("ddp", "zero2", "fsdp")}


def test_at_once_below_one_is_refused_with_what_would_work():
    with pytest.raises(ValueError, match="at least one model"):
        run_jobs({}, device=torch.device("cpu"), at_once=0)
    with pytest.raises(ValueError, match="at least once"):
        run_jobs({}, device=torch.device("cpu"), passes=0)
    assert run_jobs({}, device=torch.device("cpu")) == {}  # no jobs: nothing measured, nothing collective


def test_validate_refuses_an_at_once_that_is_not_a_positive_count(capsys):
    assert build_parser().parse_args(["--at-once", "1"]).at_once == 1
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--at-once", "0"])
    assert "not a whole number >= 1" in capsys.readouterr().err
