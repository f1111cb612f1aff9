"""osdp.runtime.dcp: model and optimizer state saved under one plan and world size, resumed under another,
trains on exactly as an uninterrupted run; atomic writes; a full export for use without osdp."""

import json

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from toy_models import GPT
from training_check import full_state, train

import osdp
from osdp.runtime import dcp as checkpoint
from osdp.runtime.dcp import CheckpointError
from osdp.schema.plan import Plan, UnitPlan

GLOBAL_BATCH = 8  # divisible by 1, 2 and 4 ranks
OPTIMIZERS = ("sgd", "adamw")


def _build(seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(**kw)


def _optimizer(name, model):
    if name == "sgd":  # momentum: the optimizer state matters
        return torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _batches():
    g = torch.Generator().manual_seed(11)
    return [(torch.randint(0, 64, (GLOBAL_BATCH, 16), generator=g), torch.randint(0, 64, (GLOBAL_BATCH, 16), generator=g))
            for _ in range(4)]


def _paths():
    return [u.path for u in osdp.discover_units(_build())]


def plan_a():  # saves: every mode, checkpointing on every other unit
    return Plan([UnitPlan(p, ("replicate", "zero2", "zero3")[i % 3], checkpoint=i % 2 == 0)
                 for i, p in enumerate(_paths())])


def plan_b():  # loads on 2 ranks: MLPs split in 2 and checkpointed, attention replicated
    def unit(p):
        if p.endswith("mlp"):
            return UnitPlan(p, "zero3", split=2, checkpoint=True)
        if p.endswith("attn"):
            return UnitPlan(p, "replicate")
        return UnitPlan(p, "zero2" if p else "zero3")
    return Plan([unit(p) for p in _paths()])


def plan_c():  # loads on 4 ranks: MLPs split in 4, attention checkpointed, root zero2
    def unit(p):
        if p.endswith("mlp"):
            return UnitPlan(p, "zero3", split=4)
        if p.endswith("attn"):
            return UnitPlan(p, "zero3", checkpoint=True)
        return UnitPlan(p, "replicate" if p else "zero2")
    return Plan([unit(p) for p in _paths()])


def _error(fn):
    try:
        fn()
    except CheckpointError as e:
        return str(e)
    return None


def _save_then_resume_on_2(rank, world_size, directory):
    batches = _batches()
    out = {}
    for name in OPTIMIZERS:
        model = osdp.wrap(_build(0), plan=plan_a())
        opt = _optimizer(name, model)
        train(model, batches[:2], rank, world_size, optimizer=opt)
        checkpoint.save_step(f"{directory}/{name}", 2, model, opt, extra={"note": name})

        resumed = osdp.wrap(_build(1), plan=plan_b())  # another init: everything must come from the checkpoint
        opt = _optimizer(name, resumed)
        found = checkpoint.agree_on_latest(f"{directory}/{name}")
        extra = checkpoint.load(found, resumed, opt)
        losses = train(resumed, batches[2:], rank, world_size, optimizer=opt)
        state = full_state(resumed)
        out[name] = {"losses": losses, "state": state if rank == 0 else None, "extra": extra, "found": str(found)}

    # Adam, tightly: resumed under the saving plan, it is bit for bit the uninterrupted run under that plan.
    uninterrupted = osdp.wrap(_build(0), plan=plan_a())
    opt = _optimizer("adamw", uninterrupted)
    train(uninterrupted, batches, rank, world_size, optimizer=opt)
    same_plan = osdp.wrap(_build(1), plan=plan_a())
    opt = _optimizer("adamw", same_plan)
    checkpoint.load(f"{directory}/adamw/step_00000002", same_plan, opt)
    train(same_plan, batches[2:], rank, world_size, optimizer=opt)
    a, b = full_state(uninterrupted), full_state(same_plan)
    out["adamw_same_plan_err"] = max((a[k] - b[k]).abs().max().item() for k in a)

    # Without the optimizer state (momentum lost) the same steps end elsewhere: the check above is sensitive to it.
    model_only = osdp.wrap(_build(1), plan=plan_b())
    checkpoint.load(f"{directory}/sgd/step_00000002", model_only)
    opt = _optimizer("sgd", model_only)
    train(model_only, batches[2:], rank, world_size, optimizer=opt)
    state = full_state(model_only)
    out["sgd_model_only"] = state if rank == 0 else None

    # The full export of a split model with tied weights loads into the plain model.
    probe = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))
    split_model = osdp.wrap(_build(2), plan=plan_b())
    checkpoint.load(f"{directory}/adamw/step_00000002", split_model)
    written = checkpoint.export_full(f"{directory}/full.pt", split_model)
    out["export"] = (str(written) if written else None, split_model(probe).detach(), probe)

    # Loads that cannot work fail on every rank, before anything is read.
    target = osdp.wrap(_build(3), plan=plan_b())
    out["errors"] = {
        "wrong_optimizer": _error(lambda: checkpoint.load(f"{directory}/sgd/step_00000002", target,
                                                          _optimizer("adamw", target))),
        "wrong_model": _error(lambda: checkpoint.load(f"{directory}/sgd/step_00000002",
                                                      osdp.wrap(_build(0, h=48), strategy="fsdp"))),
        "not_a_checkpoint": _error(lambda: checkpoint.load(f"{directory}/sgd", target)),
        "missing": _error(lambda: checkpoint.load(f"{directory}/nowhere", target)),
    }
    return out


def _resume_on_4(rank, world_size, directory):
    batches = _batches()
    out = {}
    for name in OPTIMIZERS:
        model = osdp.wrap(_build(1), plan=plan_c())
        opt = _optimizer(name, model)
        checkpoint.load(checkpoint.latest(f"{directory}/{name}"), model, opt)
        losses = train(model, batches[2:], rank, world_size, optimizer=opt)
        state = full_state(model)
        out[name] = {"losses": losses, "state": state if rank == 0 else None}
    return out


def _reference(name, steps=4):
    model = _build(0)
    opt = _optimizer(name, model)
    losses = train(model, _batches()[:steps], 0, 1, optimizer=opt)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("checkpoints")
    return directory, run_ranks(_save_then_resume_on_2, 2, str(directory), timeout=240)


def _assert_resumed_like_uninterrupted(per_rank, name, loss_tol, param_tol):
    ref_losses, ref_state = _reference(name)
    world_size = len(per_rank)
    losses = [sum(r[name]["losses"][i] for r in per_rank) / world_size for i in range(2)]
    loss_err = max(abs(a - b) for a, b in zip(losses, ref_losses[2:]))
    assert loss_err <= loss_tol, f"{name} on {world_size} ranks: losses after resuming differ by {loss_err:.2e}"
    state = per_rank[0][name]["state"]
    assert set(state) == set(ref_state)
    param_err = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
    assert param_err <= param_tol, f"{name} on {world_size} ranks: parameters differ by {param_err:.2e}"


def test_resume_under_another_plan_on_2_ranks_matches_uninterrupted_training(saved):
    directory, per_rank = saved
    _assert_resumed_like_uninterrupted(per_rank, "sgd", 1e-5, 1e-5)
    # Adam divides by sqrt(v): parameters whose gradient is nearly zero (here the attention key biases,
    # to which softmax is blind) move by up to lr in a direction set by rounding noise, even without a
    # checkpoint (2-rank training alone differs from one process by ~2e-3 there). Compare losses and
    # parameters loosely against one process, and bit for bit against the uninterrupted run of the same plan.
    _assert_resumed_like_uninterrupted(per_rank, "adamw", 1e-4, 2e-2)
    assert all(r["adamw_same_plan_err"] == 0.0 for r in per_rank)
    for r in per_rank:
        assert r["sgd"]["extra"] == {"note": "sgd", "step": 2}
        assert r["sgd"]["found"].endswith("sgd/step_00000002")
    record = checkpoint.info(directory / "sgd" / "step_00000002")
    assert record["step"] == 2 and record["world_size"] == 2 and record["plan_hash"] == plan_a().hash
    assert record["optimizer"] == "SGD" and record["plan"]["units"]
    # the momentum buffers mattered: without them the same two steps end far off
    _, ref_state = _reference("sgd")
    drift = max((per_rank[0]["sgd_model_only"][k] - ref_state[k]).abs().max().item() for k in ref_state)
    assert drift > 1e-3


def test_resume_on_4_ranks_matches_uninterrupted_training(saved):
    directory, _ = saved
    per_rank = run_ranks(_resume_on_4, 4, str(directory), timeout=240)
    _assert_resumed_like_uninterrupted(per_rank, "sgd", 1e-5, 1e-5)
    _assert_resumed_like_uninterrupted(per_rank, "adamw", 1e-4, 2e-2)


def test_full_export_of_a_split_model_with_tied_weights_loads_into_the_plain_model(saved):
    directory, per_rank = saved
    path, out, probe = per_rank[0]["export"]
    assert path == str(directory / "full.pt") and per_rank[1]["export"][0] is None
    state = torch.load(path, weights_only=True)
    assert all(not type(v).__name__ == "DTensor" for v in state.values())
    plain = _build(7)
    plain.load_state_dict(state)  # strict: every key of the unwrapped model, no more
    assert plain.head.weight is plain.wte.weight
    assert torch.allclose(plain(probe), out, atol=1e-5)
    assert not list(directory.glob(".full.pt*"))  # no temporary left behind


def test_loads_that_cannot_work_fail_on_every_rank_with_a_clear_message(saved):
    directory, per_rank = saved
    ckpt = directory / "sgd" / "step_00000002"
    for r in per_rank:
        e = r["errors"]
        assert e["wrong_optimizer"] == f"{ckpt} holds SGD state, but the optimizer given is AdamW"
        assert e["wrong_model"].startswith(f"{ckpt} was saved from a different model; different shapes: ")
        assert "blocks.0.attn.proj.bias (saved [32], model [48])" in e["wrong_model"]
        assert e["not_a_checkpoint"] == (
            f"{directory / 'sgd'} is not a complete osdp checkpoint (no osdp_checkpoint.json: it was never "
            f"finished, or it is not an osdp checkpoint); the newest complete checkpoint under it is {ckpt}"
        )
        assert e["missing"] == f"no checkpoint at {directory / 'nowhere'}: no such directory"


def test_interrupted_writes_are_never_taken_as_latest(tmp_path, monkeypatch):
    """One process (world size 1): a save cut short leaves no complete checkpoint behind."""
    model = osdp.wrap(_build(0), strategy="zero2")
    try:
        opt = _optimizer("sgd", model)
        batches = _batches()
        train(model, batches[:1], 0, 1, optimizer=opt)
        checkpoint.save_step(tmp_path, 1, model, opt)
        train(model, batches[1:2], 0, 1, optimizer=opt)
        checkpoint.save_step(tmp_path, 2, model, opt)
        assert checkpoint.latest(tmp_path) == tmp_path / "step_00000002"

        def disk_full(*args):
            raise OSError(28, "No space left on device")

        with monkeypatch.context() as m:  # every rank has written its shards; the marker never lands
            m.setattr(checkpoint, "_write_marker", disk_full)
            with pytest.raises(CheckpointError, match="cannot complete the checkpoint .*step_00000003: .*No space"):
                checkpoint.save_step(tmp_path, 3, model, opt)
        assert (tmp_path / ".step_00000003.partial" / ".metadata").exists()
        assert not (tmp_path / "step_00000003").exists()
        # a directory that looks like a checkpoint but never got its marker (say, copied half-way)
        (tmp_path / "step_00000009").mkdir()
        (tmp_path / "step_00000009" / ".metadata").write_bytes(b"")
        (tmp_path / "step_00000004").mkdir()
        (tmp_path / "step_00000004" / checkpoint.MARKER).write_text("{truncated")
        assert checkpoint.latest(tmp_path) == tmp_path / "step_00000002"
        with pytest.raises(CheckpointError, match="is not a complete osdp checkpoint"):
            checkpoint.load(tmp_path / "step_00000009", model)
        with pytest.raises(CheckpointError, match="unreadable completion marker"):
            checkpoint.info(tmp_path / "step_00000004")

        # the next save of that step clears the partial directory; old checkpoints are pruned on request
        checkpoint.save_step(tmp_path, 3, model, opt, keep=2)
        assert not (tmp_path / ".step_00000003.partial").exists()
        assert checkpoint.latest(tmp_path) == tmp_path / "step_00000003"
        assert checkpoint.complete_checkpoints(tmp_path) == [tmp_path / "step_00000002", tmp_path / "step_00000003"]
        record = json.loads((tmp_path / "step_00000003" / checkpoint.MARKER).read_text())
        assert record["step"] == 3 and record["world_size"] == 1 and record["plan_hash"] == osdp.plan_of(model).hash
        # saving again to the same path replaces it only once the new one is complete
        checkpoint.save(tmp_path / "step_00000003", model, opt, step=3, extra={"again": True})
        assert checkpoint.info(tmp_path / "step_00000003")["extra"] == {"again": True}

        with pytest.raises(CheckpointError, match="extra must be JSON-serialisable"):
            checkpoint.save(tmp_path / "x", model, extra={"tensor": torch.zeros(1)})

        # world size 1 resumes like it trains
        resumed = osdp.wrap(_build(1), strategy="fsdp")
        opt2 = _optimizer("sgd", resumed)
        assert checkpoint.load(tmp_path / "step_00000002", resumed, opt2) == {"step": 2}
        ref_losses, ref_state = _reference("sgd", steps=3)
        assert train(resumed, batches[2:3], 0, 1, optimizer=opt2) == pytest.approx(ref_losses[2:], abs=1e-6)
        state = resumed.state_dict()
        assert max((state[k].full_tensor() - ref_state[k]).abs().max().item() for k in ref_state) <= 1e-6
    finally:
        dist.destroy_process_group()
