"""Plain text for people: tables for plans, runs and benchmarks, and short lists in messages."""

from __future__ import annotations

from typing import Any, Sequence

from osdp.describe.units import Unit
from osdp.schema.plan import Plan, display_path
from osdp.sizes import format_bytes


def first_few(names: Sequence[str], n: int = 4) -> str:
    """``names`` for a message: the first ``n``, then how many more ("a, b, c, d and 7 more")."""
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def format_table(rows: Sequence[Sequence[Any]], headers: Sequence[str], align: str | None = None) -> str:
    """Columns padded to their widest cell; ``align`` is one 'l' or 'r' per column (text left, numbers right)."""
    cells = [[str(h) for h in headers]] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    align = align or "".join("r" if rows and isinstance(rows[0][i], (int, float)) else "l" for i in range(len(headers)))

    def line(row):
        return "  ".join(c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(row, widths, align)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def plan_table(plan: Plan, units: Sequence[Unit]) -> str:
    by_path = {u.path: u for u in units}
    rows = []
    for u in plan.units:
        unit = by_path.get(u.path)
        rows.append([
            display_path(u.path),
            unit.module_type if unit else "?",
            u.mode,
            u.split,
            u.checkpoint_policy,
            unit.numel if unit else "?",
            format_bytes(unit.param_bytes) if unit else "?",
        ])
    table = format_table(rows, ["unit", "type", "mode", "split", "ckpt", "params", "param bytes"], "lllrlrr")
    lines = [plan.summary(), table]
    extra = []
    if plan.batch_size is not None:
        extra.append(f"micro-batch {plan.batch_size}")
    extra.append(f"precision {plan.mixed_precision}")
    if plan.predicted_step_s is not None:
        extra.append(f"predicted step {plan.predicted_step_s * 1e3:.1f} ms")
    if plan.predicted_peak_bytes is not None:
        extra.append(f"predicted peak {format_bytes(plan.predicted_peak_bytes)}")
    lines.append(", ".join(extra))
    return "\n".join(lines)
