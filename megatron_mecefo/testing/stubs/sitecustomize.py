"""Tests only: Megatron-DeepSpeed's processes destroy their gloo process groups at exit (teardown.py)."""
import megatron_mecefo.testing.teardown  # noqa: F401
