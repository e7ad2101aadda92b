"""MeCeFO's fault-tolerance runtime: knows ranks, groups and micro-batches, not layers.

* topology.py   pure: rank grid, ring neighbour, cover map
* fold.py       pure: micro-batches per replica, gradient divisors, sample ranges
* membership.py heartbeats, agreement on members, the per-step commit decision (store-backed)
* groups.py     data-parallel process groups per generation
* reference.py  reference_gradient: the gradient of one step in one process (for checks)
* runtime.py    ElasticRuntime: begin_step / plan / reduce_gradients / commit
* inject.py     FaultInjector: kill / hang at (rank, step, phase, incarnation)
* chaos.py      seeded random failure schedules, a runner, and the invariants every run must satisfy
* store.py      the job's store: listens on MASTER_ADDR, one job id, keys namespaced by it
* launch.py     mecefo-launch; store_daemon.py for other launchers
"""

import importlib

# Lazy (PEP 562), so that importing one module of the package (config.py imports inject.py) does
# not import the runtime, which imports config.
_EXPORTS = {
    "CoverMap": "topology", "Grid": "topology", "ring_cover": "topology",
    "Fold": "fold", "MicroBatch": "fold", "fold_neighbor": "fold", "sample_range": "fold",
    "FaultInjector": "inject", "reference_gradient": "reference",
    "ElasticRuntime": "runtime", "StepPlan": "runtime",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"megatron_mecefo.elastic.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'megatron_mecefo.elastic' has no attribute {name!r}")
