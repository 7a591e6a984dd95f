"""Read a PEFT LoRA folder straight into plain tensors, ready to attach to the embedded engine's model.

    weights = read_lora(path, targets={"model.layers.0.self_attn.q_proj": q_proj, ...})

``read_lora`` is meant to run on a worker thread (``asyncio.to_thread``), never the engine's scheduler
thread: it reads ``adapter_config.json`` and ``adapter_model.safetensors``, refuses LoRA variants we do
not serve (DoRA, ``modules_to_save``, LoRA biases, ...; the list is ``runtime.adapters.validation.unsupported_lora_features``),
maps every ``lora_A``/``lora_B`` pair to a base ``nn.Linear``, checks the shapes and that the weights are finite
(before and after the scale is folded in and they are cast to the base's dtype: ``lora_B * scale`` can overflow
float16), and returns per module
``a_t`` (in, r) and ``b_t`` (r, out) with the LoRA scale folded into ``b_t``, in the base weight's dtype
and device, contiguous. What is left for the scheduler thread is a few dict insertions
(``LoraBank.attach`` in ``lora_batch``).

Scale, as PEFT computes it per module: ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
``use_rslora``), where ``r`` and ``lora_alpha`` come from ``rank_pattern``/``alpha_pattern`` when a
pattern matches the module name (PEFT's ``get_pattern_key`` rule: ``(.*\\.)?(pattern)$``).
``fan_in_fan_out`` only changes how PEFT merges into a ``Conv1D`` base weight; ``lora_A``/``lora_B`` are
stored as (r, in)/(out, r) either way, and only ``nn.Linear`` bases are served here, so it needs nothing.
``layers_to_transform``/``layers_pattern`` need nothing either: a folder only holds weights for the
layers it adapts.

Not here: embedding LoRA, quantized bases, the registry's path/hash checks (``runtime.adapters.validation.validate_adapter``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from learner.records.adapter_manifest import CONFIG_FILE, WEIGHTS_FILE
from runtime.adapters.validation import MAX_CONFIG_BYTES, unsupported_lora_features
from runtime.engine import AdapterError
from runtime.json_text import read_json_file

_KEY_RE = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<part>lora_A|lora_B)(?:\.[^.]+)?\.weight$")


@dataclass(frozen=True)
class LoraModule:
    """One adapted linear: ``y += (x @ a_t) @ b_t``; ``scale`` is already folded into ``b_t``."""

    a_t: torch.Tensor  # (in, r)
    b_t: torch.Tensor  # (r, out)
    rank: int
    scale: float


@dataclass(frozen=True)
class LoraWeights:
    """One adapter, read and prepared; ``modules`` maps base module names to their LoRA."""

    modules: dict[str, LoraModule]
    config: dict[str, Any]

    @property
    def rank(self) -> int:
        return max(m.rank for m in self.modules.values())

    @property
    def nbytes(self) -> int:
        return sum(m.a_t.nbytes + m.b_t.nbytes for m in self.modules.values())


def _pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = read_json_file(path / CONFIG_FILE, max_bytes=MAX_CONFIG_BYTES)
    except (OSError, ValueError) as exc:  # invalid JSON, or over the depth/size limits (JSONLimitExceeded)
        raise AdapterError(f"could not read {CONFIG_FILE} in {path}: {exc}") from exc
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise AdapterError(f"{path} is not a PEFT LoRA adapter (peft_type {config.get('peft_type') if isinstance(config, dict) else None!r})")
    if bad := unsupported_lora_features(config):
        raise AdapterError(f"adapter {path} uses LoRA features this engine does not serve: {'; '.join(bad)}")
    return config


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path / WEIGHTS_FILE))
    except (OSError, SafetensorError) as exc:
        raise AdapterError(f"could not read {WEIGHTS_FILE} in {path}: {exc}") from exc


def _resolve(module: str, targets: Mapping[str, nn.Module]) -> str | None:
    if module in targets:
        return module
    hits = [t for t in targets if t.endswith("." + module) or module.endswith("." + t)]
    return hits[0] if len(hits) == 1 else None


def read_lora(path: str | Path, targets: Mapping[str, nn.Module]) -> LoraWeights:
    """Read and prepare the LoRA folder ``path`` for the linears in ``targets`` (name → ``nn.Linear``).

    Raises ``runtime.engine.AdapterError`` naming the problem: unreadable files, an unsupported
    variant, weights for a module that is not a linear of the base, shapes that do not fit, or weights
    that are not finite (NaN or infinity, as stored or once scaled and cast).
    """
    path = Path(path)
    config = _read_config(path)
    tensors = _read_tensors(path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY_RE.match(key)
        if m is None:
            raise AdapterError(f"{WEIGHTS_FILE} in {path} holds {key!r}, which is not a lora_A/lora_B weight (unsupported variant?)")
        _check_finite(tensor, f"{WEIGHTS_FILE} in {path}: tensor {key!r}")
        pairs.setdefault(m["module"], {})[m["part"]] = tensor
    if not pairs:
        raise AdapterError(f"{WEIGHTS_FILE} in {path} holds no LoRA weights")
    use_rslora = bool(config.get("use_rslora"))
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    modules: dict[str, LoraModule] = {}
    for name, parts in pairs.items():
        base_name = _resolve(name, targets)
        if base_name is None:
            raise AdapterError(f"adapter {path} has LoRA weights for {name!r}, which is not a linear layer of the base model")
        ref = targets[base_name].weight
        if not isinstance(ref, torch.Tensor):
            raise AdapterError(f"{name}: the base model's {base_name} has no weight tensor")
        a, b = parts.get("lora_A"), parts.get("lora_B")
        if a is None or b is None or a.dim() != 2 or b.dim() != 2:
            raise AdapterError(f"{name}: need 2-D lora_A and lora_B")
        rank = int(a.shape[0])
        out_f, in_f = int(ref.shape[0]), int(ref.shape[1])
        if tuple(a.shape) != (rank, in_f) or tuple(b.shape) != (out_f, rank):
            raise AdapterError(f"{name}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit a {in_f}→{out_f} linear with rank {rank}")
        declared = int(_pattern_value(rank_pattern, base_name, config.get("r", rank)))
        if declared != rank:
            raise AdapterError(f"{name}: weights have rank {rank} but the config says r={declared}")
        alpha = float(_pattern_value(alpha_pattern, base_name, config.get("lora_alpha", rank)))
        scale = alpha / math.sqrt(rank) if use_rslora else alpha / rank
        with torch.no_grad():
            a_t = a.to(device=ref.device, dtype=torch.float32).t().contiguous().to(ref.dtype)  # (in, r)
            b_t = (b.to(device=ref.device, dtype=torch.float32) * scale).t().contiguous().to(ref.dtype)  # (r, out)
        _check_finite(b_t, f"{name}: lora_B times its scale {scale:g} in {ref.dtype}")
        _check_finite(a_t, f"{name}: lora_A in {ref.dtype}")
        modules[base_name] = LoraModule(a_t, b_t, rank, scale)
    return LoraWeights(modules, config)


def _check_finite(tensor: torch.Tensor, what: str) -> None:
    """``AdapterError`` unless every value of ``tensor`` is finite: one NaN weight makes every output of the adapter NaN."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise AdapterError(f"{what} holds {bad} non-finite value(s) (NaN or infinity)")
