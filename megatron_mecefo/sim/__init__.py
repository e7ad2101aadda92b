"""A cluster-scale simulator of fault-tolerant training: MeCeFO against the alternatives.

Pure Python, seeded, no torch. Work in progress (the issue's benchmark, plot and README section are
not built yet).

* trace.py               failure traces (Poisson, Weibull, lemon nodes; repair distributions; CSV)
* engine.py              the fluid simulation of a policy between failure and repair events
* mecefo.py              MeCeFO, covering with the runtime's own ring plan (elastic/topology.py)
* checkpoint_restart.py  Young/Daly checkpoint-restart (its own segment clock)
* baselines.py           torchft, ReCoVer, Oobleck, Bamboo, spare pools (NVRx, replicated optimizer)
* presets.py             every constant, with its source
* run.py, __main__.py    one setup, all systems, means and 95 % intervals over seeds; the CLI
"""
