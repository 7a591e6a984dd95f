"""Placeholders for the torchvision names SGLang and transformers import at module load.

transformers 5.x decides ``is_torchvision_available()`` with ``importlib.util.find_spec``, so with this
stub present it imports ``torchvision.io``, ``transforms.functional`` and ``transforms.v2.functional``
when it loads its image utilities. Any name resolves to a placeholder; using one raises, so a text-only
server never depends on it and an image path fails loudly."""

from __future__ import annotations


class Placeholder:
    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def __getattr__(self, name: str) -> Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder(f"{self._qualname}.{name}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._qualname}: loopwise's torchvision import stub (no image support)")

    def __repr__(self) -> str:
        return f"<torchvision stub {self._qualname}>"


def module_getattr(module_name: str):
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder(f"{module_name}.{name}")

    return __getattr__
