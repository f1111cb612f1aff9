"""The training entry point launches its own ranks and trains exactly like one process would."""

import json
import os
import subprocess
import sys

import torch

from osdp import models
from osdp.models.data import CorpusLoader


def test_osdp_train_launches_ranks_and_matches_single_process(tmp_path):
    out = tmp_path / "run.json"
    cmd = [sys.executable, "-m", "osdp.cli.train", "--model", "gpt2-tiny", "--strategy", "zero2", "--steps", "4",
           "--warmup", "1", "--batch-size", "2", "--seq-len", "32", "--lr", "1e-2", "--nproc", "2", "--json", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "blocks.0.mlp" in proc.stdout and "zero2" in proc.stdout  # the plan table
    assert "tokens/s" in proc.stdout and "peak memory" in proc.stdout

    record = json.loads(out.read_text())
    assert record["world_size"] == 2 and [r["rank"] for r in record["per_rank"]] == [0, 1]
    for r in record["per_rank"]:
        assert r["peak_bytes"] > models.num_params("gpt2-tiny") * 4 / 2  # at least this rank's parameter shard
        assert r["tokens_per_s"] > 0

    # One process on the global batch, same seed and optimizer, gives the same losses.
    torch.manual_seed(0)
    model = models.build("gpt2-tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = CorpusLoader(32, 2, rank=0, world_size=2, seed=0)
    for step in range(4):
        inputs, targets = loader.global_batch(step)
        loss = model(inputs, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ranks = [r["losses"][step] for r in record["per_rank"]]
        assert abs(sum(ranks) / 2 - loss.item()) < 1e-4, (step, ranks, loss.item())


def test_the_readme_default_run_searches_trains_and_reports_its_prediction(tmp_path):
    """`osdp train` as the README's first command runs it (fewer steps): a budget search, training, and the end
    line that sets the prediction against the measured median and its spread."""
    cmd = [sys.executable, "-m", "osdp.cli.train", "--steps", "6", "--warmup", "2"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next((x for x in proc.stdout.splitlines() if x.startswith("step time: measured")), None)
    assert line is not None and "predicted" in line and "middle half" in line, proc.stdout[-2000:]
    assert "this run's spread" in line, line
