"""CUDA kernel tools: compile with nvcc, check against a PyTorch reference, time against eager PyTorch.

    from tools.cuda import cuda_compile, cuda_check, cuda_bench
    cuda_compile(src).summary()           # "compile FAILED in 41.2 s: 1 error, 0 warnings\\nkernel.cu:12: error: ..."
    cuda_check(src, "agents.tasks.kernels.level1.relu").correct
    cuda_bench(src, "tests/tools/cuda_fixtures/scale.py").speedup

Modules: ``api`` (the three functions and their results; isolation and the GPU/no-GPU behaviour are
described there), ``diagnostics`` (nvcc/EDG/GCC/ptxas output → ``Diagnostic``), ``toolchain`` (nvcc and
include paths without importing torch), ``process`` (the confined, time-limited subprocess), ``tool``
(the registry tools ``cuda_compile``/``cuda_check``/``cuda_bench``), ``_harness`` (the script that runs on
the GPU side; never imported here). Importing this package does not import torch.
"""

from tools.cuda.api import (
    BenchResult,
    CheckResult,
    CompileResult,
    cuda_bench,
    cuda_check,
    cuda_compile,
    cuda_device_available,
    failure_class,
    resolve_reference,
)
from tools.cuda.diagnostics import Diagnostic, parse_diagnostics
from tools.cuda.tool import CUDA_TOOLS, bench_tool, check_tool, compile_tool

__all__ = [
    "CUDA_TOOLS",
    "BenchResult",
    "CheckResult",
    "CompileResult",
    "Diagnostic",
    "bench_tool",
    "check_tool",
    "compile_tool",
    "cuda_bench",
    "cuda_check",
    "cuda_compile",
    "cuda_device_available",
    "failure_class",
    "parse_diagnostics",
    "resolve_reference",
]
