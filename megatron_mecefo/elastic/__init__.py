"""MeCeFO's fault-tolerance runtime: knows ranks, groups and micro-batches, not layers.

Start at step.py: its docstring walks one step, healthy and with a peer dying in it.

* attach.py     the composition root: a host joins the job and gets its StepDriver
* step.py       StepDriver: the one training step of every host (plan, covering, reduce, commit, redo)
* reduction.py  the step's reduction across replicas: flat, sharded, or overlapped in buckets
* runtime.py    ElasticRuntime: the error latch, the commit, recovery and give-up
* formation.py  forming a generation: agree, build the groups, re-shard, hand joiners the state
* membership/   the control plane (store-backed): liveness, agreement, the sharded state's vote, admission
* groups.py     data-parallel process groups per generation
* topology.py   pure: rank grid, ring neighbour, cover map
* fold.py       pure: micro-batches per replica, gradient divisors, sample ranges
* cover_plan.py pure: the cover planner ("neighbour", "spread"): who runs which lost micro-batch, in which mode
* costs.py      pure: micro-batch costs each rank measures, and the costs a generation agrees on
* holds.py      waits keyed to restarted ranks ("hold" rules, a trace's rejoin steps)
* give_up.py    the give-up checkpoint: one whole replica writes it, every holder its shards
* gradients.py, shard_grads.py  the reduction's arithmetic (all-reduce / reduce-scatter, divisors)
* zero.py, shards.py  the sharded optimizer state, its layout and re-shard; transfer.py: a joiner's state
* inject.py     FaultInjector: kill / hang at (rank, step, phase, incarnation); traces
* chaos.py      seeded random failure schedules, a runner, and the invariants every run must satisfy
* reference.py  reference_gradient: the gradient of one step in one process (for checks)
* store.py      the job's store: listens on MASTER_ADDR, one job id, keys namespaced by it
* launch.py     mecefo-launch; store_daemon.py, keeper.py, bootstrap.py for other launchers
"""

import importlib

# Lazy (PEP 562): importing one module of the package does not import the runtime.
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
