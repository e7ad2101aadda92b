"""The sharded optimizer state (ZeRO-1 over the live replicas), each shard also held by the replica
that covers its owner.

* shards.py        pure: the layout over a generation's replicas and the moves that re-shard it
* zero.py          ShardedOptimizer: the sharded step over the held ranges, and the gather after it
* reshard.py       Resharding: a new generation's layout, the parameters re-sent, the ranges moved
* files.py         ShardFiles: one checkpoint file per held range; the whole state collected from them
* state_source.py  where a sharded state starts from: pieces of a checkpoint's flat range
"""
