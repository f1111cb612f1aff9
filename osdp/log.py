"""One progress log for osdp: lines on stderr from rank 0, prefixed with the task.

``Progress("describe gpt2-mini")("warm-up")`` prints
``osdp describe gpt2-mini: warm-up (1.2s)``: on a terminal one line rewritten
in place, elsewhere (logs, pipes) one line per message. Only rank 0 of the
default process group prints, so a multi-rank job says each thing once.
"""

from __future__ import annotations

import sys
import time


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Progress:
    """Progress of one task (see the module docstring); ``enabled=False`` silences it."""

    def __init__(self, task: str, enabled: bool = True):
        self.task, self.start = task, time.perf_counter()
        self.enabled = enabled and _rank() == 0
        self.tty = self.enabled and sys.stderr.isatty()

    def __call__(self, message: str) -> None:
        if self.enabled:
            line = f"osdp {self.task}: {message} ({time.perf_counter() - self.start:.1f}s)"
            print(("\r\033[K" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def done(self, message: str) -> None:
        """The last message: on a terminal, the line is kept."""
        self(message)
        if self.tty:
            print(file=sys.stderr, flush=True)


def log(message: str) -> None:
    """One line ``osdp: message`` on stderr, from rank 0."""
    if _rank() == 0:
        print(f"osdp: {message}", file=sys.stderr, flush=True)


__all__ = ["Progress", "log"]
