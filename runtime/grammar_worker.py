"""Grammar compilation in a child process that a deadline can kill, with a bounded cache of compiled grammars.

xgrammar compiles in C++ and cannot be interrupted: a grammar bomb (a ``[a-z]{0,10000}`` pattern took 25 s
here) abandoned by a thread keeps a core busy long after its request gave up. :class:`GrammarWorker` sends
each compilation to one child process (``spawn``: a clean interpreter with xgrammar, at nice 10, its address
space capped at ``memory_mb``), waits at most the deadline, and kills and replaces the child when it passes,
so an abandoned compilation costs nothing further. The compiled grammar comes back serialized
(``CompiledGrammar.serialize_json``) and is cached in this process, least recently used out beyond
``cache_bytes``.

The child starts on the first compilation (a server that never sees a grammar never starts one); starting
it (importing xgrammar, which imports torch) takes seconds and is not charged to the request's deadline.

Not here: which grammar a request needs (``runtime/constraints.py``), the deadline's value and the HTTP
answer (``runtime/admission.py``), matching during decoding (the engine).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from collections import OrderedDict
from multiprocessing.connection import Connection
from typing import Any

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # importing xgrammar (and torch) in a fresh interpreter on a loaded machine


class GrammarTimeout(TimeoutError):
    """The compilation did not finish within its deadline (the child was killed)."""


class GrammarInvalid(ValueError):
    """xgrammar refused the grammar (a malformed schema or EBNF)."""


def compile_grammar(compiler: Any, kind: str, spec: str) -> Any:
    """Compile one constraint with an ``xgrammar.GrammarCompiler`` (JSON generated compactly)."""
    if kind == "json_object":
        # a JSON object, generated compactly (the builtin JSON grammar also admits arrays and free whitespace)
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "json_schema":
        return compiler.compile_json_schema(spec, any_whitespace=False)
    return compiler.compile_grammar(spec)


def _serve(conn: Connection, tokenizer_info_json: str, memory_mb: int) -> None:  # the child
    import resource

    try:
        os.nice(10)
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    except (OSError, ValueError):
        pass
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(("ready", ""))
    while True:
        try:
            kind, spec = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", compile_grammar(compiler, kind, spec).serialize_json()))
        except MemoryError:
            conn.send(("error", f"the grammar needs more than {memory_mb} MB to compile"))
        except Exception as exc:  # xgrammar's RuntimeError/ValueError: the grammar is malformed
            conn.send(("error", str(exc)))


class GrammarWorker:
    """Compiles grammars in a killable child process; thread-safe (one compilation at a time)."""

    def __init__(self, tokenizer_info: Any, *, cache_bytes: int = 256 << 20, memory_mb: int = 4096) -> None:
        self._info = tokenizer_info
        self._info_json = tokenizer_info.serialize_json()
        self.cache_bytes, self.memory_mb = cache_bytes, memory_mb
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self._proc: Any = None
        self._conn: Connection | None = None
        self.compiles = self.kills = 0

    def compile(self, kind: str, spec: str, timeout_s: float) -> Any:
        """The compiled grammar (cached), or ``GrammarTimeout`` / ``GrammarInvalid``."""
        key = (kind, spec)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            conn = self._ensure_started()
            conn.send(key)
            if not conn.poll(timeout_s):
                self._kill()
                raise GrammarTimeout(f"grammar compilation took longer than {timeout_s:g} s")
            try:
                status, payload = conn.recv()
            except EOFError:  # the child died (e.g. killed by the kernel for memory)
                self._kill()
                raise GrammarInvalid("the grammar could not be compiled (the compiler ran out of memory)") from None
            if status != "ok":
                raise GrammarInvalid(payload)
            import xgrammar as xgr

            compiled = xgr.CompiledGrammar.deserialize_json(payload, self._info)
            self.compiles += 1
            self._remember(key, compiled)
            return compiled

    def _remember(self, key: tuple[str, str], compiled: Any) -> None:
        size = int(compiled.memory_size_bytes)
        if size > self.cache_bytes:
            return  # larger than the whole cache: used once, never kept
        self._cache[key] = compiled
        self._cached_bytes += size
        while self._cached_bytes > self.cache_bytes:
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= int(old.memory_size_bytes)

    def _ensure_started(self) -> Connection:
        if self._conn is not None and self._proc is not None and self._proc.is_alive():
            return self._conn
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, self._info_json, self.memory_mb), name="loopwise-grammar-worker", daemon=True)
        proc.start()
        child.close()
        if not parent.poll(START_TIMEOUT_S) or parent.recv()[0] != "ready":
            proc.kill()
            raise GrammarTimeout("the grammar worker did not start")
        self._proc, self._conn = proc, parent
        return parent

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(timeout=10)
            self.kills += 1
            log.warning("the grammar worker was killed (a compilation passed its deadline, or it died); a new one starts on demand")
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._proc.kill()
                self._proc.join(timeout=10)
            if self._conn is not None:
                self._conn.close()
            self._proc = self._conn = None
