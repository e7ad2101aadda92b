"""A stand-in for torchvision: Megatron-DeepSpeed imports it only through its vision code."""
import sys
import types


class _Stub:
    def __init__(self, *args, **kwargs):
        pass


def _getattr(attr):
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _Stub


for _sub in ("transforms", "transforms.functional", "datasets", "io", "models"):
    _mod = types.ModuleType(f"{__name__}.{_sub}")
    _mod.__getattr__ = _getattr
    sys.modules[_mod.__name__] = _mod
transforms = sys.modules[f"{__name__}.transforms"]
transforms.functional = sys.modules[f"{__name__}.transforms.functional"]
datasets = sys.modules[f"{__name__}.datasets"]
__getattr__ = _getattr
