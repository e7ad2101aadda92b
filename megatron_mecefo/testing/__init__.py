"""Helpers of the project's tests and benchmarks (as `torch.testing` is torch's): not needed to train.

* launch.py     run a launcher command in its own session; kill the whole group on timeout
* toy_train.py  a tiny data-parallel job on the bare runtime (a script), and its fault-free reference
* chaos_runs.py chaos schedules on the toy job and on examples/pretrain_gpt (testing/chaos.py checks them)
* mds.py, mlm.py  upstream snapshots of Megatron-DeepSpeed / Megatron-LM: extract, patch, launch, parse
  their logs; stubs/ (torchvision) and fake_cuda/ (a CPU stand-in for CUDA, Megatron-LM's loop only)
  are put on those processes' PYTHONPATH, never imported here

The modules that run upstream checkouts or the examples need a source checkout of this project
(they find the examples and the shims next to this package). A missing snapshot or extra raises
unittest.SkipTest, which pytest reports as a skip.
"""
