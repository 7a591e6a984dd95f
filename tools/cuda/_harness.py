"""The GPU side of ``cuda_check``/``cuda_bench``: a script run as ``python -I _harness.py SPEC.json RESULT.json``.

Never imported by the server (it imports torch); ``tools.cuda.api`` runs it in a confined subprocess.
SPEC holds the mode (``probe``, ``check`` or ``bench``), the candidate's source path, the reference (a
dotted module or a ``.py`` path), the extension name and build folder, and the check/bench parameters.
RESULT receives one JSON object; the script always writes it, even when the candidate crashes, unless
the process itself is killed (timeout, a fatal signal), which the parent reports.

Steps: no CUDA device → ``{"cuda": false}``. Otherwise build the extension with
``torch.utils.cpp_extension.load`` (a build failure returns the compiler output for parsing), seed,
build ``Model(*get_init_inputs())`` and ``get_inputs()``, move them to the GPU, compare
``ext.forward(*inputs, *model.parameters(), *model.buffers())`` with ``model(*inputs)``, and for ``bench``
time both with CUDA events (warm-up, median of the repeats).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import statistics
import sys
import time
import traceback
from typing import Any


def _load_reference(reference: str) -> Any:
    if reference.endswith(".py"):
        spec = importlib.util.spec_from_file_location("loopwise_kernel_reference", reference)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {reference}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(reference)


def _time_ms(fn: Any, warmup: int, repeats: int, torch: Any) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(statistics.median(times))


def build_reference(reference: str, seed: int, device: str) -> tuple[Any, list[Any]]:
    """``Model(*get_init_inputs())`` and ``get_inputs()`` after ``torch.manual_seed(seed)``, both on ``device``."""
    import torch

    ref = _load_reference(reference)
    torch.manual_seed(seed)
    model = ref.Model(*ref.get_init_inputs()).to(device).eval()
    inputs = [x.to(device) if isinstance(x, torch.Tensor) else x for x in ref.get_inputs()]
    return model, inputs


def compare(got: Any, expected: Any, atol: float, rtol: float) -> dict[str, Any]:
    """``correct``/``max_abs_err`` (allclose in float64; NaN or inf is never correct), or ``correct=False`` with ``error``."""
    import torch

    if not isinstance(got, torch.Tensor):
        return {"correct": False, "error": f"forward returned {type(got).__name__}, expected a torch.Tensor"}
    if tuple(got.shape) != tuple(expected.shape):
        return {"correct": False, "error": f"output shape {tuple(got.shape)} differs from the reference's {tuple(expected.shape)}"}
    got64, exp64 = got.detach().double(), expected.detach().double()
    diff = (got64 - exp64).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    finite = math.isfinite(max_abs)
    out: dict[str, Any] = {"correct": finite and bool(torch.allclose(got64, exp64, atol=atol, rtol=rtol)), "max_abs_err": max_abs if finite else None}
    if got.dtype != expected.dtype:
        out["note"] = f"output dtype {got.dtype} differs from the reference's {expected.dtype}"
    return out


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"cuda": False, "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    out: dict[str, Any] = {"cuda": True, "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    if spec["mode"] == "probe":
        return out
    from torch.utils import cpp_extension

    started = time.monotonic()
    try:
        ext = cpp_extension.load(
            name=spec["ext_name"],
            sources=[spec["source_path"]],
            build_directory=spec["build_dir"],
            extra_cuda_cflags=["-O3"],
            verbose=False,
        )
    except Exception as exc:  # a build failure: its message carries the compiler output
        out.update(compiled=False, build_log=str(exc)[-200_000:], build_s=time.monotonic() - started)
        return out
    out.update(compiled=True, build_s=time.monotonic() - started)
    model, inputs = build_reference(spec["reference"], spec["seed"], "cuda")
    weights = [*model.parameters(), *model.buffers()]
    with torch.no_grad():
        expected = model(*inputs)
        try:
            got = ext.forward(*inputs, *weights)
            torch.cuda.synchronize()
        except Exception as exc:  # the candidate's own failure (bad launch, illegal address, wrong arguments)
            out.update(correct=False, error=f"{type(exc).__name__}: {str(exc)[:2000]}")
            return out
    out.update(compare(got, expected, spec["atol"], spec["rtol"]))
    if "error" in out:
        return out
    if spec["mode"] == "bench":
        with torch.no_grad():
            out["kernel_ms"] = _time_ms(lambda: ext.forward(*inputs, *weights), spec["warmup"], spec["repeats"], torch)
            out["eager_ms"] = _time_ms(lambda: model(*inputs), spec["warmup"], spec["repeats"], torch)
    return out


def main() -> None:
    spec_path, result_path = sys.argv[1], sys.argv[2]
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    for entry in reversed(spec.get("sys_path", [])):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    try:
        result = run(spec)
    except BaseException as exc:  # the reference or the harness failed: report it, then exit non-zero
        result = {"harness_error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
    tmp = result_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f, default=str)
    os.replace(tmp, result_path)
    sys.exit(1 if "harness_error" in result else 0)


if __name__ == "__main__":
    main()
