"""The Plan: the one object that crosses every boundary (describe -> search -> apply).

A Plan is plain data. It says, for every unit (a module path), how its
parameters are held (``replicate``, ``zero2`` or ``zero3``), over which ranks
a sharded unit is sharded (``shard_scope``: all of them, or those of its node,
replicated across nodes), into how many slices its large Linears are split,
how its activations are checkpointed (none, selective: matmul and attention
outputs kept, the rest recomputed; full), and whether it is one FSDP2 unit
with the identical units beside it (``group``: k consecutive blocks gathered
and reduced together, fewer fixed per-unit costs for more memory gathered at
once); plus plan-wide settings
(micro-batch size, mixed precision, ranks per node) and what the search
predicted. It round-trips through JSON with a schema version,
and has a stable hash of the decisions so that ranks can check they agree.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Iterable

SCHEMA_VERSION = 4
# Version 1 had no selective checkpointing, version 2 no groups, version 3 no routed containers: their plans read
# as they are.
READABLE_SCHEMA_VERSIONS = (1, 2, 3, 4)

MODES = ("replicate", "zero2", "zero3")
# "world": sharded over every rank; "node": sharded over the ranks of one node and replicated across
# nodes (FSDP2 on a (nodes, ranks_per_node) mesh: gradients reduce-scattered within the node, then
# all-reduced across nodes), so that gathers stay on the node's links.
SHARD_SCOPES = ("world", "node")
MIXED_PRECISION = ("fp32", "bf16")
SPLIT_CHOICES = (1, 2, 4, 8)  # what the search offers; a hand-written plan may use any k >= 1
GROUP_CHOICES = (1, 2, 4)  # consecutive identical blocks per FSDP2 unit the search offers (1 = not grouped)
# How a unit's activations are checkpointed (osdp.describe.recompute). In a plan "none" is false and "full" is
# true, as in plans made before selective checkpointing, which keep their hash.
CHECKPOINT_POLICIES = ("none", "selective", "full")
_CHECKPOINT_VALUES = {"none": False, False: False, "full": True, True: True, "selective": "selective"}


def checkpoint_policy(checkpoint: bool | str) -> str:
    """"none", "selective" or "full" for a plan's ``checkpoint`` value (false, "selective", true)."""
    return {False: "none", True: "full"}.get(checkpoint, checkpoint)

# The baselines every strategy comparison uses, as a mode for every unit.
STRATEGIES = {"ddp": "replicate", "zero2": "zero2", "fsdp": "zero3", "zero3": "zero3"}

ROOT = ""  # module path of the root unit


class PlanError(ValueError):
    """A plan that cannot be applied as written (the message names the unit)."""


def display_path(path: str) -> str:
    return path if path != ROOT else "<root>"


def replicates_with_ddp(mixed_precision: str) -> bool:
    """Whether a plan's replicated units run on osdp's reducer, DDP's way (fp32: ``fsdp_ext.replicate``), or as
    FSDP2's ``replicate`` (bf16, whose MixedPrecisionPolicy makes the bf16 copy compute needs)."""
    return mixed_precision == "fp32"


def runs_as(path: str, mode: str, mixed_precision: str) -> str:
    """The mode a unit runs in: its plan's, but a replicated root in bf16 runs as zero2. FSDP2's root must be
    ``fully_shard``-ed, on the mesh the other units are sharded or (``replicate``) replicated on, so that their
    parameters take part in one ``clip_grad_norm_``; and as the root keeps its parameters gathered all step and
    reduces as the backward ends, zero2 holds less (fp32 shards) and moves less (a bf16 gather and a
    reduce-scatter, not an fp32 all-reduce) than replicating it would."""
    if mode == "replicate" and path == ROOT and not replicates_with_ddp(mixed_precision):
        return "zero2"
    return mode


def reshards_after_forward(path: str, mode: str) -> bool:
    """Whether a unit's gathered parameters are freed after its forward: zero3's, except the root's.

    The root's forward encloses every other unit's, so its parameters are gathered through the whole
    forward in any mode; freeing them after forward would only gather them again as backward starts.
    FSDP2 keeps its root gathered for the same reason, so a zero3 root runs as FSDP2's does."""
    return mode == "zero3" and path != ROOT


@dataclass(frozen=True)
class UnitPlan:
    """The decision for one unit."""

    path: str
    mode: str = "zero3"
    split: int = 1
    checkpoint: bool | str = False  # False (none), "selective" or True (full); "none" and "full" read as such
    shard_scope: str = "world"
    # The first unit of the group this unit is one FSDP2 unit with (``fully_shard([first, ...])``), its own path
    # for the first; None: a unit of its own. A group's units share mode, checkpoint and shard scope.
    group: str | None = None

    def __post_init__(self) -> None:
        where = f"unit '{display_path(self.path)}'"
        if not isinstance(self.checkpoint, (bool, str)) or self.checkpoint not in _CHECKPOINT_VALUES:
            raise PlanError(f"{where}: checkpoint must be one of {', '.join(CHECKPOINT_POLICIES)} (or true, false), "
                            f"got {self.checkpoint!r}")
        object.__setattr__(self, "checkpoint", _CHECKPOINT_VALUES[self.checkpoint])
        if self.mode not in MODES:
            raise PlanError(f"{where}: mode '{self.mode}' does not exist; use one of {', '.join(MODES)}")
        if self.shard_scope not in SHARD_SCOPES:
            raise PlanError(f"{where}: shard_scope '{self.shard_scope}' does not exist; use one of "
                            f"{', '.join(SHARD_SCOPES)}")
        if self.shard_scope == "node" and self.mode == "replicate":
            raise PlanError(f"{where}: shard_scope 'node' shards within a node, which a replicated unit does not "
                            "do; use it with mode 'zero2' or 'zero3'")
        if isinstance(self.split, bool) or not isinstance(self.split, int) or self.split < 1:
            raise PlanError(f"{where}: split must be an integer >= 1 (1 = not split), got {self.split!r}")
        if self.checkpoint == "selective" and self.split > 1:
            raise PlanError(f"{where}: selective checkpointing cannot tell a split Linear's matmuls apart (its "
                            "gathers and matmuls run in one autograd function): use checkpoint true (full) or "
                            "false for a split unit")
        if self.split > 1 and self.mode != "zero3":
            raise PlanError(
                f"{where}: split={self.split} needs mode 'zero3' (a split operator gathers its "
                f"slices one at a time, which only a fully sharded unit does); got mode '{self.mode}'"
            )
        if self.group is not None:
            if not isinstance(self.group, str):
                raise PlanError(f"{where}: group must name the first unit of its group, got {self.group!r}")
            if self.mode == "replicate":
                raise PlanError(f"{where}: a replicated unit cannot be grouped (group '{display_path(self.group)}'): "
                                "grouping gathers units' shards together, and a replicated unit gathers nothing; "
                                "use mode 'zero2' or 'zero3', or drop 'group'")
            if self.split > 1:
                raise PlanError(f"{where}: a split unit cannot be grouped (group '{display_path(self.group)}'): its "
                                "Linears gather their slices one at a time, outside the group's gather; use split=1 "
                                "or drop 'group'")
            if self.path == ROOT or self.group == ROOT:
                raise PlanError(f"{where}: the root unit encloses every other unit and cannot be grouped")
        if self.split > 1 and self.shard_scope == "node":
            raise PlanError(f"{where}: split={self.split} with shard_scope 'node' is not supported: a split "
                            "Linear is sharded over every rank; use shard_scope 'world' for split units")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def same_group_settings(self, other: "UnitPlan") -> bool:
        """Whether ``other`` can be one FSDP2 unit with this one: the same mode, checkpoint and shard scope."""
        return (self.mode, self.checkpoint, self.shard_scope) == (other.mode, other.checkpoint, other.shard_scope)

    @property
    def reshards_after_forward(self) -> bool:
        return reshards_after_forward(self.path, self.mode)

    @property
    def checkpoint_policy(self) -> str:
        """"none", "selective" or "full"."""
        return checkpoint_policy(self.checkpoint)

    @property
    def label(self) -> str:
        """``zero3@node/split2+ckpt``-style: mode, then what differs from the defaults."""
        return (self.mode + ("@node" if self.shard_scope == "node" else "")
                + (f"/split{self.split}" if self.split > 1 else "") + {"none": "", "selective": "+sac", "full": "+ckpt"}[self.checkpoint_policy]
                + ("/grouped" if self.group is not None else ""))


@dataclass
class Plan:
    """Per-unit decisions plus plan-wide settings and the search's predictions."""

    units: list[UnitPlan]
    batch_size: int | None = None  # micro-batch per rank; None = whatever the caller feeds
    mixed_precision: str = "fp32"
    world_size: int | None = None  # None = any
    ranks_per_node: int | None = None  # None = any (node-scoped units take the job's own)
    model_signature: str | None = None  # structure hash of the model the plan was made for
    predicted_step_s: float | None = None
    predicted_peak_bytes: int | None = None
    search_seconds: float | None = None  # how long the search took (not part of the hash)
    # containers (ModuleList, ModuleDict) whose members the model calls depending on the data, as a mixture of
    # experts calls its experts (osdp.describe.units.routed_containers): their gradients exist on some ranks only
    routed: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)  # free-form: budget, device, search time
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        self.units = [u if isinstance(u, UnitPlan) else UnitPlan(**u) for u in self.units]
        seen: set[str] = set()
        for u in self.units:
            if u.path in seen:
                raise PlanError(f"unit '{display_path(u.path)}' appears twice in the plan")
            seen.add(u.path)
        self.units = _without_groups_of_one(self.units)
        check_groups(self.units)
        if self.mixed_precision not in MIXED_PRECISION:
            raise PlanError(
                f"mixed_precision '{self.mixed_precision}' does not exist; use one of {', '.join(MIXED_PRECISION)}"
            )
        if self.batch_size is not None and (not isinstance(self.batch_size, int) or self.batch_size < 1):
            raise PlanError(f"batch_size must be a positive integer, got {self.batch_size!r}")
        if self.world_size is not None and (not isinstance(self.world_size, int) or self.world_size < 1):
            raise PlanError(f"world_size must be a positive integer, got {self.world_size!r}")
        if self.ranks_per_node is not None:
            if isinstance(self.ranks_per_node, bool) or not isinstance(self.ranks_per_node, int) \
                    or self.ranks_per_node < 1:
                raise PlanError(f"ranks_per_node must be a positive integer, got {self.ranks_per_node!r}")
            if self.world_size is not None and self.world_size % self.ranks_per_node:
                raise PlanError(f"world_size {self.world_size} is not a whole number of nodes of "
                                f"{self.ranks_per_node} ranks")

    # -- construction -------------------------------------------------------------

    @classmethod
    def uniform(cls, paths: Iterable[str], mode: str, **settings: Any) -> "Plan":
        """Every unit in the same mode: the baselines (``ddp``, ``zero2``, ``fsdp``)."""
        return cls(units=[UnitPlan(p, mode=mode) for p in paths], **settings)

    @classmethod
    def for_strategy(cls, paths: Iterable[str], strategy: str, **settings: Any) -> "Plan":
        if strategy not in STRATEGIES:
            raise PlanError(f"unknown strategy '{strategy}'; use one of {', '.join(sorted(STRATEGIES))}")
        plan = cls.uniform(paths, STRATEGIES[strategy], **settings)
        plan.meta.setdefault("strategy", strategy)
        return plan

    # -- lookup -------------------------------------------------------------------

    def unit(self, path: str) -> UnitPlan:
        for u in self.units:
            if u.path == path:
                return u
        raise KeyError(f"no unit '{display_path(path)}' in the plan")

    @property
    def paths(self) -> list[str]:
        return [u.path for u in self.units]

    def groups(self) -> dict[str, list[str]]:
        """First unit of each group -> the paths of its units (the first first, then in plan order)."""
        return groups_of(self.units)

    # -- JSON ---------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["hash"] = self.hash
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        d = dict(d)
        version = d.pop("schema_version", None)
        if version not in READABLE_SCHEMA_VERSIONS:
            raise PlanError(f"plan schema_version {version!r} is not supported; this osdp reads versions "
                            f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))}")
        claimed_hash = d.pop("hash", None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise PlanError(f"unknown plan field(s) {unknown}; known fields are {sorted(known)}")
        if "units" not in d:
            raise PlanError("a plan needs a 'units' list")
        units = []
        for raw in d.pop("units"):
            if not isinstance(raw, dict) or "path" not in raw:
                raise PlanError(f"each unit needs at least a 'path', got {raw!r}")
            extra = sorted(set(raw) - {f.name for f in dataclasses.fields(UnitPlan)})
            if extra:
                raise PlanError(f"unit '{display_path(raw['path'])}': unknown field(s) {extra}")
            units.append(UnitPlan(**raw))
        plan = cls(units=units, schema_version=version, **d)
        if claimed_hash is not None and claimed_hash != plan.hash:
            raise PlanError(
                f"plan hash {claimed_hash} does not match its contents (recomputed {plan.hash}); "
                "the JSON was edited by hand: drop the 'hash' field to accept the edit"
            )
        return plan

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"plan is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise PlanError("plan JSON must be an object with a 'units' list")
        return cls.from_dict(d)

    # -- identity -----------------------------------------------------------------

    def decisions(self) -> dict[str, Any]:
        """What the hash covers: everything that changes how the model is run."""
        def unit(u: UnitPlan) -> dict[str, Any]:
            d = u.to_dict()
            if u.shard_scope == "world":  # the default: plans made before shard scopes keep their hash
                del d["shard_scope"]
            if u.group is None:  # likewise plans made before groups
                del d["group"]
            return d

        out = {
            # the oldest schema that can say this plan: a plan an older osdp could read keeps the hash it had there
            "schema_version": (4 if self.routed else 3 if any(u.group is not None for u in self.units)
                               else 2 if any(u.checkpoint == "selective" for u in self.units) else 1),
            "units": [unit(u) for u in sorted(self.units, key=lambda u: u.path)],
            "batch_size": self.batch_size,
            "mixed_precision": self.mixed_precision,
            "world_size": self.world_size,
            "model_signature": self.model_signature,
        }
        if self.ranks_per_node is not None:
            out["ranks_per_node"] = self.ranks_per_node
        if self.routed:
            out["routed"] = sorted(self.routed)
        return out

    @property
    def hash(self) -> str:
        blob = json.dumps(self.decisions(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for u in self.units:
            counts[u.label] = counts.get(u.label, 0) + 1
        parts = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        return f"Plan {self.hash}: {len(self.units)} units ({parts})"


def groups_of(units: Iterable[UnitPlan]) -> dict[str, list[str]]:
    """First unit of each group -> the paths of its units (the first first, then in the order given)."""
    groups: dict[str, list[str]] = {}
    for u in units:
        if u.group is not None:
            groups.setdefault(u.group, [u.group]).extend([u.path] if u.path != u.group else [])
    return groups


def _without_groups_of_one(units: list[UnitPlan]) -> list[UnitPlan]:
    """A group of one unit is that unit on its own: said the one way (the hash does not tell them apart)."""
    alone = {first for first, members in groups_of(units).items() if len(members) == 1}
    return [dataclasses.replace(u, group=None) if u.group in alone and u.path == u.group else u for u in units]


def check_groups(units: list[UnitPlan]) -> None:
    """PlanError naming the units unless every group's first unit is in it and its units agree on mode,
    checkpoint and shard scope (that they are consecutive identical modules is checked against the model)."""
    by_path = {u.path: u for u in units}
    for first, members in groups_of(units).items():
        named = ", ".join(f"'{display_path(p)}'" for p in members)
        leader = by_path.get(first)
        if leader is None or leader.group != first:
            raise PlanError(f"units {named} name '{display_path(first)}' as their group's first unit, which is "
                            f"{'not in the plan' if leader is None else 'not in that group'}; give it "
                            f"group '{first}' too")
        mixed = [p for p in members if not by_path[p].same_group_settings(leader)]
        if mixed:
            settings = "; ".join(f"'{display_path(p)}': {by_path[p].label}" for p in [first, *mixed])
            raise PlanError(f"group '{display_path(first)}' ({named}) mixes settings ({settings}): one FSDP2 unit "
                            "has one mode, checkpoint and shard scope; give its units the same")
