"""Tests only: let Megatron-LM's training loop (which needs CUDA) run on a CPU machine.

Active when MECEFO_TEST_FAKE_CUDA=1 and torch has no CUDA. "cuda" devices become the CPU: tensor
factories, `.cuda()`, `.to("cuda")`, and `torch.cuda`'s device, stream and memory calls. Numbers
are computed on the CPU exactly as without the shim; nothing here is used outside the tests.
"""
import os

if os.environ.get("MECEFO_TEST_FAKE_CUDA") == "1":
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # torch.compile'd fusions would target the fake device
    import contextlib
    import functools

    import torch

    if not torch.cuda.is_available():
        CPU = torch.device("cpu")

        def _cpu(device):
            if device is None:
                return None
            if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")) or (
                    isinstance(device, torch.device) and device.type == "cuda"):
                return CPU
            return device

        def _redirect(fn):
            @functools.wraps(fn)
            def wrapper(*args, **kwargs):
                if "device" in kwargs:
                    kwargs["device"] = _cpu(kwargs["device"])
                return fn(*args, **kwargs)
            return wrapper

        for _name in ("tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
                      "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor", "randperm", "linspace"):
            setattr(torch, _name, _redirect(getattr(torch, _name)))

        _tensor_to = torch.Tensor.to

        def _to(self, *args, **kwargs):
            args = tuple(_cpu(a) if isinstance(a, (str, torch.device)) else a for a in args)
            if "device" in kwargs:
                kwargs["device"] = _cpu(kwargs["device"])
            return _tensor_to(self, *args, **kwargs)

        torch.Tensor.to = _to
        torch.Tensor.cuda = lambda self, *a, **k: self
        _tensor_type = torch.Tensor.type

        def _type(self, *args, **kwargs):  # Megatron's gradient clipping asserts a "torch.cuda.*Tensor"
            if args or kwargs:
                return _tensor_type(self, *args, **kwargs)
            return _tensor_type(self).replace("torch.", "torch.cuda.", 1)

        torch.Tensor.type = _type
        torch.nn.Module.cuda = lambda self, *a, **k: self
        torch.Tensor.pin_memory = lambda self, *a, **k: self

        class _Stream:
            def __init__(self, *a, **k):
                pass

            def wait_stream(self, other):
                pass

            def synchronize(self):
                pass

            def record_event(self, *a, **k):
                return _Event()

        class _Event(_Stream):
            def record(self, *a, **k):
                pass

            def wait(self, *a, **k):
                pass

            def query(self):
                return True

            def elapsed_time(self, other):
                return 0.0

        cuda = torch.cuda
        cuda.is_available = lambda: True
        cuda.device_count = lambda: 1
        cuda.current_device = lambda: CPU
        cuda.set_device = lambda *a, **k: None
        cuda.synchronize = lambda *a, **k: None
        cuda.empty_cache = lambda: None
        cuda.Stream = _Stream
        cuda.Event = _Event
        cuda.stream = lambda *a, **k: contextlib.nullcontext()
        cuda.current_stream = lambda *a, **k: _Stream()
        cuda.default_stream = lambda *a, **k: _Stream()
        cuda.memory_allocated = cuda.max_memory_allocated = cuda.memory_reserved = lambda *a, **k: 0
        cuda.max_memory_reserved = lambda *a, **k: 0
        cuda.reset_peak_memory_stats = lambda *a, **k: None
        cuda.get_device_capability = lambda *a, **k: (8, 0)

        class _Properties:
            name, major, minor, total_memory, multi_processor_count = "cpu", 8, 0, 1 << 34, 1

        cuda.get_device_properties = lambda *a, **k: _Properties()
        cuda.get_device_name = lambda *a, **k: "cpu"
        # the "cuda" generator is the CPU's default one (random ops on "cuda" tensors run there)
        class _Generators:
            def __getitem__(self, index):
                return torch.default_generator

            def __len__(self):
                return 1

        cuda.default_generators = _Generators()
        cuda._lazy_call = lambda callback, **k: callback()
        cuda.get_rng_state = cuda.random.get_rng_state = lambda *a, **k: torch.get_rng_state()
        cuda.set_rng_state = cuda.random.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
        cuda.manual_seed = cuda.manual_seed_all = lambda seed: torch.default_generator.manual_seed(int(seed))
        cuda.is_bf16_supported = lambda *a, **k: True

        from torch.utils import cpp_extension  # Megatron-LM reads nvcc's version before its (empty) kernel build

        cpp_extension.CUDA_HOME = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_home")

    import megatron_mecefo.testing.teardown  # noqa: F401,E402  (gloo groups destroyed at exit)
