"""LoRA adapter names, validation and the in-process adapter registry (SGLang ``lora_registry`` semantics).

What it does:

- ``AdapterRef``: an immutable, versioned adapter name ``family@N`` (``tools-agent@7``).
- ``parse_model_name``: turns a request's ``model`` (base name, ``family``, ``family@N`` or SGLang's
  ``base:adapter``) into what to route to.
- ``validate_adapter``: checks a PEFT LoRA folder against the base model *before* the engine is asked
  to load it (config, supported LoRA variant, rank, target modules, tensor shapes, readable safetensors, hashes, path escape).
- ``AdapterRegistry``: routing for one event loop. Registration only after a successful load, versions
  never reused for other weights, atomic alias flips, ``acquire``/``release`` around every request,
  unload only after in-flight requests drain, LRU eviction that skips pinned/in-flight/alias targets.

What it does not: load weights (the engine does, through ``load_fn``/``unload_fn``), speak HTTP, or pick
A/B arms. Importing it does not import torch or safetensors; ``validate_adapter`` imports safetensors lazily.

Errors::

    AdapterError(Exception)
    ├── AdapterNotFound     unknown name/alias, malformed model name, or removed from routing
    ├── AdapterExists       family@N already registered (versions are immutable)
    ├── AdapterInvalid      (also a ValueError) the folder fails validation; the message names the problem
    ├── AdapterInUse        alias target can't be unregistered; drain timed out
    └── AdapterCapacity     max_loaded reached and nothing is evictable

These are separate from ``runtime.engine.AdapterError`` (an engine failure); the HTTP layer maps both.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from runtime._files import sha256_file

logger = logging.getLogger(__name__)

FAMILY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_VERSION_RE = re.compile(r"^[1-9][0-9]*$")
_LORA_KEY_RE = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<part>lora_A|lora_B)(?:\.[^.]+)?\.weight$")
CONFIG_FILE, WEIGHTS_FILE, MANIFEST_FILE = "adapter_config.json", "adapter_model.safetensors", "manifest.json"


class AdapterError(Exception):
    """Base class of adapter naming, validation and registry errors."""


class AdapterNotFound(AdapterError):
    """No such adapter or alias is routable (or the model name is malformed)."""


class AdapterExists(AdapterError):
    """That ``family@N`` already names other weights; publish a new version."""


class AdapterInvalid(AdapterError, ValueError):
    """The adapter folder or name fails validation; the message names the problem."""


class AdapterInUse(AdapterError):
    """The adapter is an alias target, or its in-flight requests did not drain in time."""


class AdapterCapacity(AdapterError):
    """``max_loaded`` adapters are loaded and none can be evicted."""


@dataclass(frozen=True)
class AdapterRef:
    """One immutable adapter version; ``name`` (``family@version``) is its unique routing id."""

    family: str
    version: int
    path: str
    pinned: bool = False
    sha256: str | None = None

    def __post_init__(self) -> None:
        if not FAMILY_RE.match(self.family):
            raise AdapterInvalid(f"bad adapter family {self.family!r}: use 1-64 of [A-Za-z0-9_.-], starting alphanumeric")
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 1:
            raise AdapterInvalid(f"bad adapter version {self.version!r}: must be an integer >= 1")

    @property
    def name(self) -> str:
        return f"{self.family}@{self.version}"


def parse_model_name(model: str, base_name: str) -> tuple[str, str | None]:
    """``base`` → ("base", None); ``fam`` → ("alias", "fam"); ``fam@N`` → ("version", "fam@N").

    SGLang's ``base:adapter`` is accepted when it starts with ``base_name + ":"``; the adapter part is
    resolved the same way. Anything else raises ``AdapterNotFound``.
    """
    if model == base_name:
        return "base", None
    rest = model[len(base_name) + 1 :] if model.startswith(base_name + ":") else model
    family, at, version = rest.partition("@")
    if FAMILY_RE.match(family) and (not at or _VERSION_RE.match(version)):
        return ("version", f"{family}@{int(version)}") if at else ("alias", family)
    raise AdapterNotFound(f"model {model!r} is neither {base_name!r}, an adapter family, family@N, nor {base_name}:<adapter>")


# ---------------------------------------------------------------- validation
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
    "sha256"}]}``, written last by the publisher) every listed file must match it, the weights file must be
    listed, and ``expected_sha256`` is the manifest's own hash; without a manifest ``expected_sha256`` is
    the hash of ``adapter_model.safetensors``. Embedding LoRA tensors are not shape-checked.
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
        config = json.loads(cfg_path.read_text())
    except (ValueError, OSError) as exc:
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
        files = json.loads(manifest.read_text())["files"]
        listed = dict(files) if isinstance(files, dict) else {e["path"]: e["sha256"] for e in files}
    except (ValueError, KeyError, TypeError) as exc:
        raise AdapterInvalid(f"{MANIFEST_FILE} is malformed (want {{'files': {{path: sha256}}}}): {exc}") from exc
    if WEIGHTS_FILE not in listed:
        raise AdapterInvalid(f"{MANIFEST_FILE} does not list {WEIGHTS_FILE}")
    for rel, digest in listed.items():
        file = _inside(root / rel, root, f"{MANIFEST_FILE} entry")
        if not file.is_file() or sha256_file(file) != str(digest).lower():
            raise AdapterInvalid(f"{rel} is missing or does not match its sha256 in {MANIFEST_FILE}")


# ---------------------------------------------------------------- registry
class RegistryListener(Protocol):
    """Told of each change to routing (synchronously, on the registry's loop: it must not block)."""

    def registered(self, ref: AdapterRef, made_alias: bool) -> None: ...
    def unregistered(self, name: str) -> None: ...
    def alias_set(self, family: str, target_name: str) -> None: ...


@dataclass
class _Entry:
    ref: AdapterRef
    in_flight: int = 0
    tick: int = 0  # LRU order
    last_used: float | None = None
    drained: asyncio.Event | None = None  # set while unregistering


class AdapterRegistry:
    """Which adapter versions are loaded and routable, for one asyncio event loop.

    Concurrency invariant: every check and the routing change it guards happen in one synchronous step
    (no ``await`` in between), so on a single loop they are atomic. ``acquire`` is synchronous: resolving
    a name and incrementing its in-flight count can't interleave with ``unregister``/eviction, which
    remove a name from routing synchronously *before* awaiting the drain or ``unload_fn``. So a request
    either is counted before removal (and unload waits for it) or fails with ``AdapterNotFound``; it
    never holds a version that gets unloaded under it. (SGLang's async ``acquire`` needs its writer lock
    for the same guarantee.) ``_lock`` serialises the engine calls (``load_fn``/``unload_fn``) and the
    checks that precede them; draining waits outside it.
    """

    def __init__(self, *, max_loaded: int, load_fn: Callable[[AdapterRef], Awaitable[None]], unload_fn: Callable[[str], Awaitable[None]]) -> None:
        if max_loaded < 1:
            raise ValueError(f"max_loaded must be >= 1, got {max_loaded}")
        self.max_loaded, self._load_fn, self._unload_fn = max_loaded, load_fn, unload_fn
        self._routed: dict[str, _Entry] = {}  # name -> entry, routable
        self._draining: dict[str, _Entry] = {}  # removed from routing, still loaded in the engine
        self._retired: dict[str, AdapterRef] = {}  # unloaded; the name may only come back with the same files
        self._aliases: dict[str, str] = {}  # family -> name
        self._tick = 0
        self._lock = asyncio.Lock()
        # told of every change made with notify=True (runtime/registry_sync.py writes them to a shared store)
        self.listener: RegistryListener | None = None

    def next_version(self, family: str) -> int:
        seen = [e.ref for e in (*self._routed.values(), *self._draining.values())] + [*self._retired.values()]
        return max((r.version for r in seen if r.family == family), default=0) + 1

    async def register(self, ref: AdapterRef, *, make_alias: bool = False, notify: bool = True) -> AdapterRef:
        async with self._lock:
            name = ref.name
            if name in self._routed or name in self._draining:
                raise AdapterExists(f"{name} is already registered; versions are immutable, use {ref.family}@{self.next_version(ref.family)}")
            old = self._retired.get(name)
            if old is not None and (old.path, old.sha256) != (ref.path, ref.sha256):
                raise AdapterExists(f"{name} was served before from other files; use {ref.family}@{self.next_version(ref.family)}")
            if len(self._routed) + len(self._draining) >= self.max_loaded:
                victim = self._pick_victim()
                del self._routed[victim.ref.name]  # out of routing before the await (see class docstring)
                logger.info("evicting adapter %s (least recently used)", victim.ref.name)
                await self._unload(victim.ref)
            await self._load_fn(ref)  # raises → never registered
            self._retired.pop(name, None)
            self._routed[name] = _Entry(ref, tick=self._next_tick())
            if make_alias:
                self._aliases[ref.family] = name
            if notify and self.listener is not None:
                self.listener.registered(ref, make_alias)
            return ref

    def _pick_victim(self) -> _Entry:
        targets = set(self._aliases.values())
        candidates = [e for n, e in self._routed.items() if not e.ref.pinned and e.in_flight == 0 and n not in targets]
        if not candidates:
            raise AdapterCapacity(
                f"{self.max_loaded} adapters loaded ({len(self._draining)} draining) and none is evictable "
                "(all pinned, in flight or alias targets); unregister one or raise max_loaded"
            )
        return min(candidates, key=lambda e: e.tick)

    async def _unload(self, ref: AdapterRef) -> None:
        self._retired[ref.name] = ref
        await self._unload_fn(ref.name)

    def set_alias(self, family: str, target_name: str, *, notify: bool = True) -> None:
        entry = self._routed.get(target_name)
        if entry is None:
            raise AdapterNotFound(f"alias target {target_name} is not registered")
        if entry.ref.family != family:
            raise AdapterInvalid(f"alias {family!r} can only point at {family}@N, not {target_name}")
        self._aliases[family] = target_name  # one assignment: requests see the old or the new target
        if notify and self.listener is not None:
            self.listener.alias_set(family, target_name)

    def remove_alias(self, family: str) -> None:
        if self._aliases.pop(family, None) is None:
            raise AdapterNotFound(f"no alias {family!r}")

    def resolve(self, name_or_alias: str) -> AdapterRef:
        name = name_or_alias if "@" in name_or_alias else self._aliases.get(name_or_alias)
        entry = self._routed.get(name) if name else None
        if entry is None:
            raise AdapterNotFound(f"adapter {name_or_alias!r} is not loaded")
        return entry.ref

    def acquire(self, name_or_alias: str) -> AdapterRef:
        # Synchronous on purpose: resolve + increment are atomic w.r.t. unregister/eviction (class docstring).
        ref = self.resolve(name_or_alias)
        entry = self._routed[ref.name]
        entry.in_flight += 1
        entry.tick, entry.last_used = self._next_tick(), time.time()
        return ref

    def release(self, ref: AdapterRef) -> None:
        entry = self._routed.get(ref.name) or self._draining.get(ref.name)
        if entry is None or entry.in_flight <= 0:
            raise AdapterError(f"release of {ref.name} without a matching acquire")
        entry.in_flight -= 1
        if entry.in_flight == 0 and entry.drained is not None:
            entry.drained.set()

    @contextlib.asynccontextmanager
    async def lease(self, name_or_alias: str) -> AsyncIterator[AdapterRef]:
        ref = self.acquire(name_or_alias)
        try:
            yield ref
        finally:
            self.release(ref)

    async def unregister(self, name: str, *, timeout: float = 30, notify: bool = True) -> None:
        """Stop routing ``name`` now, wait for its in-flight requests, then unload it from the engine.

        If the drain takes longer than ``timeout`` (or the call is cancelled) the adapter goes back into
        routing, since it is still loaded, and ``AdapterInUse`` is raised. An ``unload_fn`` error propagates
        after the adapter has left the registry.
        """
        async with self._lock:
            entry = self._routed.get(name)
            if entry is None:
                raise AdapterNotFound(f"adapter {name!r} is not registered")
            aliases = sorted(a for a, t in self._aliases.items() if t == name)
            if aliases:
                raise AdapterInUse(f"{name} is the target of alias(es) {aliases}; move or remove the alias first")
            del self._routed[name]  # same step as the checks: no new acquires from here on
            if notify and self.listener is not None:
                self.listener.unregistered(name)
            self._draining[name] = entry
            entry.drained = asyncio.Event()
            if entry.in_flight == 0:
                entry.drained.set()
        try:
            await asyncio.wait_for(entry.drained.wait(), timeout)
        except BaseException as exc:  # timed out or cancelled: it is still loaded, so route it again
            del self._draining[name]
            entry.drained = None
            self._routed[name] = entry
            if isinstance(exc, TimeoutError):
                raise AdapterInUse(f"{name} still has {entry.in_flight} request(s) in flight after {timeout}s; left loaded") from None
            raise
        async with self._lock:
            del self._draining[name]
            await self._unload(entry.ref)

    def aliases(self) -> dict[str, str]:
        return dict(self._aliases)

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def list(self) -> builtins.list[dict[str, Any]]:
        """One row per loaded adapter (routable ones first, then those draining towards unload)."""
        rows = [(e, "ready") for e in self._routed.values()] + [(e, "draining") for e in self._draining.values()]
        return [
            dict(
                name=e.ref.name,
                family=e.ref.family,
                version=e.ref.version,
                path=e.ref.path,
                pinned=e.ref.pinned,
                in_flight=e.in_flight,
                aliases=sorted(a for a, t in self._aliases.items() if t == e.ref.name),
                last_used=e.last_used,
                state=state,
            )
            for e, state in rows
        ]
