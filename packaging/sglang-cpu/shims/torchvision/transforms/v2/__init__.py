from torchvision._stub import module_getattr
from torchvision.transforms.v2 import functional  # noqa: F401

__getattr__ = module_getattr("torchvision.transforms.v2")
