"""Pure planning, shared with the simulator (`megatron_mecefo.sim`): no torch.distributed, no store.

* topology.py   the rank grid, the ring neighbour, the cover map for a set of live ranks
* fold.py       micro-batches per replica, gradient divisors, sample ranges
* cover_plan.py the cover planner ("neighbour", "spread"): who runs which lost micro-batch, in which mode
* costs.py      the micro-batch costs each rank measures, and the costs a generation agrees on
"""
