"""A cluster-scale simulator of fault-tolerant training: MeCeFO against the alternatives.

Pure Python, seeded, no torch: `python -m megatron_mecefo.sim --help`; the paper's table and the
runs at scale: benchmarks/simulate_paper.py; the design: docs/design.md.

* trace.py               failure traces (Poisson, Weibull, lemon nodes; repair distributions; CSV;
                         Oobleck's node-event traces)
* engine.py              the fluid simulation of a policy between failure and repair events
* mecefo.py              MeCeFO, covering with the runtime's own ring plan and fold (elastic/); the
                         spread and sharded-optimizer what-ifs
* failslow.py            fail-slow episodes and the job's pace with and without the runtime's
                         rebalancing (FALCON's durations and delay, assumed severities)
* checkpoint_restart.py  Young/Daly checkpoint-restart (its own segment clock)
* baselines.py           torchft, ReCoVer, ReCycle, Oobleck, Bamboo, spare pools (NVRx in-process and
                         local checkpoints, replicated optimizer)
* presets.py             every constant, with its source
* run.py, __main__.py    one setup, all systems, means and 95 % intervals over seeds; the CLI
"""
