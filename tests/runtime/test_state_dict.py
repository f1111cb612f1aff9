"""State dicts round-trip whatever the plan: full (unsharded) and sharded (DCP), across plans, and
``model.state_dict()`` / ``load_state_dict`` across plans."""

import copy
import io

import torch
import torch.distributed.checkpoint as dcp
from dist_harness import run_ranks
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from toy_models import GPT
from training_check import full_state, train

import osdp
from osdp.schema.plan import Plan, UnitPlan

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _build(seed):
    torch.manual_seed(seed)
    return GPT()


def _plans(paths):
    mixed = Plan([UnitPlan(p, ("replicate", "zero2", "zero3")[i % 3], checkpoint=i % 2 == 0) for i, p in enumerate(paths)])
    return [Plan.for_strategy(paths, "ddp"), Plan.for_strategy(paths, "fsdp"), mixed]


def _round_trips(rank, world_size, checkpoint_dir):
    paths = [u.path for u in osdp.discover_units(_build(0))]
    plans = _plans(paths)
    batch = [(torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(3)),) * 2]
    probe = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(4))
    checks = []
    for i, save_plan in enumerate(plans):
        source = osdp.wrap(_build(0), plan=save_plan)
        train(source, batch, rank, world_size)  # state differs from any fresh init
        expected = full_state(source)
        expected_out = source(probe).detach()
        dcp.save(get_model_state_dict(source), checkpoint_id=f"{checkpoint_dir}/{i}")
        for load_plan in plans:
            # full state dict, loaded into a differently initialised model under another plan
            target = osdp.wrap(_build(1), plan=load_plan)
            set_model_state_dict(target, full_state(source), options=StateDictOptions(full_state_dict=True))
            full_err = max((full_state(target)[k] - v).abs().max().item() for k, v in expected.items())
            # sharded state dict through DCP
            target2 = osdp.wrap(_build(2), plan=load_plan)
            sharded = get_model_state_dict(target2)
            dcp.load(sharded, checkpoint_id=f"{checkpoint_dir}/{i}")
            set_model_state_dict(target2, sharded)
            dcp_err = max((full_state(target2)[k] - v).abs().max().item() for k, v in expected.items())
            out_err = (target2(probe).detach() - expected_out).abs().max().item()
            checks.append((save_plan.hash, load_plan.hash, full_err, dcp_err, out_err))
    return checks


def test_state_dicts_round_trip_across_plans(tmp_path):
    results = run_ranks(_round_trips, 2, str(tmp_path), timeout=180)
    for rank_checks in results:
        for saved, loaded, full_err, dcp_err, out_err in rank_checks:
            assert full_err == 0.0, f"full state dict {saved}->{loaded} differs by {full_err}"
            assert dcp_err == 0.0, f"DCP {saved}->{loaded} differs by {dcp_err}"
            assert out_err <= 1e-6, f"outputs after DCP load {saved}->{loaded} differ by {out_err}"


def test_full_state_dict_of_wrapped_model_loads_into_plain_model(tmp_path):
    results = run_ranks(_export, 2, timeout=120)
    state, probe, out = results[0]
    plain = _build(5)
    plain.load_state_dict(state)
    assert torch.allclose(plain(probe), out, atol=1e-6)


def _export(rank, world_size):
    model = osdp.wrap(_build(0), strategy="fsdp")
    probe = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(4))
    return full_state(model), probe, model(probe).detach()


def _kept_and_reloaded(state):
    """As a training script keeps its best state and saves it: a deep copy, ``torch.save``, ``torch.load`` (which
    takes only the tensor types it knows, DTensor among them)."""
    buffer = io.BytesIO()
    torch.save(copy.deepcopy(state), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _state_dicts_across_plans(rank, world_size, plans_json):
    from cases import build_toy, toy_batches

    trained = {}
    for name, plan_json in plans_json.items():  # each plan trains two steps from the same start
        model = build_toy()
        osdp.wrap(model, plan=plan_json)
        train(model, toy_batches()[:2], rank, world_size)
        trained[name] = (_kept_and_reloaded(model.state_dict()), full_state(model))
        for (key, param), copied in zip(model.named_parameters(), copy.deepcopy(list(model.parameters()))):
            assert torch.equal(copied.to_local(), param.to_local()) and copied.requires_grad, key
    unwrapped = build_toy()
    train(unwrapped, [tuple(t[:2] for t in b) for b in toy_batches()[:1]])  # another state, plain and full
    trained["unwrapped"] = (unwrapped.state_dict(), {k: v.clone() for k, v in unwrapped.state_dict().items()})
    out = {}
    for target, plan_json in plans_json.items():
        for source, (state, expected) in trained.items():
            model = build_toy()
            osdp.wrap(model, plan=plan_json)
            model.load_state_dict(state)
            got = full_state(model)  # collective: every rank takes part
            out[(source, target)] = max((got[k] - expected[k]).abs().max().item() for k in expected)
    return out


def test_a_state_dict_saved_under_any_plan_loads_with_load_state_dict_under_any_other():
    """``model.state_dict()`` keeps each parameter as its plan does (plain, sharded DTensors, split weights), and the
    plan follows a budget the user may change between runs: ``load_state_dict`` takes any plan's, and the
    unwrapped model's full one, as FSDP2's own models take only their own layout's."""
    from cases import build_toy, every_mode_plans

    plans = every_mode_plans(build_toy())
    chosen = {name: plans[name].to_json() for name in ("ddp", "fsdp", "mixed_a", "split")}
    for differences in run_ranks(_state_dicts_across_plans, 2, chosen, timeout=300):
        assert set(differences) == {(s, t) for s in [*chosen, "unwrapped"] for t in chosen}
        assert max(differences.values()) == 0.0, {k: v for k, v in differences.items() if v}


def _adam(model):
    # an eps well above the gradients' rounding: AdamW's update of a gradient near eps amplifies the order in which
    # ranks sum it (3e-3 at eps=1e-8 after four steps), which is not what this test compares
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-3)


def _resumed_under_another_plan(rank, world_size, pairs):
    """Per (saving plan, resuming plan): two AdamW steps, each rank saving its own ``model.state_dict()`` and
    ``optimizer.state_dict()`` as training scripts do; a fresh model under the other plan loads both and steps
    twice more. Losses and the full state at the end."""
    from cases import build_toy, toy_batches

    out = []
    for save_plan, resume_plan in pairs:
        model = osdp.wrap(build_toy(), plan=save_plan)
        optimizer = _adam(model)
        losses = train(model, toy_batches()[:2], rank, world_size, optimizer=optimizer)
        saved = _kept_and_reloaded({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
        model = osdp.wrap(build_toy(), plan=resume_plan)
        model.load_state_dict(saved["model"])
        optimizer = _adam(model)
        optimizer.load_state_dict(saved["optimizer"])
        losses += train(model, toy_batches()[2:] + toy_batches()[:1], rank, world_size, optimizer=optimizer)
        state = full_state(model)  # collective: every rank takes part
        out.append((losses, state if rank == 0 else None))
    return out


def test_optimizer_state_saved_by_each_rank_resumes_under_another_plan_as_one_process():
    """The plan follows a budget (and a measurement) that may differ when a job resumes: an optimizer's state laid
    out by one plan (a replicated parameter's moments full and plain, a sharded one's shards) failed in the first
    step under another (DTensor's mixed-tensor error, a bare AssertionError). Each state tensor is laid out as its
    parameter is before the first step after ``load_state_dict``."""
    from cases import build_toy, every_mode_plans, toy_batches
    from training_check import assert_matches_reference, cloned

    plans = every_mode_plans(build_toy())
    names = [("ddp", "split"), ("split", "mixed_a"), ("mixed_a", "fsdp")]
    reference = build_toy()
    optimizer = _adam(reference)
    losses = train(reference, toy_batches()[:2], optimizer=optimizer)
    losses += train(reference, toy_batches()[2:] + toy_batches()[:1], optimizer=optimizer)
    out = run_ranks(_resumed_under_another_plan, 2, [(plans[a].to_json(), plans[b].to_json()) for a, b in names],
                    timeout=300)
    assert_matches_reference(out, (losses, cloned(reference.state_dict())), [f"{a} then {b}" for a, b in names])
