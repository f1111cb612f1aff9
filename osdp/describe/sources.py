"""Models to plan offline: a reference model, a user's factory, or a local Transformers config.

``osdp plan --model my_pkg.models:build_model --input-spec "long[B,S] long[B,S]"``
imports ``my_pkg.models`` and calls ``build_model()`` on the meta device (no
memory, so a model of billions of parameters plans in seconds); the input
spec gives the shapes and dtypes of the batch its forward takes.
``osdp plan --hf-config path/to/config.json`` builds the model its
``architectures`` field names (or the family's causal LM, masked LM,
sequence-to-sequence LM or image classifier) from the config alone, on the
meta device, with the batch its loss needs (``input_ids`` and ``labels``, or
``pixel_values`` and ``labels``).

Every failure raises ``ModelSourceError`` saying what was wrong and what would
work, before anything is planned.
"""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

DTYPES = {"long": torch.long, "int": torch.int32, "float": torch.float32, "float32": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "half": torch.float16, "bool": torch.bool}
_TENSOR = re.compile(r"^(?:(?P<name>[A-Za-z_]\w*)=)?(?P<dtype>\w+)\[(?P<dims>[^\]]*)\]$")


class ModelSourceError(ValueError):
    """A factory, config or input spec that cannot give a model and its batch (the message says why)."""


@dataclass
class ModelSource:
    """A model built on the meta device and a function giving its example batch at micro-batch ``b``."""

    name: str
    model: nn.Module
    example: Callable[[int], Any]  # micro-batch -> the batch the forward takes (meta tensors)
    seq_len: int


def parse_input_spec(spec: str, seq_len: int) -> Callable[[int], Any]:
    """``"long[B,S] long[B,S]"`` (positional) or ``"input_ids=long[B,S] labels=long[B,S]"`` (keywords):
    one tensor per item, dims ``B`` (the micro-batch), ``S`` (the sequence length) or integers."""
    items = spec.split()
    if not items:
        raise ModelSourceError("--input-spec is empty; give one tensor per input, e.g. \"long[B,S] long[B,S]\"")
    parsed = []
    for item in items:
        m = _TENSOR.match(item)
        if not m or m["dtype"] not in DTYPES:
            raise ModelSourceError(
                f"--input-spec item {item!r}: write DTYPE[DIMS] or NAME=DTYPE[DIMS], DTYPE one of "
                f"{', '.join(DTYPES)}, DIMS of B (micro-batch), S (sequence length) or integers, e.g. long[B,S]")
        dims = [d.strip() for d in m["dims"].split(",") if d.strip()]
        bad = [d for d in dims if d not in ("B", "S") and not d.isdigit()]
        if bad:
            raise ModelSourceError(f"--input-spec item {item!r}: dimension {bad[0]!r} is not B, S or an integer")
        parsed.append((m["name"], DTYPES[m["dtype"]], dims))
    names = [n for n, _, _ in parsed]
    if any(names) and not all(names):
        raise ModelSourceError("--input-spec: name every input (NAME=DTYPE[DIMS]) or none")

    def example(b: int) -> Any:
        def tensor(dtype: torch.dtype, dims: list[str]) -> torch.Tensor:
            shape = [b if d == "B" else seq_len if d == "S" else int(d) for d in dims]
            return torch.zeros(shape, dtype=dtype, device="meta")

        if all(names):
            return {n: tensor(dt, dims) for n, dt, dims in parsed}
        return tuple(tensor(dt, dims) for _, dt, dims in parsed)

    return example


def from_reference(name: str, seq_len: int | None) -> ModelSource:
    """A built-in reference model (``osdp.models``) with its token batch (inputs and targets)."""
    from osdp import models

    config = models.get_config(name)  # ValueError names the reference models
    seq_len = seq_len or config.seq_len
    with torch.device("meta"):
        model = models.build(name, seq_len=seq_len)

    def example(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.zeros(b, seq_len, dtype=torch.long, device="meta")
        return tokens, tokens

    return ModelSource(name, model, example, seq_len)


def from_factory(target: str, input_spec: str | None, seq_len: int | None) -> ModelSource:
    """``module.path:function``, called with no arguments on the meta device."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ModelSourceError(f"--model {target!r}: a factory is MODULE:FUNCTION, e.g. my_pkg.models:build_model")
    if not input_spec:
        raise ModelSourceError(f"--model {target}: give --input-spec, the batch its forward takes, "
                               "e.g. --input-spec \"long[B,S] long[B,S]\"")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ModelSourceError(f"--model {target}: cannot import {attr} from {module_name} ({e}); is the package "
                               "on PYTHONPATH, and is the function spelled as in its module?") from e
    if not callable(factory):
        raise ModelSourceError(f"--model {target}: {attr} is a {type(factory).__name__}, not a function")
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as e:  # noqa: BLE001 - the user's code: say where it failed
        raise ModelSourceError(f"--model {target}: calling {attr}() on the meta device failed: "
                               f"{type(e).__name__}: {e}") from e
    _check_model(model, f"--model {target}")
    seq_len = seq_len or 128
    return ModelSource(target, model, parse_input_spec(input_spec, seq_len), seq_len)


# the head each kind of Transformers config trains with, when its "architectures" names none
_HEADS = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForMaskedLM", "AutoModelForImageClassification")


def from_hf_config(path: str | Path, seq_len: int | None) -> ModelSource:
    """The model a local Transformers config describes, on the meta device, with the batch its loss needs."""
    try:
        import transformers
    except ImportError as e:
        raise ModelSourceError("--hf-config needs transformers (pip install transformers)") from e
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelSourceError(f"--hf-config {path}: cannot read a Transformers config from {file} ({e})") from e
    if "model_type" not in raw:
        raise ModelSourceError(f"--hf-config {path}: {file} has no \"model_type\"; a Transformers config.json "
                               "names its family there (e.g. \"llama\")")
    try:
        config = transformers.AutoConfig.for_model(**raw)
    except (ValueError, KeyError) as e:
        raise ModelSourceError(f"--hf-config {path}: cannot read a Transformers config from {file} ({e})") from e
    model = _build_hf(config, raw.get("architectures") or [], f"--hf-config {path}")
    _check_model(model, f"--hf-config {path}")
    if getattr(config, "model_type", "") in ("vit", "deit", "beit", "swin", "convnext"):
        channels, size = getattr(config, "num_channels", 3), getattr(config, "image_size", 224)

        def example(b: int) -> Any:
            return {"pixel_values": torch.zeros(b, channels, size, size, device="meta"),
                    "labels": torch.zeros(b, dtype=torch.long, device="meta")}

        return ModelSource(f"{config.model_type} ({file})", model, example, 1)
    limit = next((getattr(config, k) for k in ("max_position_embeddings", "n_positions") if getattr(config, k, None)), 512)
    seq_len = seq_len or min(int(limit), 1024)
    if seq_len > limit:
        raise ModelSourceError(f"--hf-config {path}: --seq-len {seq_len} is longer than the model's {limit} positions")

    def example(b: int) -> Any:
        ids = torch.zeros(b, seq_len, dtype=torch.long, device="meta")
        return {"input_ids": ids, "labels": ids}

    return ModelSource(f"{config.model_type} ({file})", model, example, seq_len)


def _build_hf(config: Any, architectures: list[str], where: str) -> nn.Module:
    import transformers

    classes = [getattr(transformers, a) for a in architectures if hasattr(transformers, a)]
    classes += [getattr(transformers, h) for h in _HEADS]
    errors = []
    for cls in classes:
        try:
            with torch.device("meta"):
                return cls.from_config(config) if cls.__name__.startswith("Auto") else cls(config)
        except (ValueError, KeyError, TypeError) as e:  # not this head for this family
            errors.append(f"{cls.__name__}: {e}")
    raise ModelSourceError(f"{where}: Transformers cannot build a trainable model from it "
                           f"({'; '.join(errors)[:400]}); check \"model_type\" and \"architectures\"")


def _check_model(model: Any, where: str) -> None:
    if not isinstance(model, nn.Module):
        raise ModelSourceError(f"{where}: the factory returned a {type(model).__name__}, not an nn.Module")
    if not any(True for _ in model.parameters()):
        raise ModelSourceError(f"{where}: the model has no parameters on the meta device; is it built "
                               "inside the factory (not loaded lazily on first forward)?")
