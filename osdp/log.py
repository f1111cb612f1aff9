"""One progress log for osdp: lines on stderr from rank 0, prefixed with the task.

``Progress("describe gpt2-mini")("warm-up")`` prints
``osdp describe gpt2-mini: warm-up (1.2s)``: on a terminal one line rewritten
in place, elsewhere (logs, pipes) one line per message, where a run of messages
alike up to their first number ("setting up 3/20 ...", "step 4/17 ...") is
shown at most every few seconds, and its last one at the end. A message given
the fraction of the task done so far also says about how long is left, at the
pace since the first such message. Only rank 0 of the
default process group prints, so a multi-rank job says each thing once; none
prints with ``OSDP_QUIET=1`` (``osdp train --quiet``).
"""

from __future__ import annotations

import os
import re
import sys
import time

REPEAT_EVERY_S = 5.0  # in a log, a message like the last one (numbers aside) is shown at most this often
QUIET_ENV = "OSDP_QUIET"  # set (osdp train --quiet does, for its ranks too): no progress lines at all


def _quiet() -> bool:
    return os.environ.get(QUIET_ENV, "") not in ("", "0")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Progress:
    """Progress of one task (see the module docstring); ``enabled=False`` silences it."""

    def __init__(self, task: str, enabled: bool = True):
        self.task, self.start = task, time.perf_counter()
        self.enabled = enabled and _rank() == 0 and not _quiet()
        self.tty = self.enabled and sys.stderr.isatty()
        self._kind, self._shown_at, self._held = None, 0.0, None  # a log's run of like messages
        self._paced_from: tuple[float, float] | None = None  # (time, fraction) of the first message with one

    def __call__(self, message: str, fraction: float | None = None) -> None:
        """Show ``message``; ``fraction`` (0..1) of the task done so far adds the time left."""
        if not self.enabled:
            return
        now = time.perf_counter()
        line = f"osdp {self.task}: {message} ({now - self.start:.1f}s{self._left(now, fraction)})"
        if self.tty:
            print("\r\033[K" + line, end="", file=sys.stderr, flush=True)
            return
        kind = re.split(r"\d", message, maxsplit=1)[0] if re.search(r"\d", message) else message
        if kind == self._kind and now - self._shown_at < REPEAT_EVERY_S:
            self._held = line  # like the last one shown: held, printed if it ends the run
            return
        self._flush_held(kind)
        self._kind, self._shown_at = kind, now
        print(line, file=sys.stderr, flush=True)

    def _left(self, now: float, fraction: float | None) -> str:
        if fraction is None:
            return ""
        if self._paced_from is None:
            self._paced_from = (now, fraction)
        t0, f0 = self._paced_from
        if fraction >= 1.0 or fraction - f0 < 0.02 or now - t0 < 0.5:  # too little done yet to tell a pace
            return ""
        return f", about {format_seconds((now - t0) * (1.0 - fraction) / (fraction - f0))} left"

    def _flush_held(self, next_kind: str | None) -> None:
        if self._held is not None and next_kind != self._kind:
            print(self._held, file=sys.stderr, flush=True)
        self._held = None

    def done(self, message: str) -> None:
        """The last message: on a terminal, the line is kept."""
        self(message)
        if self.tty:
            print(file=sys.stderr, flush=True)


def format_seconds(seconds: float) -> str:
    """``8s``, ``1m 05s``: a duration as a person reads it."""
    seconds = max(0, round(seconds))
    return f"{seconds}s" if seconds < 60 else f"{seconds // 60}m {seconds % 60:02d}s"


def log(message: str) -> None:
    """One line ``osdp: message`` on stderr, from rank 0."""
    if _rank() == 0 and not _quiet():
        print(f"osdp: {message}", file=sys.stderr, flush=True)


__all__ = ["Progress", "format_seconds", "log"]
