"""The sharded optimizer state (ZeRO-1 over the live replicas), each shard also held by the replica
that covers its owner.

* shards.py        pure: the layout over a generation's replicas and the moves that re-shard it
* zero.py          ShardedOptimizer: the sharded step, re-sharding and its checkpoint files
* state_source.py  where a sharded state starts from: pieces of a checkpoint's flat range
"""
