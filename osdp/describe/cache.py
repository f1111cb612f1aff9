"""The describe cache: what a description is keyed by, and reading it back.

A description (measured or analytic) is kept in ``$OSDP_CACHE_DIR/describe`` under a key of everything it
depends on; one written by an older osdp (another ``PROFILE_VERSION``) or in an older format is measured again.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Mapping

import torch.nn as nn

from osdp.schema.description import ModelDescription
from osdp.store import cache_dir

PROFILE_VERSION = 23  # bump when what is measured changes: old cache entries are ignored


def model_fingerprint(model: nn.Module) -> str:
    """Structure plus the plain settings of every module (head counts, flags) that change costs, not shapes."""
    parts = []
    for name, m in model.named_modules():
        settings = sorted(
            (k, v) for k, v in vars(m).items()
            if not k.startswith("_") and isinstance(v, (int, float, bool, str, type(None)))
        )
        parts.append(f"{name}:{type(m).__qualname__}:{settings}")
    for name, p in model.named_parameters():  # a gradient hook keeps its Linear from being split
        parts.append(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}:{bool(p._backward_hooks)}")
    for name, b in model.named_buffers():  # held all step (ModelDescription.buffer_bytes), read by the forward
        parts.append(f"{name}:{tuple(b.shape)}:{b.dtype}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def cache_key(parts: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def cached_path(key: str, kind: str = "") -> Path:
    """Where the description keyed ``key`` is kept (``kind``: a prefix, "analytic" for offline ones)."""
    return cache_dir() / "describe" / (f"{kind}-{key}.json" if kind else f"{key}.json")


def read_cached(path: Path) -> ModelDescription | None:
    """The description cached at ``path``, or None (none there, or an older format: measured again)."""
    if not path.exists():
        return None
    try:
        description = ModelDescription.from_json(path.read_text())
    except (ValueError, KeyError, TypeError):
        return None
    description.from_cache = True
    return description
