"""Check the known-good CUDA solutions without a GPU: one bundled nvcc compile, and a CPU emulation of the kernels.

    python -m agents.tasks.kernels.emulate                 # emulate every solution on CPU, compare with the reference
    python -m agents.tasks.kernels.emulate --level 2 --only softmax,cumsum
    python -m agents.tasks.kernels.emulate --nvcc-bundle   # compile all solutions in one nvcc translation unit

Why: a torch-extension compile costs minutes on a small CPU machine (``<torch/extension.h>`` dominates), so
compiling 31 solutions one by one is too slow to repeat, and without a GPU nothing runs them. Both modes put
every solution into one translation unit, each inside its own namespace (its ``#include`` lines hoisted, its
``PYBIND11_MODULE`` dropped, its macros ``#undef``-ed after it).

``--nvcc-bundle`` compiles that unit with ``tools.cuda.cuda_compile`` (nvcc ``-c`` with torch's extension
flags): every solution's device and host code goes through the real CUDA compiler once.

The default mode compiles it with g++ as a CPU PyTorch extension in which CUDA is emulated: ``__global__``
and ``__device__`` are dropped, ``__shared__`` becomes a function-local ``static`` (blocks run one after
another, so it is one block's shared memory), ``k<<<grid, block>>>(args)`` becomes a call that runs every
block in turn and, inside a block, either every thread in turn (kernels without ``__syncthreads``) or every
thread as a fiber (``ucontext``) on one OS thread, ``__syncthreads`` switching back to a scheduler that
resumes all fibers of the block in turn (so every thread reaches a barrier before any passes it). Outputs are compared with the reference
``Model`` exactly as ``cuda_check`` does (same seeding, ``atol = rtol = 1e-3``).

What it does not do: emulate warps (``__shfl_*``, warp-synchronous code), atomics, streams, launch bounds,
dynamic shared memory or the CUDA math library's exact rounding; a solution using them fails to build here
and needs the GPU check (``tests/agents/test_kernel_tasks.py -m gpu``). It says nothing about speed.
"""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from . import KernelTaskSpec, kernel_tasks

__all__ = ["bundle", "bundle_source", "emulate", "nvcc_bundle"]

# [ \t] rather than \s: a removed line must keep its newline, so line numbers map back to the candidate
_INCLUDE_RE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*[<\"].*[>\"][ \t]*$", re.MULTILINE)
_DEFINE_RE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)", re.MULTILINE)
_PYBIND_RE = re.compile(r"PYBIND11_MODULE\s*\(.*?\)\s*\{.*?\}\s*", re.DOTALL)
_LAUNCH_RE = re.compile(r"\b(\w+)\s*<<<\s*([^,<>]+?)\s*,\s*([^<>]+?)\s*>>>\s*\(")

_PRELUDE = r"""
// ---- CUDA emulation on the CPU (agents/tasks/kernels/emulate.py) ----
#include <ucontext.h>
#include <cmath>
#include <functional>
#include <vector>
#define is_cuda() is_cpu()
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __syncthreads() emu_yield()
struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
static dim3 threadIdx, blockIdx, blockDim, gridDim;
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
// One CUDA thread = one fiber (ucontext) on a single OS thread; __syncthreads() returns to the scheduler,
// which resumes every fiber of the block in turn, so all reach barrier k before any passes it.
struct EmuFiber {
    ucontext_t ctx;
    std::vector<char> stack;
    bool done = false;
    dim3 tid;
};
static ucontext_t emu_main;
static EmuFiber* emu_cur = nullptr;
static std::vector<EmuFiber> emu_pool;  // one per thread of the largest block so far
static const std::function<void()>* emu_body = nullptr;
inline void emu_yield() {
    if (emu_cur != nullptr) swapcontext(&emu_cur->ctx, &emu_main);
}
static void emu_entry() {
    (*emu_body)();
    emu_cur->done = true;
}
template <class... P, class... A>
void emu_launch(bool fibers, dim3 grid, dim3 block, void (*kernel)(P...), A... args) {
    gridDim = grid;
    blockDim = block;
    const unsigned nt = block.x * block.y * block.z;
    const std::function<void()> body = [&]() { kernel(args...); };
    emu_body = &body;
    if (fibers && emu_pool.size() < nt) emu_pool.resize(nt);
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                blockIdx = dim3(bx, by, bz);
                if (!fibers) {  // no barriers: the threads can run one after another
                    for (unsigned t = 0; t < nt; ++t) {
                        threadIdx = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
                        body();
                    }
                    continue;
                }
                for (unsigned t = 0; t < nt; ++t) {
                    EmuFiber& f = emu_pool[t];
                    f.stack.resize(64 * 1024);
                    f.done = false;
                    f.tid = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
                    getcontext(&f.ctx);
                    f.ctx.uc_stack.ss_sp = f.stack.data();
                    f.ctx.uc_stack.ss_size = f.stack.size();
                    f.ctx.uc_link = &emu_main;
                    makecontext(&f.ctx, emu_entry, 0);
                }
                for (bool left = true; left;) {
                    left = false;
                    for (unsigned t = 0; t < nt; ++t) {
                        EmuFiber& f = emu_pool[t];
                        if (f.done) continue;
                        threadIdx = f.tid;
                        emu_cur = &f;
                        swapcontext(&emu_main, &f.ctx);
                        left = left || !f.done;
                    }
                }
                emu_cur = nullptr;
            }
}
"""


def _ident(spec: KernelTaskSpec) -> str:
    return spec.name.replace("/", "_")


def bundle(sources: Sequence[tuple[str, str]], *, emulate_cuda: bool) -> tuple[str, dict[str, tuple[int, int]]]:
    """One translation unit holding every ``(ident, source)`` in ``namespace <ident>``; also each one's line range
    (first, last, 1-based) in the unit, to map compiler diagnostics back. With ``emulate_cuda``: the CPU-emulation
    prelude, rewritten launches and a ``PYBIND11_MODULE`` binding each ``<ident>::forward`` as ``<ident>``."""
    includes: list[str] = []
    bodies: list[tuple[str, str]] = []
    for ident, src in sources:
        for inc in _INCLUDE_RE.findall(src):
            if inc.strip() not in includes:
                includes.append(inc.strip())
        body = _PYBIND_RE.sub("", _INCLUDE_RE.sub("", src))
        macros = sorted(set(_DEFINE_RE.findall(body)))
        if emulate_cuda:
            fibers = "true" if "__syncthreads" in body else "false"
            body = _LAUNCH_RE.sub(rf"emu_launch({fibers}, dim3(\2), dim3(\3), \1, ", body)
        undefs = "".join(f"#undef {m}\n" for m in macros)
        bodies.append((ident, f"// ---- {ident}\nnamespace {ident} {{\n{body}\n}}  // namespace {ident}\n{undefs}"))
    text = "\n".join(includes) + "\n"
    if emulate_cuda:
        text += _PRELUDE + "\n"
    ranges: dict[str, tuple[int, int]] = {}
    for ident, chunk in bodies:
        first = text.count("\n") + 1
        text += chunk + "\n"
        ranges[ident] = (first, text.count("\n"))
    if emulate_cuda:
        binds = "".join(f'    m.def("{ident}", &{ident}::forward);\n' for ident, _ in sources)
        text += f"PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{\n{binds}}}\n"
    return text, ranges


def bundle_source(specs: Sequence[KernelTaskSpec], *, emulate_cuda: bool) -> str:
    """:func:`bundle` of the specs' solutions, each in ``namespace <level>_<name>``."""
    return bundle([(_ident(s), s.solution) for s in specs], emulate_cuda=emulate_cuda)[0]


def _torch_flags() -> tuple[list[str], list[str]]:
    from torch.utils.cpp_extension import include_paths, library_paths

    inc = [f"-I{p}" for p in include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    lib = [f"-L{p}" for p in library_paths()] + [f"-Wl,-rpath,{p}" for p in library_paths()]
    return inc, lib


def nvcc_bundle(specs: Sequence[KernelTaskSpec], *, arch: str | None = None, timeout_s: float = 1800.0) -> Any:
    """Compile every solution in one translation unit with ``tools.cuda.cuda_compile``; its ``CompileResult``."""
    from tools.cuda import cuda_compile

    return cuda_compile(bundle_source(specs, emulate_cuda=False), arch=arch, timeout_s=timeout_s)


def _build_emulated(specs: Sequence[KernelTaskSpec], work: Path) -> ModuleType:
    name = f"kernels_emu_{int(time.time())}"
    src = work / f"{name}.cpp"
    src.write_text(bundle_source(specs, emulate_cuda=True))
    inc, lib = _torch_flags()
    out = work / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    cmd = ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-w", f"-DTORCH_EXTENSION_NAME={name}", str(src), "-o", str(out)]
    cmd += [*inc, *lib, "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"emulation build failed:\n{proc.stderr[-8000:]}")
    sys.path.insert(0, str(work))
    import torch  # noqa: F401  (the extension needs libtorch loaded first)

    return importlib.import_module(name)


def emulate(specs: Sequence[KernelTaskSpec], *, seed: int = 0, atol: float = 1e-3, rtol: float = 1e-3) -> dict[str, tuple[bool, float, str]]:
    """Build the emulation once and run every solution; ``{name: (ok, max_abs_err, detail)}``."""
    import torch

    ext = _build_emulated(specs, Path(tempfile.mkdtemp(prefix="kernels-emu-")))
    out: dict[str, tuple[bool, float, str]] = {}
    for spec in specs:
        mod = importlib.import_module(spec.module)
        torch.manual_seed(seed)
        model = mod.Model(*mod.get_init_inputs())
        inputs = mod.get_inputs()
        with torch.no_grad():
            want = model(*inputs)
            try:
                got = getattr(ext, _ident(spec))(*inputs, *model.parameters(), *model.buffers())
            except RuntimeError as exc:  # a TORCH_CHECK in the solution
                out[spec.name] = (False, float("inf"), f"raised: {exc}".splitlines()[0])
                continue
        if got.shape != want.shape:
            out[spec.name] = (False, float("inf"), f"shape {tuple(got.shape)} != {tuple(want.shape)}")
            continue
        err = float((got - want).abs().max()) if want.numel() else 0.0
        ok = bool(torch.allclose(got, want, atol=atol, rtol=rtol))
        out[spec.name] = (ok, err, "ok" if ok else "mismatch")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agents.tasks.kernels.emulate", description=__doc__.split("\n\n")[0])
    p.add_argument("--level", type=int, default=None)
    p.add_argument("--only", default="", help="comma-separated task names (short or level/name)")
    p.add_argument("--nvcc-bundle", action="store_true", help="compile all solutions with nvcc in one unit instead")
    args = p.parse_args(argv)
    specs = kernel_tasks(args.level)
    if args.only:
        wanted = {w.strip() for w in args.only.split(",") if w.strip()}
        specs = [s for s in specs if s.name in wanted or s.short_name in wanted]
    t0 = time.perf_counter()
    if args.nvcc_bundle:
        result = nvcc_bundle(specs)
        print(result.summary())
        print(f"nvcc bundle of {len(specs)} solutions: {'OK' if result.ok else 'FAILED'} in {time.perf_counter() - t0:.0f} s")
        return 0 if result.ok else 1
    results = emulate(specs)
    bad = 0
    for name, (ok, err, detail) in results.items():
        bad += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {name:38s} max_abs_err={err:.3g}  {detail}")
    print(f"{len(results) - bad}/{len(results)} solutions match their reference under CPU emulation ({time.perf_counter() - t0:.0f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
