"""MeCeFO's fault-tolerance runtime: knows ranks, groups and micro-batches, not layers.

* topology.py   pure: rank grid, ring neighbour, cover plan
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

from megatron_mecefo.elastic.fold import Fold, MicroBatch, fold_neighbor, sample_range
from megatron_mecefo.elastic.inject import FaultInjector
from megatron_mecefo.elastic.reference import reference_gradient
from megatron_mecefo.elastic.runtime import ElasticRuntime, StepPlan
from megatron_mecefo.elastic.topology import CoverPlan, Grid, plan_cover

__all__ = [
    "CoverPlan", "ElasticRuntime", "FaultInjector", "Fold", "Grid", "MicroBatch", "StepPlan",
    "fold_neighbor", "plan_cover", "reference_gradient", "sample_range",
]
