"""Import stub for torchvision (loopwise shim): PyPI's torchvision wheels need CUDA torch and fail to
import with torch 2.13.0+cpu. SGLang and transformers import it at module load for image models we never
serve. Every attribute is a placeholder that raises when used (see _stub.py)."""

from torchvision import io, transforms  # noqa: F401
from torchvision._stub import module_getattr

__version__ = "0.0.0+loopwise.stub"
__getattr__ = module_getattr("torchvision")
