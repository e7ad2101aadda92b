"""Tests only: destroy torch.distributed's process groups at interpreter exit.

Upstream Megatron-DeepSpeed and Megatron-LM end without destroying their process groups. With
NCCL that is harmless; with the gloo groups they build on a CPU machine, interpreter teardown
sometimes destroys a group while its worker thread runs, and the process aborts ("terminate called
without an active exception", exit -6) after the run has finished, unpatched or patched alike.
Imported by the shims' sitecustomize (stubs/, fake_cuda/) in the upstream checkouts' processes.
"""

import atexit


def _destroy_process_groups() -> None:
    import sys

    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


atexit.register(_destroy_process_groups)
