"""How much of the machine other work took while a timed test ran: the CPU time every process spent (the
kernel's count, steal by other virtual machines included) less this process tree's: this process, its
descendants (the fork server the ranks are forked from among them) and every child they reaped.

The load average cannot tell: it is a minute's moving average read at two instants, blind to a burst between
them and still raised by this test's own ranks afterwards."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_s() -> float | None:
    """Seconds of CPU time every core has spent busy since boot (steal included), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal ...: all but idle and iowait
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
    return (user + nice + system + irq + softirq + steal) / _TICKS_PER_S


def _tree_s() -> float:
    """CPU seconds this process and its descendants spent, with those of the children each has reaped."""
    parent, ticks = {}, {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": comm may hold spaces
        except OSError:  # gone meanwhile
            continue
        # state ppid ... utime stime cutime cstime: fields 3, 4 and 14-17 of proc(5)
        parent[int(entry)] = int(rest[1])
        ticks[int(entry)] = sum(map(int, rest[11:15]))
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo += children.get(pid, [])
    return total / _TICKS_PER_S


@dataclass
class ForeignCpu:
    """Started on construction; ``cores()``: the cores other work kept busy on average since (None where the
    kernel does not say)."""

    _start: tuple[float | None, float, float] = field(
        default_factory=lambda: (_busy_s(), _tree_s(), time.monotonic()))

    def cores(self) -> float | None:
        busy0, own0, wall0 = self._start
        busy1 = _busy_s()
        if busy0 is None or busy1 is None:
            return None
        wall = max(time.monotonic() - wall0, 1e-3)
        # ranks that just returned their results are exiting: a walk that reads the fork server before it reaps
        # one and the rank's entry after misses its time. The tree's time only grows: the largest of a few walks
        walks = []
        for _ in range(3):
            time.sleep(0.1)
            walks.append(_tree_s())
        own1 = max(walks)
        return max(0.0, (busy1 - busy0) - (own1 - own0)) / wall
