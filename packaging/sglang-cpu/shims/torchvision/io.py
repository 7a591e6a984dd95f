from torchvision._stub import module_getattr

__getattr__ = module_getattr("torchvision.io")
