"""The Plan as data: JSON round trip, hash, and clear errors for plans that cannot be right."""

import json

import pytest

from osdp.schema.plan import Plan, PlanError, UnitPlan


def sample_plan():
    return Plan(
        [UnitPlan("blocks.0.attn", "replicate", checkpoint=True), UnitPlan("blocks.0.mlp", "zero3", split=4), UnitPlan("", "zero2")],
        batch_size=8,
        mixed_precision="bf16",
        world_size=2,
        predicted_step_s=0.5,
        predicted_peak_bytes=123,
    )


def test_json_round_trip_keeps_everything_and_the_hash():
    plan = sample_plan()
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.hash == plan.hash
    assert json.loads(plan.to_json())["schema_version"] == 4  # written in the newest schema


def test_hash_covers_decisions_not_predictions_or_unit_order():
    plan = sample_plan()
    reordered = Plan(list(reversed(plan.units)), batch_size=8, mixed_precision="bf16", world_size=2)
    assert reordered.hash == plan.hash
    other = Plan([UnitPlan("blocks.0.attn", "zero3"), *plan.units[1:]], batch_size=8, mixed_precision="bf16", world_size=2)
    assert other.hash != plan.hash


@pytest.mark.parametrize(
    "unit, message",
    [
        (dict(path="mlp", mode="zero4"), "unit 'mlp': mode 'zero4' does not exist; use one of replicate, zero2, zero3"),
        (dict(path="mlp", split=0), "unit 'mlp': split must be an integer >= 1 (1 = not split), got 0"),
        (dict(path="mlp", mode="replicate", split=2), "unit 'mlp': split=2 needs mode 'zero3'"),
        (dict(path="", checkpoint="yes"), "unit '<root>': checkpoint must be one of none, selective, full (or true, "
                                          "false), got 'yes'"),
    ],
)
def test_bad_unit_decisions_name_the_unit(unit, message):
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        UnitPlan(**unit)


def test_bad_json_is_explained():
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.from_json("{units: ")
    with pytest.raises(PlanError, match="schema_version 7 is not supported"):
        Plan.from_json(json.dumps({"schema_version": 7, "units": []}))
    with pytest.raises(PlanError, match=r"unknown plan field\(s\) \['bacth_size'\]"):
        Plan.from_json(json.dumps({"schema_version": 1, "units": [], "bacth_size": 4}))
    with pytest.raises(PlanError, match="appears twice"):
        Plan([UnitPlan("a"), UnitPlan("a")])


def test_hand_edited_json_with_stale_hash_is_refused():
    d = json.loads(sample_plan().to_json())
    d["units"][0]["mode"] = "zero3"
    with pytest.raises(PlanError, match="does not match its contents"):
        Plan.from_dict(d)
    del d["hash"]
    assert Plan.from_dict(d).unit("blocks.0.attn").mode == "zero3"


# A plan written by osdp before selective checkpointing (schema 1), as that osdp wrote it.
PLAN_V1 = ('{"units": [{"path": "blocks.0", "mode": "zero3", "split": 1, "checkpoint": true, "shard_scope": "world"}, '
           '{"path": "blocks.1", "mode": "replicate", "split": 1, "checkpoint": false, "shard_scope": "world"}, '
           '{"path": "", "mode": "zero2", "split": 1, "checkpoint": false, "shard_scope": "world"}], "batch_size": 4, '
           '"mixed_precision": "fp32", "world_size": null, "ranks_per_node": null, "model_signature": null, '
           '"predicted_step_s": null, "predicted_peak_bytes": null, "search_seconds": null, "meta": {}, '
           '"schema_version": 1, "hash": "23a3584ba5712daa"}')


def test_a_plan_of_schema_1_reads_as_none_and_full_with_its_hash():
    plan = Plan.from_json(PLAN_V1)  # its hash is checked on reading: it is the one the old osdp computed
    assert [u.checkpoint_policy for u in plan.units] == ["full", "none", "none"]
    assert plan.hash == "23a3584ba5712daa"
    again = Plan.from_json(plan.to_json())
    assert again.hash == plan.hash and again.units == plan.units
    # written anew, with the same decisions: the same hash
    assert Plan(plan.units, batch_size=4).hash == plan.hash


def test_checkpoint_policies_read_by_name_and_selective_is_its_own_decision():
    full, none = UnitPlan("a", checkpoint="full"), UnitPlan("a", checkpoint="none")
    assert (full.checkpoint, none.checkpoint) == (True, False)  # as a plan has always said them
    assert full == UnitPlan("a", checkpoint=True) and none == UnitPlan("a")
    selective = UnitPlan("a", checkpoint="selective")
    assert selective.checkpoint_policy == "selective" and selective.label == "zero3+sac" and full.label == "zero3+ckpt"
    plans = [Plan([UnitPlan("a", checkpoint=c)]) for c in (False, "selective", True)]
    assert len({p.hash for p in plans}) == 3
    back = Plan.from_json(plans[1].to_json())
    assert back.units[0].checkpoint == "selective" and back.hash == plans[1].hash


def test_selective_checkpointing_of_a_split_unit_is_refused_naming_it():
    with pytest.raises(PlanError, match="unit 'blocks.0.mlp': selective checkpointing cannot tell a split Linear"):
        UnitPlan("blocks.0.mlp", "zero3", split=2, checkpoint="selective")


# -- groups: k consecutive identical units as one FSDP2 unit ------------------------------------------------

def grouped(*units, **settings):
    return Plan([*units, UnitPlan("")], **settings)


def test_a_group_round_trips_and_is_its_own_decision():
    plan = grouped(UnitPlan("blocks.0", group="blocks.0"), UnitPlan("blocks.1", group="blocks.0"), batch_size=2)
    assert plan.groups() == {"blocks.0": ["blocks.0", "blocks.1"]}
    assert plan.unit("blocks.1").label == "zero3/grouped"
    back = Plan.from_json(plan.to_json())
    assert back == plan and back.hash == plan.hash and back.groups() == plan.groups()
    apart = grouped(UnitPlan("blocks.0"), UnitPlan("blocks.1"), batch_size=2)
    assert apart.hash != plan.hash
    assert plan.decisions()["schema_version"] == 3 and apart.decisions()["schema_version"] == 1
    assert "group" not in apart.decisions()["units"][0]  # plans without groups keep the hash they had


def test_a_group_of_one_unit_is_that_unit_alone():
    alone = grouped(UnitPlan("blocks.0", group="blocks.0"), UnitPlan("blocks.1"))
    assert alone.groups() == {} and alone.unit("blocks.0").group is None
    assert alone.hash == grouped(UnitPlan("blocks.0"), UnitPlan("blocks.1")).hash


@pytest.mark.parametrize(
    "units, message",
    [
        ([UnitPlan("blocks.0", "zero3", group="blocks.0"), UnitPlan("blocks.1", "zero2", group="blocks.0")],
         "group 'blocks.0' ('blocks.0', 'blocks.1') mixes settings ('blocks.0': zero3/grouped; 'blocks.1': "
         "zero2/grouped)"),
        ([UnitPlan("blocks.0", group="blocks.0"), UnitPlan("blocks.1", checkpoint=True, group="blocks.0")],
         "group 'blocks.0' ('blocks.0', 'blocks.1') mixes settings"),
        ([UnitPlan("blocks.1", group="blocks.0")], "units 'blocks.0', 'blocks.1' name 'blocks.0' as their group's "
                                                   "first unit, which is not in the plan"),
        ([UnitPlan("blocks.0"), UnitPlan("blocks.1", group="blocks.0")], "which is not in that group"),
    ],
)
def test_groups_that_cannot_be_one_unit_are_refused_naming_the_units(units, message):
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        grouped(*units)


@pytest.mark.parametrize(
    "unit, message",
    [
        (dict(path="blocks.1", mode="replicate", group="blocks.0"), "unit 'blocks.1': a replicated unit cannot be "
                                                                    "grouped"),
        (dict(path="blocks.1", split=2, group="blocks.0"), "unit 'blocks.1': a split unit cannot be grouped"),
        (dict(path="", group=""), "unit '<root>': the root unit encloses every other unit and cannot be grouped"),
    ],
)
def test_units_that_cannot_be_grouped_are_refused(unit, message):
    with pytest.raises(PlanError, match=message):
        UnitPlan(**unit)


def test_routed_containers_round_trip_and_are_a_decision_of_their_own():
    plan = grouped(UnitPlan("moe"), routed=["moe.experts"])
    back = Plan.from_json(plan.to_json())
    assert back.routed == ["moe.experts"] and back.hash == plan.hash
    plain = grouped(UnitPlan("moe"))
    assert plain.hash != plan.hash  # reduced another way
    assert plan.decisions()["schema_version"] == 4 and "routed" not in plain.decisions()
