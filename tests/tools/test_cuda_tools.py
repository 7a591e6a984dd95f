"""CUDA kernel tools: real nvcc compiles and their parsed diagnostics, the compile timeout, the no-GPU path, the tools.

The CPU tests compile tiny kernels without torch's headers (a torch-extension compile takes minutes on a
small machine: ``bench/kernels.py --compile-latency`` measures it). Tests marked ``gpu`` build and run the
fixtures in ``cuda_fixtures/`` on a real device.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from tools.builtins import default_registry
from tools.cuda import (
    CompileResult,
    Diagnostic,
    api,
    cuda_bench,
    cuda_check,
    cuda_compile,
    cuda_device_available,
    parse_diagnostics,
    resolve_reference,
)
from tools.cuda.api import NO_DEVICE, NO_DEVICE_BENCH
from tools.cuda.process import ProcessResult
from tools.cuda.toolchain import normalise_arch, torch_arch_list

FIXTURES = Path(__file__).with_name("cuda_fixtures")
SCALE_REF = str(FIXTURES / "scale_shift.py")

needs_nvcc = pytest.mark.skipif(not os.path.exists("/usr/local/cuda/bin/nvcc") and not os.environ.get("CUDA_HOME"), reason="nvcc not installed")

GOOD = """\
__global__ void scale(float* y, const float* x, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i];
}
"""

# line 3: a real EDG warning (read before set); line 6: a real error (undefined identifier)
BROKEN = """\
__global__ void k(float* y) {
    float a[4];
    y[1] = a[2];
}
__global__ void bad(float* y) {
    y[0] = undefined_thing;
}
"""


def _call(name: str, args: dict[str, object]):  # type: ignore[no-untyped-def]
    return asyncio.run(default_registry().call(name, args))


# -- the parser on fixed strings ----------------------------------------------------------------------


def test_parser_reads_every_format_and_skips_the_noise() -> None:
    log = """\
[1/2] /usr/local/cuda/bin/nvcc -c kernel.cu -o kernel.cuda.o -O3
FAILED: kernel.cuda.o
kernel.cu(12): error: identifier "foo" is undefined
      y[0] = foo;
             ^

/usr/include/c10/core/AutogradState.h(90): warning #3306-D: a default bit-field initializer is a C++20 feature
"kernel.cu", line 7: remark: something old-style
kernel.cu(3): catastrophic error: cannot open source file "x.h"
kernel.cu:14:5: error: expected ';' before '}' token
kernel.cu:20: warning: unused variable 'z'
kernel.cu: In function 'void f()':
In file included from kernel.cu:1:
kernel.cu:2:3: note: declared here
cc1plus: fatal error: kernel.cu: No such file or directory
ptxas warning : Registers are spilled to local memory in function '_Z1kPf', 8 bytes spill stores
ptxas error   : Entry function '_Z1kPf' uses too much shared data (0x61a80 bytes, 0xc000 max)
ptxas info    : Used 8 registers
ptxas /tmp/tmpxft_1.ptx, line 5; error   : Unknown symbol 'x'
nvcc fatal   : Unsupported gpu architecture 'compute_99'
nvcc warning : The -std=c++20 flag is experimental
Remark: The warnings can be suppressed with "-diag-suppress <warning-number>"
1 error detected in the compilation of "kernel.cu".
RuntimeError: Error building extension 'lw_x'
kernel.cu(12): error: identifier "foo" is undefined
"""
    got = parse_diagnostics(log)
    assert got == [
        Diagnostic("kernel.cu", 12, "error", 'identifier "foo" is undefined'),
        Diagnostic("/usr/include/c10/core/AutogradState.h", 90, "warning", "a default bit-field initializer is a C++20 feature"),
        Diagnostic("kernel.cu", 7, "remark", "something old-style"),
        Diagnostic("kernel.cu", 3, "error", 'cannot open source file "x.h"'),
        Diagnostic("kernel.cu", 14, "error", "expected ';' before '}' token", column=5),
        Diagnostic("kernel.cu", 20, "warning", "unused variable 'z'"),
        Diagnostic("kernel.cu", 2, "note", "declared here", column=3),
        Diagnostic("cc1plus", None, "error", "kernel.cu: No such file or directory"),
        Diagnostic("ptxas", None, "warning", "Registers are spilled to local memory in function '_Z1kPf', 8 bytes spill stores"),
        Diagnostic("ptxas", None, "error", "Entry function '_Z1kPf' uses too much shared data (0x61a80 bytes, 0xc000 max)"),
        Diagnostic("ptxas", None, "note", "Used 8 registers"),
        Diagnostic("/tmp/tmpxft_1.ptx", 5, "error", "Unknown symbol 'x'"),
        Diagnostic("nvcc", None, "error", "Unsupported gpu architecture 'compute_99'"),
        Diagnostic("nvcc", None, "warning", "The -std=c++20 flag is experimental"),
    ]  # the repeated error at the end is reported once


def test_arch_forms() -> None:
    assert [normalise_arch(a) for a in ("sm_90", "90", "9.0", "sm_90a", "compute_80")] == ["sm_90", "sm_90", "sm_90", "sm_90a", "sm_80"]
    assert torch_arch_list("sm_90a") == "9.0a" and torch_arch_list("sm_100") == "10.0"
    with pytest.raises(ValueError, match="not understood"):
        normalise_arch("hopper")


def test_resolve_reference_finds_files_without_importing() -> None:
    assert resolve_reference("tools.cuda.api").endswith("tools/cuda/api.py")
    assert resolve_reference(SCALE_REF) == str(Path(SCALE_REF).resolve())
    for bad, message in [("no_such_pkg.mod", "not found"), ("/nope/x.py", "does not exist"), ("a b", "neither"), (" ", "empty")]:
        with pytest.raises(ValueError, match=message):
            resolve_reference(bad)


# -- real nvcc ----------------------------------------------------------------------------------------


@needs_nvcc
def test_real_compile_of_a_good_kernel() -> None:
    r = cuda_compile(GOOD)
    assert r.ok, r.log
    assert not [d for d in r.diagnostics if d.severity == "error"]
    assert not r.timed_out and r.elapsed_s > 0
    assert "-arch=sm_90" in r.command and "-c" in r.command
    assert r.summary().startswith("compiled OK")


@needs_nvcc
def test_real_compile_errors_and_warnings_are_parsed_with_their_lines() -> None:
    r = cuda_compile(BROKEN)
    assert not r.ok
    assert 'kernel.cu(6): error: identifier "undefined_thing" is undefined' in r.log  # the real output
    errors = [d for d in r.diagnostics if d.severity == "error"]
    warnings = [d for d in r.diagnostics if d.severity == "warning"]
    assert errors == [Diagnostic("kernel.cu", 6, "error", 'identifier "undefined_thing" is undefined')]
    assert warnings == [Diagnostic("kernel.cu", 3, "warning", 'variable "a" is used before its value is set')]
    assert r.summary().splitlines()[:2] == [f"compile FAILED in {r.elapsed_s:.1f} s: 1 error, 1 warning", errors[0].format()]


@needs_nvcc
def test_real_host_compiler_ptxas_and_nvcc_messages() -> None:
    missing = cuda_compile('#include "not_there.h"\n__global__ void k() {}\n')
    assert missing.diagnostics == [Diagnostic("kernel.cu", 1, "error", "not_there.h: No such file or directory", column=10)]
    too_much_shared = (
        "__global__ void k(float* y) {\n  __shared__ float s[100000];\n  s[threadIdx.x] = 1.0f;\n  __syncthreads();\n  y[0] = s[1];\n}\n"
    )
    shared = cuda_compile(too_much_shared)
    assert not shared.ok
    assert [(d.file, d.severity) for d in shared.diagnostics] == [("ptxas", "error")]
    assert "uses too much shared data" in shared.diagnostics[0].message
    bad_arch = cuda_compile(GOOD, arch="sm_99")
    assert bad_arch.diagnostics == [Diagnostic("nvcc", None, "error", "Unsupported gpu architecture 'sm_99'")]


@needs_nvcc
def test_timeout_kills_a_hanging_compile(tmp_path: Path) -> None:
    fifo = tmp_path / "never_written.h"
    os.mkfifo(fifo)  # opening it for reading blocks until a writer comes: nobody will
    started = time.monotonic()
    r = cuda_compile(f'#include "{fifo}"\n__global__ void k() {{}}\n', timeout_s=3)
    assert r.timed_out and not r.ok
    assert 3 <= r.elapsed_s < 10 and time.monotonic() - started < 15
    assert r.summary().startswith("compile timed out after 3 s")
    # The define carries a hash of this source, so it names this compile's processes (nvcc passes it to gcc -E).
    marker = next(arg for arg in r.command if arg.startswith("-DTORCH_EXTENSION_NAME=")).encode()
    time.sleep(0.2)
    holders = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes():
                holders.append(pid)
        except OSError:
            continue
    assert holders == []  # the preprocessor blocked on the FIFO was killed with its whole tree


# -- the no-GPU path ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def no_gpu() -> None:
    available, detail = cuda_device_available()
    if available:
        pytest.skip(f"this machine has a CUDA device ({detail}); the GPU tests cover it")


@needs_nvcc
def test_check_without_a_gpu_compiles_and_says_it_did_not_measure(no_gpu: None) -> None:
    good = cuda_check(GOOD, SCALE_REF)
    assert (good.measured, good.compiled, good.correct, good.max_abs_err) == (False, True, None, None)
    assert good.reason.startswith(NO_DEVICE)
    assert good.summary().startswith(NO_DEVICE)
    bad = cuda_bench(BROKEN, SCALE_REF)
    assert (bad.measured, bad.correct, bad.speedup, bad.kernel_ms) == (False, False, None, None)
    assert bad.reason == "compile failed with 1 error(s); not run"
    assert bad.to_dict()["measured"] is False


@needs_nvcc
def test_bench_without_a_gpu_says_speed_was_not_measured(no_gpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    compiled = CompileResult(ok=True, diagnostics=[], log="", elapsed_s=1.0, timed_out=False)
    monkeypatch.setattr(api, "cuda_compile", lambda source, **kw: compiled)  # the compile itself is tested above
    r = cuda_bench(GOOD, "tools.cuda.api")
    assert (r.measured, r.correct, r.speedup, r.kernel_ms, r.eager_ms) == (False, None, None, None, None)
    assert r.reason.startswith(NO_DEVICE_BENCH) and r.summary() == r.reason


# -- the GPU path's logic, on the CPU ------------------------------------------------------------------


def test_harness_builds_the_seeded_reference_and_compares_like_allclose() -> None:
    torch = pytest.importorskip("torch")
    from tools.cuda import _harness as harness

    model, inputs = harness.build_reference(SCALE_REF, 0, "cpu")
    again, inputs_again = harness.build_reference(SCALE_REF, 0, "cpu")
    assert torch.equal(model.weight, again.weight) and torch.equal(inputs[0], inputs_again[0])  # the seed fixes both
    with torch.no_grad():
        expected = model(*inputs)
    assert harness.compare(expected.clone(), expected, 1e-3, 1e-3) == {"correct": True, "max_abs_err": 0.0}
    assert harness.compare(expected + 5e-4, expected, 1e-3, 1e-3)["correct"] is True
    off = harness.compare(expected + 1.0, expected, 1e-3, 1e-3)
    assert off["correct"] is False and off["max_abs_err"] == pytest.approx(1.0)
    nan = expected.clone()
    nan[0, 0] = float("nan")
    assert harness.compare(nan, expected, 1e-3, 1e-3) == {"correct": False, "max_abs_err": None}
    assert "differs from the reference's (256, 1024)" in harness.compare(expected[0], expected, 1e-3, 1e-3)["error"]
    assert harness.compare(expected.half(), expected, 1e-2, 1e-2)["note"].startswith("output dtype torch.float16")


def test_the_harness_runs_confined_with_the_servers_interpreter() -> None:
    result, proc = api._run_harness({"mode": "probe"}, timeout_s=120)  # the real subprocess: -I, spec in, JSON out
    assert proc.exit_code == 0 and not proc.timed_out, proc.output
    assert result is not None and set(result) >= {"cuda", "torch"}
    available, detail = cuda_device_available()
    assert result["cuda"] is available
    if not available:
        assert "CPU-only build" in detail or "torch" in detail


# The shape of a failing torch.utils.cpp_extension.load's message (ninja's lines, then nvcc's real output for BROKEN's
# line 6, with the build folder's path); written from the format, not captured here: this machine cannot run load().
BUILD_FAILURE = """Error building extension 'lw_0123': [1/2] /usr/local/cuda/bin/nvcc -c lw_0123.cu -o lw_0123.cuda.o
FAILED: lw_0123.cuda.o
/usr/local/cuda/bin/nvcc --generate-dependencies-with-compile --dependency-output lw_0123.cuda.o.d -c /tmp/lw_0123/lw_0123.cu -o lw_0123.cuda.o
/tmp/lw_0123/lw_0123.cu(6): error: identifier "undefined_thing" is undefined
      y[0] = undefined_thing;
             ^

1 error detected in the compilation of "/tmp/lw_0123/lw_0123.cu".
ninja: build stopped: subcommand failed.
"""


def _proc(**kw: object) -> ProcessResult:
    fields: dict[str, object] = {
        "exit_code": 0,
        "signal": None,
        "timed_out": False,
        "output": "",
        "output_truncated": False,
        "wall_s": 1.0,
        "confined": True,
    }
    fields.update(kw)
    return ProcessResult(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("harness", "proc", "check", "bench"),
    [
        (
            {"cuda": True, "compiled": False, "build_log": BUILD_FAILURE},
            _proc(),
            {"measured": False, "compiled": False, "correct": False, "reason": "compile failed with 1 error(s); not run"},
            {"measured": False, "correct": False, "speedup": None},
        ),
        (
            {"cuda": True, "compiled": True, "correct": True, "max_abs_err": 2e-7, "kernel_ms": 0.02, "eager_ms": 0.05},
            _proc(),
            {"measured": True, "compiled": True, "correct": True, "max_abs_err": 2e-7, "reason": "output matches the reference"},
            {"measured": True, "correct": True, "speedup": pytest.approx(2.5), "reason": "timed"},
        ),
        (
            {"cuda": True, "compiled": True, "correct": False, "max_abs_err": 1.0, "kernel_ms": 0.02, "eager_ms": 0.05},
            _proc(),
            {"measured": True, "correct": False, "max_abs_err": 1.0, "reason": "output differs from the reference beyond the tolerance"},
            {"measured": True, "correct": False, "speedup": None, "kernel_ms": 0.02},
        ),
        (
            {"cuda": True, "compiled": True, "correct": False, "error": "RuntimeError: CUDA error: an illegal memory access was encountered"},
            _proc(),
            {"measured": True, "compiled": True, "correct": False, "max_abs_err": None},
            {"measured": False, "correct": False, "speedup": None},
        ),
        (
            {"cuda": True, "compiled": False, "build_log": "ImportError: /tmp/lw_0123/lw_0123.so: undefined symbol: _Z6helperv"},
            _proc(),
            {
                "compiled": False,
                "correct": False,
                "reason": "compile failed with 0 error(s); not run: ImportError: /tmp/lw_0123/lw_0123.so: undefined symbol: _Z6helperv",
            },
            {"measured": False, "correct": False},
        ),
        (
            None,
            _proc(exit_code=None, signal=9, timed_out=True, wall_s=300.0),
            {"measured": False, "timed_out": True, "correct": None},
            {"timed_out": True},
        ),
        (
            {"harness_error": "ModuleNotFoundError: No module named 'scipy'"},
            _proc(exit_code=1),
            {"measured": False, "correct": None, "reason": "the reference or the harness failed: ModuleNotFoundError: No module named 'scipy'"},
            {"measured": False, "correct": None},
        ),
    ],
)
def test_gpu_harness_reports_become_results(
    harness: dict[str, object] | None,
    proc: ProcessResult,
    check: dict[str, object],
    bench: dict[str, object],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("LOOPWISE_CUDA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(api, "cuda_device_available", lambda: (True, "fake H200"))
    specs: list[dict[str, object]] = []
    monkeypatch.setattr(api, "_run_harness", lambda spec, timeout_s: (specs.append(spec), (harness, proc))[1])
    checked, benched = cuda_check(GOOD, SCALE_REF).to_dict(), cuda_bench(GOOD, SCALE_REF, warmup=2, repeats=3).to_dict()
    assert {k: checked[k] for k in check} == check
    assert {k: benched[k] for k in bench} == bench
    if harness and harness.get("build_log") == BUILD_FAILURE:
        assert checked["diagnostics"] == [Diagnostic("/tmp/lw_0123/lw_0123.cu", 6, "error", 'identifier "undefined_thing" is undefined').to_dict()]
    assert specs[0]["mode"] == "check" and specs[1]["mode"] == "bench" and specs[1]["repeats"] == 3
    assert specs[0]["ext_name"] == specs[1]["ext_name"] and Path(str(specs[0]["source_path"])).read_text() == GOOD  # one build for both


# -- the registry tools -------------------------------------------------------------------------------


@needs_nvcc
def test_registry_tools_return_readable_observations(no_gpu: None) -> None:
    registry = default_registry()
    assert {"cuda_compile", "cuda_check", "cuda_bench"} <= set(registry.names())
    assert registry.get("cuda_check").parameters["required"] == ["source", "task"]
    missing_header = '#include "not_there.h"\n__global__ void k() {}\n'  # fails in the preprocessor: a cheap real compile
    compiled = _call("cuda_compile", {"source": missing_header})
    assert not compiled.ok and compiled.error_kind == "compile_error"
    assert compiled.content.splitlines()[1] == "kernel.cu:1:10: error: not_there.h: No such file or directory"
    assert compiled.flags["diagnostics"][0]["line"] == 1 and "log" not in compiled.flags
    checked = _call("cuda_check", {"source": missing_header, "task": SCALE_REF})
    assert not checked.ok and checked.error_kind == "compile_error"
    assert checked.content.splitlines() == [
        "did not compile: compile failed with 1 error(s); not run",
        "kernel.cu:1:10: error: not_there.h: No such file or directory",
    ]
    benched = _call("cuda_bench", {"source": missing_header, "task": "tools.cuda.api"})  # located, never imported here
    assert benched.error_kind == "compile_error" and benched.flags["measured"] is False and benched.flags["speedup"] is None


def test_bad_arguments_are_tool_errors_not_crashes() -> None:
    missing = _call("cuda_check", {"source": GOOD})
    assert missing.error_kind == "invalid_arguments" and "task" in missing.content
    wrong_type = _call("cuda_compile", {"source": 3})
    assert wrong_type.error_kind == "invalid_arguments"
    unknown = _call("cuda_bench", {"source": GOOD, "task": "agents.tasks.kernels.level9.nothing"})
    assert unknown.error_kind == "tool_error" and "not found on the Python path" in unknown.content
    empty = _call("cuda_compile", {"source": "  "})
    assert empty.error_kind == "tool_error" and "source is empty" in empty.content


# -- on a GPU -----------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_correct_kernel_passes_and_wrong_kernel_fails() -> None:
    good = cuda_check((FIXTURES / "scale_shift.cu").read_text(), SCALE_REF)
    assert good.measured and good.compiled and good.correct, good.summary()
    assert good.max_abs_err is not None and good.max_abs_err < 1e-5
    wrong = cuda_check((FIXTURES / "scale_shift_wrong.cu").read_text(), SCALE_REF)
    assert wrong.measured and wrong.compiled and wrong.correct is False
    assert wrong.max_abs_err == pytest.approx(1.0, abs=1e-5)
    assert wrong.summary().startswith("INCORRECT (max abs error 1)")


@pytest.mark.gpu
def test_gpu_bench_reports_a_speedup() -> None:
    r = cuda_bench((FIXTURES / "row_sum.cu").read_text(), str(FIXTURES / "row_sum.py"), warmup=3, repeats=10)
    assert r.measured and r.correct, r.summary()
    assert r.kernel_ms is not None and r.kernel_ms > 0 and r.eager_ms is not None and r.eager_ms > 0
    assert r.speedup == pytest.approx(r.eager_ms / r.kernel_ms)
    assert "speedup" in r.summary()


@pytest.mark.gpu
def test_gpu_compile_error_is_reported_from_the_extension_build() -> None:
    source = (FIXTURES / "row_sum.cu").read_text().replace("acc += row[j];", "acc += rows[j];")
    r = cuda_check(source, str(FIXTURES / "row_sum.py"))
    assert not r.compiled and r.correct is False
    assert any(d.severity == "error" and d.line == 10 and "rows" in d.message for d in r.diagnostics), r.diagnostics
