"""Failure injection for tests, demos and benchmarks (the rule syntax is `megatron_mecefo.fault_rules`).

* inject.py  FaultInjector: kill / hang at (rank, step, phase, incarnation); traces
* holds.py   waits keyed to restarted ranks ("hold" rules, a trace's rejoin steps), not to the clock
"""
