"""Adapters for other people's training loops: they translate a loop's hooks into the runtime's
protocol and put MeCeFO's covering backward into that codebase's own layers.

* megatron_deepspeed   deepspeedai/Megatron-DeepSpeed (legacy `megatron/model` layers, its own
                       vendored `megatron.core`): `patches/megatron-deepspeed`.

Each adapter imports its codebase's `megatron` package lazily (at install time), never ours'
megatron-core-only APIs: Megatron-DeepSpeed's `megatron/` shadows a pip-installed megatron-core.
"""
