"""One progress log for osdp: lines on stderr from rank 0, prefixed with the task.

``Progress("describe gpt2-mini")("warm-up")`` prints
``osdp describe gpt2-mini: warm-up (1.2s)``: on a terminal one line rewritten
in place, elsewhere (logs, pipes) one line per message, where a run of messages
alike up to their first number ("setting up 3/20 ...", "step 4/17 ...") is
shown at most every few seconds, and its last one at the end. Only rank 0 of the
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

    def __call__(self, message: str) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        line = f"osdp {self.task}: {message} ({now - self.start:.1f}s)"
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

    def _flush_held(self, next_kind: str | None) -> None:
        if self._held is not None and next_kind != self._kind:
            print(self._held, file=sys.stderr, flush=True)
        self._held = None

    def done(self, message: str) -> None:
        """The last message: on a terminal, the line is kept."""
        self(message)
        if self.tty:
            print(file=sys.stderr, flush=True)


def log(message: str) -> None:
    """One line ``osdp: message`` on stderr, from rank 0."""
    if _rank() == 0 and not _quiet():
        print(f"osdp: {message}", file=sys.stderr, flush=True)


__all__ = ["Progress", "log"]
