from torchvision._stub import module_getattr

__getattr__ = module_getattr("torchvision.transforms.v2.functional")
