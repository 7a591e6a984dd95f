"""CUDA kernel tasks: KernelBench-style reference modules with a known-good CUDA solution each.

    from agents.tasks.kernels import kernel_tasks
    specs = kernel_tasks(level=2)            # list[KernelTaskSpec], sorted by (level, name)
    spec = specs[0]; spec.module             # "agents.tasks.kernels.level2.cumsum"
    spec.solution                            # the CUDA C++ source text of the known-good solution

Layout: ``levelN/<name>.py`` defines ``Model(nn.Module)``, ``get_inputs()`` and ``get_init_inputs()``;
``levelN/<name>.cu`` beside it is a solution that follows the candidate convention (see ``CONVENTION``):
one CUDA C++ source that includes ``<torch/extension.h>``, defines ``torch::Tensor forward(...)`` and binds it
with ``PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("forward", &forward); }``. It is called as
``ext.forward(*inputs, *model.parameters(), *model.buffers())`` after ``torch.manual_seed(seed);
model = Model(*get_init_inputs()); inputs = get_inputs()`` (inputs moved to the GPU) and compared with
``model(*inputs)``. Solutions take float32 contiguous inputs.

Levels: 1 element-wise and activations, 2 reductions / softmax / norms / scan, 3 matmul variants and
fused blocks. The ``kernels`` task (``agents.tasks.kernels.task``) turns these into agent problems.

Importing this package is cheap: specs are found on disk and described from each module's docstring
(parsed with ``ast``), so neither torch nor the task modules are imported until a reference model is built.

What it does not do: compile or run anything (``tools.cuda`` does that), or check that a solution is
correct (``tests/agents/test_kernel_tasks.py`` and ``python -m agents.tasks.kernels.emulate`` do).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

__all__ = ["CONVENTION", "KernelTaskSpec", "get_kernel_task", "kernel_tasks"]

_ROOT = Path(__file__).resolve().parent
_PACKAGE = __name__
LEVELS = (1, 2, 3)

CONVENTION = (
    "Write one CUDA C++ source file that includes <torch/extension.h>, defines `torch::Tensor forward(...)` "
    "taking the model's inputs followed by its parameters and buffers (in `model.parameters()` / "
    "`model.buffers()` order) as float32 contiguous CUDA tensors, launches your own __global__ kernel(s), and ends "
    'with `PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("forward", &forward); }`. It is built as a PyTorch '
    "extension and called as `ext.forward(*inputs, *model.parameters(), *model.buffers())`; its output is "
    "compared with `model(*inputs)` (atol = rtol = 1e-3) and timed against eager PyTorch."
)


@dataclass(frozen=True)
class KernelTaskSpec:
    name: str  # "level2/softmax": unique across levels
    level: int
    module: str  # dotted path of the reference module, e.g. "agents.tasks.kernels.level2.softmax"
    description: str  # first line of the module docstring
    source_path: Path  # the reference module file
    solution_path: Path  # the known-good CUDA solution

    @property
    def short_name(self) -> str:
        return self.name.split("/", 1)[1]

    @property
    def solution(self) -> str:
        """The known-good CUDA source text."""
        return self.solution_path.read_text()

    @property
    def reference_source(self) -> str:
        """The reference module's Python source (what the agent is shown)."""
        return self.source_path.read_text()


@cache
def _all_specs() -> tuple[KernelTaskSpec, ...]:
    out = []
    for level in LEVELS:
        folder = _ROOT / f"level{level}"
        for py in sorted(folder.glob("*.py")):
            if py.name.startswith("_"):
                continue
            cu = py.with_suffix(".cu")
            if not cu.exists():
                raise FileNotFoundError(f"kernel task {py} has no solution {cu.name}")
            doc = ast.get_docstring(ast.parse(py.read_text(), filename=str(py))) or ""
            out.append(
                KernelTaskSpec(
                    name=f"level{level}/{py.stem}",
                    level=level,
                    module=f"{_PACKAGE}.level{level}.{py.stem}",
                    description=doc.strip().splitlines()[0] if doc.strip() else py.stem,
                    source_path=py,
                    solution_path=cu,
                )
            )
    return tuple(out)


def kernel_tasks(level: int | None = None) -> list[KernelTaskSpec]:
    """All kernel task specs (or one level's), sorted by level then name."""
    if level is not None and level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS} or None, got {level!r}")
    return [s for s in _all_specs() if level is None or s.level == level]


def get_kernel_task(name: str) -> KernelTaskSpec:
    """The spec called ``name`` (``"level1/relu"``; a bare ``"relu"`` works when it is unique)."""
    specs = _all_specs()
    exact = [s for s in specs if s.name == name]
    if exact:
        return exact[0]
    short = [s for s in specs if s.short_name == name]
    if len(short) == 1:
        return short[0]
    raise KeyError(f"unknown kernel task {name!r}; known: {', '.join(s.name for s in specs)}")
