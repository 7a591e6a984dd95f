"""Compile, check and time one CUDA kernel: ``cuda_compile``, ``cuda_check``, ``cuda_bench``.

    r = cuda_compile(source)                                        # nvcc -c; r.ok, r.diagnostics, r.summary()
    r = cuda_check(source, "agents.tasks.kernels.level1.relu")      # r.measured, r.correct, r.max_abs_err
    r = cuda_bench(source, "/path/to/reference.py")                 # r.kernel_ms, r.eager_ms, r.speedup

A candidate is one CUDA C++ source that ``#include <torch/extension.h>``, defines ``forward(...)``
returning a ``torch::Tensor`` and binds it with ``PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("forward",
&forward); }``. The reference (a dotted module path or a ``.py`` file, KernelBench style) defines
``Model(nn.Module)``, ``get_inputs()`` and ``get_init_inputs()``; the candidate is called as
``ext.forward(*inputs, *model.parameters(), *model.buffers())`` and compared with ``model(*inputs)``.

Isolation, per tool (details in ``tools.cuda.process``): every run is a separate process in a fresh
temporary folder, with an environment built from scratch, in user/network/PID namespaces where the
machine allows, killed with its whole process tree at ``timeout_s``.

- ``cuda_compile``: nvcc (and its cudafe++/cicc/ptxas/gcc children) under ``RLIMIT_AS`` = 16 GiB and
  ``RLIMIT_CPU`` = the timeout; the object is written to the temporary folder and discarded.
- ``cuda_check``/``cuda_bench``: the server's own interpreter (it has torch) runs ``tools/cuda/_harness.py``
  with ``-I``; no ``RLIMIT_AS`` (CUDA reserves huge virtual ranges). The extension is built by
  ``torch.utils.cpp_extension.load`` in a per-source build folder under a cache directory
  (``LOOPWISE_CUDA_CACHE``, default ``<tmp>/loopwise-cuda-<uid>``, mode 0700), named by the hash of the
  source and architecture, so ``cuda_bench`` after ``cuda_check`` of the same source does not build again.

Without a CUDA device (a CPU-only torch build, read from its ``version.py``, or ``torch.cuda.is_available()``
false in the confined harness; asked once per process)
``cuda_check``/``cuda_bench`` still run ``cuda_compile``, so compile errors are reported, and return
``measured=False`` with the reason; they never guess correctness or speed. A source that does not compile
is ``correct=False`` on any machine (that much is known without a GPU).

What this does not do: it does not protect the GPU from a kernel (a hung kernel holds the device until the
timeout kills its process; other work on the same GPU is slowed meanwhile), it does not check more than one
seeded input set, and it does not flush caches between timed repeats (as KernelBench; small kernels look
faster than they would in a model).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from tools.cuda.diagnostics import Diagnostic, count, parse_diagnostics
from tools.cuda.process import ProcessResult, base_env, run_confined
from tools.cuda.toolchain import find_toolchain, normalise_arch, nvcc_command, torch_arch_list, torch_build_info

log = structlog.get_logger(__name__)

_HARNESS = Path(__file__).with_name("_harness.py")
_SOURCE_NAME = "kernel.cu"
_LOG_CHARS = 20_000
_COMPILE_AS_MB = 16 << 10
_DOTTED_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
NO_DEVICE = "no CUDA device: correctness not measured"
NO_DEVICE_BENCH = "no CUDA device: speed not measured"


def _truncate(text: str, limit: int = _LOG_CHARS) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n... [{len(text) - limit} characters cut] ...\n{text[-half:]}"


def _diag_lines(diagnostics: list[Diagnostic], limit: int = 8) -> list[str]:
    ranked = sorted(diagnostics, key=lambda d: {"error": 0, "warning": 1}.get(d.severity, 2))
    lines = [d.format() for d in ranked[:limit]]
    if len(ranked) > limit:
        lines.append(f"... and {len(ranked) - limit} more")
    return lines


@dataclass(frozen=True)
class CompileResult:
    ok: bool
    diagnostics: list[Diagnostic]
    log: str  # raw compiler output, truncated
    elapsed_s: float
    timed_out: bool
    command: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "diagnostics": [d.to_dict() for d in self.diagnostics],
            "log": self.log,
            "elapsed_s": round(self.elapsed_s, 3),
            "timed_out": self.timed_out,
            "command": self.command,
        }

    def summary(self) -> str:
        errors, warnings = count(self.diagnostics, "error"), count(self.diagnostics, "warning")
        if self.timed_out:
            head = f"compile timed out after {self.elapsed_s:.0f} s"
        elif self.ok:
            head = f"compiled OK in {self.elapsed_s:.1f} s" + (f" ({warnings} warning{'s' * (warnings != 1)})" if warnings else "")
        else:
            head = f"compile FAILED in {self.elapsed_s:.1f} s: {errors} error{'s' * (errors != 1)}, {warnings} warning{'s' * (warnings != 1)}"
        lines = [head, *_diag_lines(self.diagnostics)]
        if not self.ok and not self.timed_out and not errors:  # a failure without a parsable message: show the log's end
            lines.append(self.log.strip()[-1500:] or "(no compiler output)")
        return "\n".join(lines)


@dataclass(frozen=True)
class CheckResult:
    measured: bool  # the kernel ran on a GPU and was compared with the reference
    reason: str  # what happened, in words ("no CUDA device: correctness not measured" on CPU machines)
    compiled: bool
    correct: bool | None  # None when not measured; False also when the source does not compile
    max_abs_err: float | None
    diagnostics: list[Diagnostic]
    elapsed_s: float
    timed_out: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "measured": self.measured,
            "reason": self.reason,
            "compiled": self.compiled,
            "correct": self.correct,
            "max_abs_err": self.max_abs_err,
            "diagnostics": [d.to_dict() for d in self.diagnostics],
            "elapsed_s": round(self.elapsed_s, 3),
            "timed_out": self.timed_out,
        }

    def summary(self) -> str:
        if self.measured and self.correct:
            head = f"CORRECT (max abs error {self.max_abs_err:.3g})"
        elif self.measured and self.correct is False:
            err = f" (max abs error {self.max_abs_err:.3g})" if self.max_abs_err is not None else ""
            head = f"INCORRECT{err}: {self.reason}"
        elif not self.compiled:
            head = f"did not compile: {self.reason}"
        else:
            head = self.reason
        return "\n".join([head, *_diag_lines([d for d in self.diagnostics if d.severity == "error" or not self.compiled])])


@dataclass(frozen=True)
class BenchResult:
    measured: bool  # the kernel and eager PyTorch were timed on a GPU
    reason: str
    kernel_ms: float | None  # median over the repeats, CUDA events
    eager_ms: float | None
    speedup: float | None  # eager_ms / kernel_ms; None unless measured and correct
    correct: bool | None
    elapsed_s: float
    timed_out: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "measured": self.measured,
            "reason": self.reason,
            "kernel_ms": self.kernel_ms,
            "eager_ms": self.eager_ms,
            "speedup": self.speedup,
            "correct": self.correct,
            "elapsed_s": round(self.elapsed_s, 3),
            "timed_out": self.timed_out,
        }

    def summary(self) -> str:
        if self.measured and self.speedup is not None:
            return f"kernel {self.kernel_ms:.4f} ms vs eager PyTorch {self.eager_ms:.4f} ms: speedup {self.speedup:.2f}x (output correct)"
        if self.measured and self.kernel_ms is not None:
            return f"kernel {self.kernel_ms:.4f} ms vs eager PyTorch {self.eager_ms:.4f} ms, but {self.reason}"
        return self.reason


# -- helpers ------------------------------------------------------------------------------------------


def _ext_name(source: str, arch: str) -> str:
    digest = hashlib.sha256(f"{arch}\0{source}".encode()).hexdigest()[:20]
    return f"lw_{digest}"


def _check_source(source: str) -> None:
    if not isinstance(source, str) or not source.strip():
        raise ValueError("source is empty: pass the complete CUDA C++ file")


def resolve_reference(reference: str) -> str:
    """Check that ``reference`` names a module file (without importing it); return the file's path.

    A dotted path is looked up along ``sys.path`` (``a.b.c`` → ``a/b/c.py`` or ``a/b/c/__init__.py``);
    anything ending in ``.py`` is a file path. ``ValueError`` when it is neither.
    """
    if not isinstance(reference, str) or not reference.strip():
        raise ValueError("reference is empty: pass a dotted module path or a .py file")
    reference = reference.strip()
    if reference.endswith(".py"):
        path = Path(reference).expanduser()
        if not path.is_file():
            raise ValueError(f"reference file {reference!r} does not exist")
        return str(path.resolve())
    if not _DOTTED_RE.match(reference):
        raise ValueError(f"reference {reference!r} is neither a dotted module path nor a .py file")
    parts = reference.split(".")
    for entry in [os.getcwd(), *sys.path]:
        base = Path(entry or ".").joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return str(candidate.resolve())
    raise ValueError(f"reference module {reference!r} not found on the Python path")


def _cache_root() -> Path:
    root = Path(os.environ.get("LOOPWISE_CUDA_CACHE") or Path(tempfile.gettempdir()) / f"loopwise-cuda-{os.getuid()}")
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = root.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(f"the kernel build cache {root} must belong to this user and not be writable by others")
    return root


def _workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="loopwise-cuda-"))


# -- compile ------------------------------------------------------------------------------------------


def cuda_compile(source: str, *, arch: str | None = None, timeout_s: float = 180.0) -> CompileResult:
    """Compile one CUDA C++ source with nvcc (``-c``, torch's extension flags); never raises for compile errors."""
    _check_source(source)
    arch = normalise_arch(arch)
    if timeout_s <= 0:
        raise ValueError("timeout_s must be positive")
    tc = find_toolchain()
    if tc.nvcc is None:
        diag = Diagnostic(file="nvcc", line=None, severity="error", message="nvcc not found: install the CUDA toolkit or set CUDA_HOME")
        return CompileResult(ok=False, diagnostics=[diag], log="", elapsed_s=0.0, timed_out=False, command=[])
    workdir = _workdir()
    try:
        (workdir / _SOURCE_NAME).write_text(source, encoding="utf-8")
        command = nvcc_command(tc, _SOURCE_NAME, "kernel.o", arch=arch, ext_name=_ext_name(source, arch))
        path = (os.path.join(tc.cuda_home, "bin") + ":" if tc.cuda_home else "") + base_env(workdir)["PATH"]
        env = base_env(workdir, {"PATH": path, **({"CUDA_HOME": tc.cuda_home} if tc.cuda_home else {})})
        proc = run_confined(command, cwd=workdir, env=env, timeout_s=timeout_s, address_space_mb=_COMPILE_AS_MB, max_processes=64)
        result = _compile_result(proc, command)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    log.info(
        "cuda_compile", ok=result.ok, errors=count(result.diagnostics, "error"), elapsed_s=round(result.elapsed_s, 2), timed_out=result.timed_out
    )
    return result


def _compile_result(proc: ProcessResult, command: list[str]) -> CompileResult:
    diagnostics = parse_diagnostics(proc.output)
    ok = proc.exit_code == 0 and not proc.timed_out and count(diagnostics, "error") == 0
    log_text = proc.output + ("\n[compiler output truncated]" if proc.output_truncated else "")
    if proc.signal is not None and not proc.timed_out:
        log_text += f"\n[the compiler was killed by signal {proc.signal}]"
    return CompileResult(ok=ok, diagnostics=diagnostics, log=_truncate(log_text), elapsed_s=proc.wall_s, timed_out=proc.timed_out, command=command)


# -- GPU harness --------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def cuda_device_available() -> tuple[bool, str]:
    """Whether torch sees a CUDA device, asked once per process; (available, detail).

    A CPU-only torch build (its ``version.py`` says ``cuda = None``) cannot see one, which is known without
    importing torch; otherwise the confined harness asks ``torch.cuda.is_available()``.
    """
    build = torch_build_info(find_toolchain().torch_dir)
    if build is not None and build["cuda"] is None:
        return False, f"torch {build.get('__version__')} is a CPU-only build"
    result, proc = _run_harness({"mode": "probe"}, timeout_s=180.0)
    if result is None:
        return False, f"the CUDA probe failed ({_process_failure(proc)})"
    if "harness_error" in result:
        return False, f"the CUDA probe failed: {result['harness_error']}"
    if result.get("cuda"):
        return True, str(result.get("device", "CUDA device"))
    detail = f"torch {result.get('torch')} (CUDA build: {result.get('torch_cuda') or 'none'})"
    if os.path.exists("/dev/nvidiactl"):
        detail += "; /dev/nvidiactl exists, so the host has a GPU that the tool's process cannot use (try LOOPWISE_CUDA_ISOLATION=none)"
    return False, detail


def _process_failure(proc: ProcessResult) -> str:
    if proc.timed_out:
        return f"timed out after {proc.wall_s:.0f} s"
    if proc.signal is not None:
        return f"killed by signal {proc.signal}"
    return f"exit code {proc.exit_code}: {proc.output.strip()[-500:]}"


def _run_harness(spec: dict[str, Any], *, timeout_s: float) -> tuple[dict[str, Any] | None, ProcessResult]:
    workdir = _workdir()
    try:
        full = {**spec, "sys_path": [os.getcwd(), *(p for p in sys.path if p)]}
        (workdir / "spec.json").write_text(json.dumps(full), encoding="utf-8")
        tc = find_toolchain()
        # cpp_extension.load needs ninja (the venv's, when pip installed it there) and nvcc on PATH.
        path = [os.path.dirname(sys.executable), base_env(workdir)["PATH"]]
        extra = {"MAX_JOBS": "1"}
        if tc.cuda_home:
            extra["CUDA_HOME"] = tc.cuda_home
            path.insert(0, os.path.join(tc.cuda_home, "bin"))
        extra["PATH"] = ":".join(path)
        if "arch" in spec:
            extra["TORCH_CUDA_ARCH_LIST"] = torch_arch_list(spec["arch"])
        argv = [sys.executable, "-I", str(_HARNESS), "spec.json", "result.json"]
        proc = run_confined(argv, cwd=workdir, env=base_env(workdir, extra), timeout_s=timeout_s, max_processes=4096)
        result_path = workdir / "result.json"
        result = json.loads(result_path.read_text(encoding="utf-8")) if result_path.is_file() else None
        return result, proc
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@dataclass(frozen=True)
class _Run:
    """What the harness reported for one check or bench, with the compile outcome folded in."""

    measured: bool
    reason: str
    compiled: bool
    correct: bool | None
    diagnostics: list[Diagnostic]
    timed_out: bool
    data: dict[str, Any]


def _run_kernel(mode: str, source: str, reference: str, params: dict[str, Any], timeout_s: float) -> _Run:
    _check_source(source)
    reference_path = resolve_reference(reference)
    if timeout_s <= 0:
        raise ValueError("timeout_s must be positive")
    arch = normalise_arch(None)
    started = time.monotonic()
    available, detail = cuda_device_available()
    not_measured = NO_DEVICE if mode == "check" else NO_DEVICE_BENCH
    if not available:
        compiled = cuda_compile(source, arch=arch, timeout_s=max(1.0, timeout_s - (time.monotonic() - started)))
        if compiled.timed_out:
            reason = f"compile timed out; {not_measured}"
        elif compiled.ok:
            reason = f"{not_measured} (compiled OK; {detail})"
        else:
            reason = f"compile failed with {count(compiled.diagnostics, 'error')} error(s); not run"
        correct = False if not compiled.ok and not compiled.timed_out else None
        return _Run(False, reason, compiled.ok, correct, compiled.diagnostics, compiled.timed_out, {})
    name = _ext_name(source, arch)
    build_dir = _cache_root() / name
    build_dir.mkdir(mode=0o700, exist_ok=True)
    source_path = build_dir / f"{name}.cu"
    if not source_path.is_file() or source_path.read_text(encoding="utf-8") != source:
        tmp = build_dir / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"  # atomic: a concurrent build never reads half a file
        tmp.write_text(source, encoding="utf-8")
        os.replace(tmp, source_path)
    spec = {
        "mode": mode,
        "source_path": str(source_path),
        "reference": reference if not reference.endswith(".py") else reference_path,
        "ext_name": name,
        "build_dir": str(build_dir),
        "arch": arch,
        **params,
    }
    result, proc = _run_harness(spec, timeout_s=max(1.0, timeout_s - (time.monotonic() - started)))
    if result is None or "harness_error" in result:
        if proc.timed_out:
            reason = f"timed out after {proc.wall_s:.0f} s (a hung build or kernel); not measured"
        elif result is not None:
            reason = f"the reference or the harness failed: {result['harness_error']}"
        else:
            reason = f"the kernel's process died ({_process_failure(proc)}); not measured"
        # A crash after a successful build means the kernel ran and brought its process down: not correct.
        crashed = result is None and not proc.timed_out and (build_dir / f"{name}.so").is_file()
        return _Run(False, reason, (build_dir / f"{name}.so").is_file(), False if crashed else None, [], proc.timed_out, result or {})
    if not result.get("cuda"):  # the device vanished since the probe
        return _Run(False, not_measured, False, None, [], False, result)
    if not result.get("compiled"):
        build_log = str(result.get("build_log", ""))
        diagnostics = parse_diagnostics(build_log)
        errors = count(diagnostics, "error")
        reason = f"compile failed with {errors} error(s); not run"
        if not errors:  # a link or load failure (e.g. "undefined symbol" when the module is imported): show its end
            reason += ": " + build_log.strip()[-800:]
        return _Run(False, reason, False, False, diagnostics, False, result)
    if result.get("error"):
        return _Run(True, f"the kernel failed: {result['error']}", True, False, [], False, result)
    reason = "output matches the reference" if result.get("correct") else "output differs from the reference beyond the tolerance"
    if result.get("note"):
        reason += f" ({result['note']})"
    return _Run(True, reason, True, bool(result.get("correct")), [], False, result)


def cuda_check(source: str, reference: str, *, seed: int = 0, atol: float = 1e-3, rtol: float = 1e-3, timeout_s: float = 300.0) -> CheckResult:
    """Build the candidate, run it and the reference on seeded inputs, compare within ``atol``/``rtol``."""
    started = time.monotonic()
    run = _run_kernel("check", source, reference, {"seed": int(seed), "atol": float(atol), "rtol": float(rtol)}, timeout_s)
    result = CheckResult(
        measured=run.measured,
        reason=run.reason,
        compiled=run.compiled,
        correct=run.correct,
        max_abs_err=run.data.get("max_abs_err") if run.measured else None,
        diagnostics=run.diagnostics,
        elapsed_s=time.monotonic() - started,
        timed_out=run.timed_out,
    )
    log.info("cuda_check", measured=result.measured, compiled=result.compiled, correct=result.correct, elapsed_s=round(result.elapsed_s, 2))
    return result


def cuda_bench(source: str, reference: str, *, warmup: int = 10, repeats: int = 50, timeout_s: float = 300.0) -> BenchResult:
    """Time the candidate and eager PyTorch with CUDA events (median of ``repeats`` after ``warmup``)."""
    if warmup < 0 or repeats < 1:
        raise ValueError("warmup must be >= 0 and repeats >= 1")
    started = time.monotonic()
    params = {"seed": 0, "atol": 1e-3, "rtol": 1e-3, "warmup": int(warmup), "repeats": int(repeats)}
    run = _run_kernel("bench", source, reference, params, timeout_s)
    kernel_ms, eager_ms = run.data.get("kernel_ms"), run.data.get("eager_ms")
    speedup = None
    reason = run.reason
    if run.measured and kernel_ms is not None and eager_ms is not None:
        if run.correct and kernel_ms > 0:
            speedup = eager_ms / kernel_ms
            reason = "timed"
        else:
            reason = f"the output is incorrect ({run.reason}): speedup not reported"
    result = BenchResult(
        measured=run.measured and kernel_ms is not None,
        reason=reason,
        kernel_ms=kernel_ms,
        eager_ms=eager_ms,
        speedup=speedup,
        correct=run.correct,
        elapsed_s=time.monotonic() - started,
        timed_out=run.timed_out,
    )
    log.info("cuda_bench", measured=result.measured, speedup=result.speedup, correct=result.correct, elapsed_s=round(result.elapsed_s, 2))
    return result


def failure_class(*, found_code: bool, compile_timed_out: bool, compiled: bool, measured: bool, correct: bool | None) -> str | None:
    """How one kernel attempt failed, in LEAP's failure classes; None for a correct kernel.

    ``format`` (no code found), ``compile_timeout``, ``compile_error``, ``unmeasured`` (compiled, no GPU to
    run it), ``runtime_error`` (ran without a verdict), ``incorrect``. The kernel task's outcomes and the
    learner's DCP probes classify with this one function."""
    if not found_code:
        return "format"
    if compile_timed_out:
        return "compile_timeout"
    if not compiled:
        return "compile_error"
    if not measured:
        return "unmeasured"
    if correct is None:
        return "runtime_error"
    return None if correct else "incorrect"
