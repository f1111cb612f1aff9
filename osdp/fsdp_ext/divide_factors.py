"""Gradient divide factors asked for per module, against those the units apply: a divergence is said, not silent.

FSDP2's ``set_gradient_divide_factor`` belongs to a unit: every parameter it holds is divided alike. A user
sets it on the modules they would have ``fully_shard``-ed, meaning those modules' parameters; under osdp's
plan a module may be no unit (``module_api.StandIn``), so the factor reaches the units standing behind it, and
those can hold other parameters too (a block's norms the root holds; the root's other parameters, where the
factor was set on an embedding inside it). Each call notes the factor asked for the module's parameters
(``ask``) and each unit the factor it applies (``apply``); at the next forward every parameter whose unit
divides otherwise than asked is named in a warning, once (``check``). Setting the factor on every module, as
FSDP2 users do, asks alike for all of them and warns of nothing under any plan.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping

import torch.nn as nn

from osdp.report import first_few
from osdp.schema.plan import display_path

_ATTR = "_osdp_divide_factors"  # on the wrapped model, its units and its stand-ins: (DivideFactors, path)


class DivideFactorWarning(UserWarning):
    """A parameter's gradient is divided by another factor than the one set on the module it belongs to."""


class DivideFactors:
    """Per wrapped model: the factor asked for each parameter (by name) and the one each unit applies (by
    path). None is FSDP2's default, the mean over the ranks."""

    def __init__(self, homes: Mapping[str, str], groups: Mapping[str, list[str]]):
        self.homes = dict(homes)  # parameter name -> the unit holding it
        self.groups = dict(groups)  # unit path -> every unit sharing its FSDP2 state (a group), itself included
        self.asked: dict[str, float | None] = {}
        self.applied: dict[str, float | None] = {}
        self.pending = False
        self.warned: set[tuple] = set()

    def ask(self, names: Iterable[str], factor: float | None) -> None:
        for name in names:
            self.asked[name] = factor
        self.pending = True

    def apply(self, unit: str, factor: float | None) -> None:
        for member in self.groups.get(unit, [unit]):
            self.applied[member] = factor
        self.pending = True

    def names_under(self, path: str) -> list[str]:
        return [n for n in self.homes if not path or n.startswith(path + ".")]

    def names_held_by(self, unit: str) -> list[str]:
        members = set(self.groups.get(unit, [unit]))
        return [n for n, home in self.homes.items() if home in members]

    def check(self, *_) -> None:
        """Warn of every parameter divided otherwise than asked (a forward pre-hook on the model)."""
        if not self.pending:
            return
        self.pending = False
        off = [(n, home) for n, home in self.homes.items() if self.asked.get(n) != self.applied.get(home)]
        key = tuple(off)
        if not off or key in self.warned:
            return
        self.warned.add(key)
        name, home = off[0]
        applied, asked = self.applied.get(home), self.asked.get(name)
        divided = "the number of ranks" if applied is None else f"{applied:g}"
        set_for = "none was set for them (the default: the number of ranks)" if asked is None else \
            f"{asked:g} was set for them"
        warnings.warn(DivideFactorWarning(
            f"osdp: the gradients of {first_few([n for n, _ in off])} are divided by {divided}, where {set_for}"
            f": the plan made their module no unit of its own, and unit '{display_path(home)}' holds them with "
            "other parameters. Set the factor on every module you would have fully_shard-ed, the model itself "
            "included (as FSDP2 users do), and every plan divides alike"), stacklevel=2)


def track_divide_factors(model: nn.Module, homes: Mapping[str, str], groups: Mapping[str, list[str]],
                         paths: Mapping[nn.Module, str]) -> None:
    """Give ``model``, its units and stand-ins (``paths``: module -> its path) the table, and check it at every
    forward's start."""
    factors = DivideFactors(homes, groups)
    for module, path in paths.items():
        module.__dict__[_ATTR] = (factors, path)
    model.__dict__[_ATTR] = (factors, "")
    model.register_forward_pre_hook(factors.check)


def divide_factors_of(module: nn.Module) -> tuple[DivideFactors, str] | None:
    return module.__dict__.get(_ATTR)
