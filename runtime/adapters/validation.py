"""Checks a PEFT LoRA folder against the base model *before* the engine is asked to load it.

What it does: ``validate_adapter`` reads ``adapter_config.json`` (at most ``runtime.json_text.MAX_DEPTH`` levels deep and
``MAX_CONFIG_BYTES`` long; a supported LoRA variant, rank within the server's maximum, finite scales, target
modules that exist in the base model), the tensor shapes in ``adapter_model.safetensors`` against the base
model's linear layers (``base_shapes_of``), that every floating-point tensor holds only finite values (one NaN
weight makes the outputs of every request on the adapter NaN), the hashes in the
publisher's ``manifest.json`` (or of the weights file alone), and that no path escapes the adapter root.
``resolve_adapter_path`` and ``unsupported_lora_features`` are the pieces other modules reuse. ``adapter_validator``
is the check the admin API's loads and the shared store's sync both run (off the event loop) before a load.

What it does not: load or route anything (``runtime/adapters/registry.py``), or parse model names
(``runtime/adapters/names.py``). Importing it does not import torch or safetensors; ``validate_adapter``
imports safetensors and numpy when it reads a weights file. It reads every weight once: call it off the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import re
import struct
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from learner.records.adapter_manifest import CONFIG_FILE, MANIFEST_FILE, WEIGHTS_FILE, AdapterManifest, ManifestError, sha256_file
from runtime.adapters.names import AdapterInvalid, AdapterRef
from runtime.json_text import read_json_file

logger = logging.getLogger(__name__)

_LORA_KEY_RE = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<part>lora_A|lora_B)(?:\.[^.]+)?\.weight$")


def base_shapes_of(model: Any) -> dict[str, tuple[int, int]]:
    """``{module name: (out_features, in_features)}`` for every linear-like module of a loaded model."""
    return {
        name: (int(m.out_features), int(m.in_features))
        for name, m in model.named_modules()
        if name and hasattr(m, "in_features") and hasattr(m, "out_features")
    }


MAX_PATH_CHARS = 4096
MAX_PATTERN_CHARS = 256  # a target_modules regex or a rank/alpha pattern key
MAX_ALPHA = 65536.0
MAX_CONFIG_BYTES = 1024 * 1024  # adapter_config.json: a few kilobytes in practice


def _inside(path: Path, root: Path | None, what: str) -> Path:
    text = str(path)
    if "\x00" in text or len(text) > MAX_PATH_CHARS:
        raise AdapterInvalid(f"{what} must be at most {MAX_PATH_CHARS} characters without NUL bytes")
    try:
        resolved = path.resolve()
    except (OSError, ValueError, RuntimeError) as exc:  # too long, a symlink loop, ...
        raise AdapterInvalid(f"{what} {text[:200]!r} cannot be resolved: {exc}") from None
    if root is not None and not resolved.is_relative_to(root.resolve()):
        raise AdapterInvalid(f"{what} {path} resolves to {resolved}, outside the adapter root {root}")
    return resolved


def resolve_adapter_path(path: Path, adapter_root: Path | None) -> Path:
    """The absolute, symlink-free folder ``path`` names (inside ``adapter_root`` when given); ``AdapterInvalid`` if unusable."""
    return _inside(Path(path), adapter_root, "adapter path")


def _base_module(name: str, base_shapes: Mapping[str, tuple[int, int]]) -> str | None:
    if name in base_shapes:
        return name
    hits = [b for b in base_shapes if b.endswith("." + name) or name.endswith("." + b)]
    return hits[0] if len(hits) == 1 else None


# LoRA variants the embedded engine does not serve (nor SGLang's LoRA manager): config key → why.
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora) needs a magnitude vector per module",
    "modules_to_save": "modules_to_save replaces whole base modules",
    "lora_bias": "lora_bias adds a bias to lora_B",
    "trainable_token_indices": "trainable_token_indices changes embedding rows",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "target_parameters": "target_parameters (LoRA on raw parameters)",
    "layer_replication": "layer_replication changes the base model's layers",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "KaSA (kasa_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "velora_config": "VeLoRA (velora_config)",
}


def unsupported_lora_features(config: Mapping[str, Any]) -> list[str]:
    """What in a PEFT LoRA config cannot be served as plain ``y += scale * B(A(x))``; empty when servable."""
    bad = [why for key, why in _UNSUPPORTED.items() if config.get(key)]
    if config.get("bias", "none") != "none":
        bad.append(f"bias={config.get('bias')!r} trains base-model biases")
    return bad


def validate_adapter(
    path: Path,
    *,
    base_shapes: Mapping[str, tuple[int, int]],
    max_rank: int,
    adapter_root: Path | None = None,
    base_name_or_path: str | None = None,
    expected_sha256: str | None = None,
) -> dict[str, Any]:
    """Check a PEFT LoRA folder against the base model; return its parsed ``adapter_config.json``.

    ``base_shapes`` maps every base module name to ``(out_features, in_features)`` (see
    ``base_shapes_of``); its keys are also the names ``target_modules`` must match (by suffix, or by
    ``re.fullmatch`` when ``target_modules`` is a string, as in PEFT). A ``base_model_name_or_path`` that
    differs from ``base_name_or_path`` only logs a warning: paths differ between machines.

    Hashes: when ``manifest.json`` exists (``{"files": {relpath: sha256}}`` or ``{"files": [{"path",
    "sha256"}]}``, written last by the publisher; the model is ``learner.records.adapter_manifest.AdapterManifest``)
    every listed file must match it, the weights file must be listed, and ``expected_sha256`` is the manifest's
    own hash; without a manifest ``expected_sha256`` is the hash of ``adapter_model.safetensors``. Embedding LoRA tensors are not shape-checked.
    """
    path = Path(path)
    root = _inside(path, adapter_root, "adapter path")
    try:
        root.exists()
    except OSError as exc:
        raise AdapterInvalid(f"adapter path {str(path)[:200]!r} is unusable: {exc.strerror}") from None
    if not root.exists():
        raise AdapterInvalid(f"adapter path {path} does not exist")
    if not root.is_dir():
        raise AdapterInvalid(f"adapter path {path} is not a directory")
    cfg_path, weights = _inside(root / CONFIG_FILE, adapter_root, CONFIG_FILE), _inside(root / WEIGHTS_FILE, adapter_root, WEIGHTS_FILE)
    if not cfg_path.is_file():
        raise AdapterInvalid(f"{path} has no {CONFIG_FILE}")
    try:
        config = read_json_file(cfg_path, max_bytes=MAX_CONFIG_BYTES)
    except (ValueError, OSError) as exc:  # invalid JSON, or over the depth/size limits (JSONLimitExceeded)
        raise AdapterInvalid(f"{CONFIG_FILE} in {path} is not a JSON object: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterInvalid(f"{CONFIG_FILE} in {path} is not a JSON object")
    if config.get("peft_type") != "LORA":
        raise AdapterInvalid(f"peft_type is {config.get('peft_type')!r}; only 'LORA' adapters are served")
    if bad := unsupported_lora_features(config):
        raise AdapterInvalid(f"adapter {path} uses LoRA features that are not served: {'; '.join(bad)}")
    ranks = [config.get("r"), *(config.get("rank_pattern") or {}).values()]
    if not all(isinstance(r, int) and 0 < r for r in ranks):
        raise AdapterInvalid(f"LoRA rank {config.get('r')!r} (rank_pattern {config.get('rank_pattern')}) is not a positive integer")
    if max(ranks) > max_rank:
        raise AdapterInvalid(f"LoRA rank {max(ranks)} exceeds the server's max rank {max_rank}")
    _check_scales(config)
    declared = config.get("base_model_name_or_path")
    if base_name_or_path and declared and declared != base_name_or_path:
        logger.warning("adapter %s was trained on %r; serving it on %r", path, declared, base_name_or_path)
    targets = config.get("target_modules")
    if isinstance(targets, str):
        _check_pattern(targets, "target_modules")
        if not any(re.fullmatch(targets, m) for m in base_shapes):
            raise AdapterInvalid(f"target_modules regex {targets!r} matches no module of the base model")
    elif not targets or not isinstance(targets, list):
        raise AdapterInvalid(f"target_modules must be a non-empty list or a regex, got {targets!r}")
    else:
        missing = [t for t in targets if not any(m == t or m.endswith("." + str(t)) for m in base_shapes)]
        if missing:
            raise AdapterInvalid(f"target_modules {missing} match no module of the base model")
    if not weights.is_file():
        raise AdapterInvalid(f"{path} has no {WEIGHTS_FILE}")
    _check_tensors(weights, base_shapes)
    _check_hashes(root, weights, adapter_root, expected_sha256)
    return config


def adapter_validator(
    base_shapes: Callable[[], dict[str, tuple[int, int]]], adapter_root: Path | None, max_rank: int
) -> Callable[[AdapterRef], Awaitable[AdapterRef]]:
    """``await validated(ref)``: ``ref`` with its path resolved (inside ``adapter_root``) once the folder passed
    ``validate_adapter`` (off the event loop); ``AdapterInvalid`` otherwise. The admin API's loads and the shared
    store's sync (``runtime/adapters/sync.py``) both go through it."""

    async def validated(ref: AdapterRef) -> AdapterRef:
        resolved = resolve_adapter_path(Path(ref.path), adapter_root)
        await asyncio.to_thread(
            validate_adapter, resolved, base_shapes=base_shapes(), max_rank=max_rank, adapter_root=adapter_root, expected_sha256=ref.sha256
        )
        # the engine loads the folder that was validated, never the path as given (a swapped symlink would choose)
        return dataclasses.replace(ref, path=str(resolved))

    return validated


def _check_pattern(pattern: str, what: str) -> None:
    if len(pattern) > MAX_PATTERN_CHARS:
        raise AdapterInvalid(f"{what} pattern is longer than {MAX_PATTERN_CHARS} characters")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise AdapterInvalid(f"{what} pattern {pattern!r} is not a valid regular expression: {exc}") from None


def _check_scales(config: Mapping[str, Any]) -> None:
    """``lora_alpha`` and ``alpha_pattern`` values are finite numbers within ``MAX_ALPHA`` (the scale is alpha / r:
    NaN or 1e30 would make every output of the adapter NaN); pattern keys are valid, short regular expressions."""
    alphas = [("lora_alpha", config.get("lora_alpha", 8))]
    for field in ("alpha_pattern", "rank_pattern"):
        patterns = config.get(field) or {}
        if not isinstance(patterns, dict):
            raise AdapterInvalid(f"{field} must be an object of pattern: value")
        for key in patterns:
            _check_pattern(str(key), field)
        if field == "alpha_pattern":
            alphas += [(field, v) for v in patterns.values()]
    for field, alpha in alphas:
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha) or abs(alpha) > MAX_ALPHA:
            raise AdapterInvalid(f"{field} must be a finite number of at most {MAX_ALPHA:g} in magnitude, got {alpha!r}")


def _check_tensors(weights: Path, base_shapes: Mapping[str, tuple[int, int]]) -> None:
    from safetensors import safe_open  # lazy: keeps the module import light

    try:
        with safe_open(str(weights), framework="numpy") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as exc:  # SafetensorError, OSError, ...: all mean "can't read it"
        raise AdapterInvalid(f"{WEIGHTS_FILE} is unreadable or corrupt: {exc}") from exc
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        if m := _LORA_KEY_RE.match(key):
            pairs.setdefault(m["module"], {})[m["part"]] = shape
    if not pairs:
        raise AdapterInvalid(f"{WEIGHTS_FILE} holds no lora_A/lora_B weights")
    for module, parts in pairs.items():
        base = _base_module(module, base_shapes)
        if base is None:
            raise AdapterInvalid(f"{WEIGHTS_FILE} has LoRA weights for {module!r}, which is not a module of the base model")
        a, b = parts.get("lora_A"), parts.get("lora_B")
        if a is None or b is None or len(a) != 2 or len(b) != 2:
            raise AdapterInvalid(f"{module}: need 2-D lora_A and lora_B, got lora_A={a} lora_B={b}")
        out_f, in_f = base_shapes[base]
        if a[1] != in_f:
            raise AdapterInvalid(f"{module}: lora_A in-features {a[1]} != base in-features {in_f} (built for another base model?)")
        if b[0] != out_f:
            raise AdapterInvalid(f"{module}: lora_B out-features {b[0]} != base out-features {out_f} (built for another base model?)")
        if a[0] != b[1]:
            raise AdapterInvalid(f"{module}: lora_A rank {a[0]} != lora_B rank {b[1]}")
    _check_finite(weights)


# float dtype of safetensors → (unsigned view, exponent mask): all exponent bits set is an infinity or a NaN
_EXPONENT_BITS = {"F16": ("<u2", 0x7C00), "BF16": ("<u2", 0x7F80), "F32": ("<u4", 0x7F800000), "F64": ("<u8", 0x7FF0000000000000)}


_FINITE_CHUNK_BYTES = 16 << 20  # bytes checked per numpy call: bounds the temporaries for a large adapter


def _check_finite(weights: Path) -> None:
    """Every F16/BF16/F32/F64 tensor holds only finite values, read from the bits (numpy has no bfloat16).

    Tensors that lie back to back in one dtype are checked as one run, a few numpy calls per 16 MiB: each call
    releases the GIL and must win it back, and a worker thread beside a busy event loop waits up to the switch
    interval (5 ms) each time, so a check per tensor (hundreds of them) took 0.6 s where it needs 6 ms. Only a run
    with a bad value is gone through tensor by tensor, to name it. Runs after ``safe_open`` accepted the file, so
    the header parses and its offsets lie inside the file."""
    import numpy as np  # lazy, as safetensors

    with open(weights, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    data = np.memmap(weights, dtype=np.uint8, mode="r", offset=8 + size)
    tensors = sorted(
        (info["data_offsets"][0], info["data_offsets"][1], info["dtype"], key)
        for key, info in header.items()
        if key != "__metadata__" and info["dtype"] in _EXPONENT_BITS
    )
    runs: list[tuple[str, int, int, list[str]]] = []  # (dtype, start, end, keys), each run contiguous in one dtype
    for start, end, dtype, key in tensors:
        if runs and runs[-1][0] == dtype and runs[-1][2] == start:
            runs[-1] = (dtype, runs[-1][1], end, [*runs[-1][3], key])
        else:
            runs.append((dtype, start, end, [key]))

    def non_finite(dtype: str, start: int, end: int) -> int:
        view, mask = _EXPONENT_BITS[dtype]
        step = _FINITE_CHUNK_BYTES - _FINITE_CHUNK_BYTES % np.dtype(view).itemsize
        bad = 0
        for lo in range(start, end, step):
            words = data[lo : min(end, lo + step)].view(view)
            bad += int(np.count_nonzero(np.bitwise_and(words, mask) == mask))
        return bad

    for dtype, start, end, keys in runs:
        if not non_finite(dtype, start, end):
            continue
        for key in keys:
            lo, hi = header[key]["data_offsets"]
            if bad := non_finite(dtype, lo, hi):
                raise AdapterInvalid(f"{WEIGHTS_FILE}: tensor {key!r} holds {bad} non-finite value(s) (NaN or infinity)")


def _check_hashes(root: Path, weights: Path, adapter_root: Path | None, expected: str | None) -> None:
    manifest = root / MANIFEST_FILE
    if not manifest.exists():
        if expected and sha256_file(weights) != expected.lower():
            raise AdapterInvalid(f"sha256 of {WEIGHTS_FILE} does not match the expected {expected}")
        return
    manifest = _inside(manifest, adapter_root, MANIFEST_FILE)
    if expected and sha256_file(manifest) != expected.lower():
        raise AdapterInvalid(f"sha256 of {MANIFEST_FILE} does not match the expected {expected}")
    try:
        listed = AdapterManifest.read(manifest)
    except ManifestError as exc:
        raise AdapterInvalid(str(exc)) from exc
    if WEIGHTS_FILE not in listed.files:
        raise AdapterInvalid(f"{MANIFEST_FILE} does not list {WEIGHTS_FILE}")
    for rel in listed.files:
        _inside(root / rel, root, f"{MANIFEST_FILE} entry")
    bad = listed.mismatched(root)
    if bad:
        raise AdapterInvalid(f"{bad[0]} is missing or does not match its sha256 in {MANIFEST_FILE}")
