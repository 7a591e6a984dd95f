"""Find nvcc, CUDA, torch's headers and Python's headers without importing torch; build nvcc's command line.

    tc = find_toolchain()                       # Toolchain(nvcc='/usr/local/cuda/bin/nvcc', ...)
    nvcc_command(tc, "kernel.cu", "kernel.o", arch="sm_90", ext_name="lw_1a2b")

The flags follow ``torch.utils.cpp_extension`` for a CUDA source of an extension: ``-std=c++20`` (what torch
≥ 2.10 builds extensions with; its headers warn under C++17), torch's ``-D__CUDA_NO_HALF_OPERATORS__``
family and ``--expt-relaxed-constexpr``, ``-DTORCH_EXTENSION_NAME``/``-DTORCH_API_INCLUDE_EXTENSION_H``,
``-fPIC`` for the host compiler, and torch's and Python's include folders as ``-isystem`` (so warnings
inside torch's headers are not reported as the kernel's). Pure functions apart from looking at files.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import re
import shutil
import sysconfig
from dataclasses import dataclass

DEFAULT_ARCH = "sm_90"  # H100/H200
_ARCH_RE = re.compile(r"^(?:sm_|compute_)?(\d)\.?(\d+)([af]?)$")

# torch.utils.cpp_extension.COMMON_NVCC_FLAGS
TORCH_NVCC_FLAGS = (
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
)


@dataclass(frozen=True)
class Toolchain:
    nvcc: str | None  # None: no CUDA compiler on this machine
    cuda_home: str | None
    torch_dir: str | None  # the installed torch package folder, None when torch is not installed
    python_include: str

    def include_dirs(self) -> list[str]:
        dirs = []
        if self.torch_dir:
            dirs += [os.path.join(self.torch_dir, "include"), os.path.join(self.torch_dir, "include", "torch", "csrc", "api", "include")]
        dirs.append(self.python_include)
        if self.cuda_home:
            dirs.append(os.path.join(self.cuda_home, "include"))
        return dirs


def _cuda_home() -> str | None:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(var)
        if value and os.path.isdir(value):
            return value
    if os.path.isfile("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda"
    found = shutil.which("nvcc")
    if found:  # resolve symlinks; /usr/local/bin/nvcc may also be a wrapper script, then this guess fails
        home = os.path.dirname(os.path.dirname(os.path.realpath(found)))
        if os.path.isdir(os.path.join(home, "include")) and os.path.isfile(os.path.join(home, "include", "cuda_runtime.h")):
            return home
    return None


@functools.lru_cache(maxsize=1)
def find_toolchain() -> Toolchain:
    """The toolchain of this machine (looked up once per process)."""
    home = _cuda_home()
    nvcc = os.path.join(home, "bin", "nvcc") if home and os.path.isfile(os.path.join(home, "bin", "nvcc")) else shutil.which("nvcc")
    spec = importlib.util.find_spec("torch")  # locates the package without importing it
    torch_dir = next(iter(spec.submodule_search_locations)) if spec is not None and spec.submodule_search_locations else None
    return Toolchain(nvcc=nvcc, cuda_home=home, torch_dir=torch_dir, python_include=sysconfig.get_paths()["include"])


def torch_build_info(torch_dir: str | None) -> dict[str, str | None] | None:
    """``__version__`` and ``cuda`` from torch's ``version.py``, read with ``ast`` (torch is not imported); None if unreadable."""
    if torch_dir is None:
        return None
    try:
        tree = ast.parse(open(os.path.join(torch_dir, "version.py"), encoding="utf-8").read())
    except (OSError, SyntaxError):
        return None
    info: dict[str, str | None] = {}
    for node in tree.body:
        target = (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else node.target if isinstance(node, ast.AnnAssign) else None
        )
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(target, ast.Name) and target.id in ("__version__", "cuda") and isinstance(value, ast.Constant):
            info[target.id] = value.value if isinstance(value.value, str) else None
    return info if "cuda" in info else None


def normalise_arch(arch: str | None) -> str:
    """``sm_90``, ``90``, ``9.0``, ``sm_90a`` → ``sm_90``/``sm_90a``; default from ``LOOPWISE_CUDA_ARCH`` or sm_90."""
    value = (arch or os.environ.get("LOOPWISE_CUDA_ARCH") or DEFAULT_ARCH).strip()
    match = _ARCH_RE.match(value)
    if match is None:
        raise ValueError(f"CUDA architecture {value!r} is not understood; use a form like 'sm_90' (H100/H200), 'sm_80' or '9.0'")
    major, minor, suffix = match.groups()
    return f"sm_{major}{minor}{suffix}"


def torch_arch_list(arch: str) -> str:
    """``sm_90`` → ``9.0`` and ``sm_90a`` → ``9.0a``, the form of ``TORCH_CUDA_ARCH_LIST``."""
    digits = normalise_arch(arch)[3:]
    suffix = digits[-1] if digits[-1] in "af" else ""
    digits = digits.rstrip("af")
    return f"{digits[:-1]}.{digits[-1]}{suffix}"


def nvcc_command(tc: Toolchain, source: str, output: str, *, arch: str, ext_name: str) -> list[str]:
    """nvcc's argv to compile one extension source to an object (``-c``), as the extension build would."""
    if tc.nvcc is None:
        raise FileNotFoundError("nvcc not found: install the CUDA toolkit or set CUDA_HOME")
    arch = normalise_arch(arch)
    includes = [arg for d in tc.include_dirs() for arg in ("-isystem", d)]
    return [
        tc.nvcc,
        "-c",
        source,
        "-o",
        output,
        f"-arch={arch}",
        "-std=c++20",
        "-O3",
        "-Xcompiler",
        "-fPIC",
        *TORCH_NVCC_FLAGS,
        f"-DTORCH_EXTENSION_NAME={ext_name}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        "-D_GLIBCXX_USE_CXX11_ABI=1",  # torch wheels since 2.7; only matters for linking, not for diagnostics
        *includes,
    ]
