"""Recovery: a rank killed mid-run under torchrun resumes from the last checkpoint and ends where an
uninterrupted run ends; a dead, failing or stalled peer gives a clear error within the collective
timeout on the other ranks, never a hang."""

import datetime
import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from toy_models import GPT

import osdp
from osdp.distributed import PeerFailure, as_peer_failure, free_port, peer_failures

TRAIN = [sys.executable, "-m", "osdp.cli.train", "--model", "gpt2-tiny", "--strategy", "zero2", "--steps", "6",
         "--warmup", "1", "--batch-size", "2", "--seq-len", "32", "--log-every", "1"]


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OSDP_TEST_KILL_AT_STEP")}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def test_killed_rank_restarts_under_torchrun_and_ends_like_an_uninterrupted_run(tmp_path):
    uninterrupted = subprocess.run([*TRAIN, "--nproc", "2", "--save-final", str(tmp_path / "uninterrupted.pt")],
                                   capture_output=True, text=True, timeout=120, env=_env())
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]

    ckpt = tmp_path / "ckpt"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                "--max-restarts=1", "--monitor-interval=0.5", "-m", "osdp.cli.train"]
    killed = subprocess.run([*torchrun, *TRAIN[3:], "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
                             "--save-final", str(tmp_path / "resumed.pt")],
                            capture_output=True, text=True, timeout=180,
                            # a fresh store for the restarted attempt (PyTorch issue 135712; see osdp.distributed)
                            env=_env(OSDP_TEST_KILL_AT_STEP="5", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert (ckpt / ".osdp_test_killed").read_text().startswith("rank 1 killed itself at step 5")
    assert "[OSDP_TEST_KILL_AT_STEP] rank 1: SIGKILL at step 5" in killed.stdout
    assert "exitcode: -9" in killed.stderr  # torchrun saw the kill, and restarted the job
    assert "shares its store" not in killed.stdout
    assert f"resumed from {ckpt / 'step_00000004'} at step 4" in killed.stdout
    assert "step    4" in killed.stdout.split("resumed from")[1]  # steps 4 and 5 ran again after the restart
    assert sorted(p.name for p in ckpt.iterdir()) == [".osdp_test_killed", "step_00000004", "step_00000006"]

    expected = torch.load(tmp_path / "uninterrupted.pt", weights_only=True)
    got = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert set(got) == set(expected)
    differ = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert not differ, f"parameters differ from the uninterrupted run: {differ}"


def test_osdp_train_max_restarts_runs_torchrun_with_a_fresh_store_per_attempt(monkeypatch, capsys):
    import osdp.distributed.group as distributed

    calls = []
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    monkeypatch.setattr(distributed.subprocess, "call", lambda cmd, env: calls.append((cmd, env)) or 0)
    assert distributed.launch_local(2, "osdp.cli.train", ["--steps", "3", "--max-restarts", "2", "--nproc", "2"], 2) == 0
    cmd, env = calls[0]
    assert cmd[cmd.index("torch.distributed.run"):cmd.index("-m", 3)] == [
        "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=2", "--monitor-interval=0.5"]
    assert cmd[-2:] == ["--steps", "3"] and env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"

    for key, value in dict(TORCHELASTIC_MAX_RESTARTS="1", TORCHELASTIC_USE_AGENT_STORE="True").items():
        monkeypatch.setenv(key, value)
    distributed.warn_shared_store(0)
    assert "run torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in capsys.readouterr().out
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    distributed.warn_shared_store(0)
    assert capsys.readouterr().out == ""


def test_train_passes_the_collective_timeout_to_its_process_group(monkeypatch):
    from osdp.distributed import init_from_env

    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(free_port()), OSDP_COLLECTIVE_TIMEOUT_S="7").items():
        monkeypatch.setenv(key, value)
    init_from_env("cpu")
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        assert backend.options._timeout == datetime.timedelta(seconds=7)
    finally:
        dist.destroy_process_group()


def test_backend_errors_caused_by_a_peer_become_peer_failures():
    closed = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242. This is "
                          "typically caused by a remote worker crashing.")
    failure = as_peer_failure(closed, "training step 3")
    assert isinstance(failure, PeerFailure)
    assert str(failure).startswith("rank 0 of 1: training step 3: a collective lost its connection to another rank. "
                                   "Another rank has probably died or raised an error")
    assert "OSDP_COLLECTIVE_TIMEOUT_S" in str(failure) and "Backend: [../gloo/transport/tcp/pair.cc:553]" in str(failure)
    timeout = RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 10000ms for recv operation")
    assert "a collective timed out" in str(as_peer_failure(timeout, "x"))
    assert as_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), "x") is None
    assert as_peer_failure(ValueError("Connection closed by peer"), "x") is None
    with pytest.raises(PeerFailure) as e, peer_failures("saving"):
        raise closed
    assert e.value.__cause__ is closed


# -- a peer that stalls, raises or dies --------------------------------------------------------

TIMEOUT_S = 10.0  # collective timeout for these tests (the harness's is 60 s)


def _regroup(rank, world_size, port):
    """A fresh default group with a short collective timeout (the store waits longer for late ranks)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))


def _train_until_rank_1_fails(rank, world_size, port, how, out):
    _regroup(rank, world_size, port)
    torch.manual_seed(0)
    model = osdp.wrap(GPT(), strategy="fsdp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
    start = time.monotonic()
    try:
        for step in range(5):
            if step == 2 and rank == 1:
                if how == "stall":  # alive, but never reaches the next collective in time
                    time.sleep(TIMEOUT_S + 3)
                    return None
                if how == "raise":
                    raise RuntimeError("injected failure on rank 1")
                os.kill(os.getpid(), 9)  # "kill": SIGKILL, no goodbye
            start = time.monotonic()
            with peer_failures(f"training step {step}"):
                loss = model(x, x)
                loss.backward()
                opt.step()
                opt.zero_grad()
    except PeerFailure as e:
        observed = {"error": str(e), "seconds": time.monotonic() - start}
        with open(f"{out}/{how}.json", "w") as f:
            json.dump(observed, f)
        return observed
    return {"error": None}


def _stall_then_raise(rank, world_size, ports, out):
    stalled = _train_until_rank_1_fails(rank, world_size, ports[0], "stall", out)
    raised = _train_until_rank_1_fails(rank, world_size, ports[1], "raise", out)  # rank 1's error ends its process
    return stalled, raised


def _kill(rank, world_size, port, out):
    return _train_until_rank_1_fails(rank, world_size, port, "kill", out)


def test_a_stalled_failing_or_dead_peer_gives_a_clear_error_within_the_timeout(tmp_path):
    with pytest.raises(AssertionError) as failed:
        run_ranks(_stall_then_raise, 2, [free_port(), free_port()], str(tmp_path), timeout=120)
    assert "rank(s) [1] failed" in str(failed.value) and "injected failure on rank 1" in str(failed.value)
    with pytest.raises(AssertionError) as died:
        run_ranks(_kill, 2, free_port(), str(tmp_path), timeout=60)
    assert "rank 1 died with exit code -9" in str(died.value)

    stalled = json.loads((tmp_path / "stall.json").read_text())
    assert stalled["error"].startswith("rank 0 of 2: training step 2: a collective timed out. Another rank has "
                                       "probably died or raised an error")
    assert "Timed out waiting 10000ms" in stalled["error"]
    assert TIMEOUT_S - 1 <= stalled["seconds"] <= TIMEOUT_S + 10
    for how in ("raise", "kill"):  # the peer's process is gone: its sockets close at once
        observed = json.loads((tmp_path / f"{how}.json").read_text())
        assert observed["error"].startswith("rank 0 of 2: training step 2: a collective lost its connection to "
                                            "another rank. Another rank has probably died or raised an error"), observed
        assert "Connection closed by peer" in observed["error"] or "Connection reset by peer" in observed["error"]
        assert observed["seconds"] < TIMEOUT_S, observed  # not a timeout: told as soon as the peer was gone
