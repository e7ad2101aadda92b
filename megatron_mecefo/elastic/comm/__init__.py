"""Communication: process groups, the step's collectives, the job's store, the NCCL environment.

* groups.py       data-parallel process groups, rebuilt among the members of each generation
* replica.py      a replica's own process group (its T*P ranks), formed per replica epoch
* gradients.py    the flat all-reduce of gradients and statistics, and MeCeFO's divisors
* shard_grads.py  the reduce-scatter of a step whose optimizer state is sharded
* transfer.py     the training state handed to a rejoining rank
* store.py        the job's store: where it listens, its job id, keys namespaced by it
* nccl_env.py     the process environment that in-process NCCL recovery needs
"""
