from enum import Enum

from torchvision._stub import module_getattr


class InterpolationMode(Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


from torchvision.transforms import functional, v2  # noqa: E402,F401

__getattr__ = module_getattr("torchvision.transforms")
