"""MeCeFO's fault-tolerance runtime: knows ranks, groups and micro-batches, not layers.

Start at step.py: its docstring walks one step, healthy and with a peer dying in it. The modules
here are the step and its runtime; the sub-packages below them never import these.

* attach.py     the composition root: a host joins the job and gets its StepDriver
* step.py       StepDriver: the one training step of every host (plan, covering, reduce, commit, redo)
* interface.py  what a host and the runtime hand each other: StepPlan, StateHooks
* reduction.py  the step's reduction across replicas: flat, sharded, or overlapped in buckets
* runtime.py    ElasticRuntime: the step protocol (begin, plan, commit, recover), wiring its parts:
* current.py      Current: where the rank stands (generation, members, group, step)
* committing.py   Committer: whether a step commits, alike on every member (confirmation or vote)
* regrouping.py   Regrouping: installing generations (start, rejoin, admission, after a failure)
* latch.py        StepLatch: the step in progress as the reduction sees it (the error latch, statistics)
* marks.py        HostMarks: a host's marks in the job's store, who speaks for a dead lead
* rebalancing.py  Rebalancing: the replicas' speeds in the step's statistics, a slow one's plan
* formation.py  forming a generation: agree, build the groups, re-shard, hand joiners the state
* give_up.py    the give-up checkpoint: one whole replica writes it, every holder its shards
* leaving.py    a rank leaves: retire (exit 4, restarted, rejoins) or give up (exit 3, the job ends)

* plan/         pure: topology, fold, cover plan, costs, fail-slow rebalance (shared with the simulator)
* comm/         process groups, the step's collectives, the job's store, the NCCL environment
* sharding/     the sharded optimizer state, its layout and re-shard
* membership/   the control plane (store-backed): liveness, agreement, the per-step vote, admission
* launch/       mecefo-launch, mecefo-store, the keeper, a rank's bootstrap
* faults/       failure injection: kill / hang / slow rules, traces, waits keyed to restarted ranks
"""

import importlib

# Lazy (PEP 562): importing one module of the package does not import the runtime.
_EXPORTS = {
    "CoverMap": "plan.topology", "Grid": "plan.topology", "ring_cover": "plan.topology",
    "Fold": "plan.fold", "MicroBatch": "plan.fold", "fold_neighbor": "plan.fold", "sample_range": "plan.fold",
    "FaultInjector": "faults.inject",
    "ElasticRuntime": "runtime", "StepPlan": "interface", "StateHooks": "interface",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"megatron_mecefo.elastic.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'megatron_mecefo.elastic' has no attribute {name!r}")
