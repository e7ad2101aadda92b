"""Starting and keeping the ranks of a job.

* cli.py           mecefo-launch (`python -m megatron_mecefo.elastic.launch`): the ranks of a node and the job's store
* supervise.py     Supervisor: report a crash at once, restart the rank so it rejoins, end with the job
* keeper.py        the same for one rank under another launcher (deepspeed, torchrun, srun)
* store_daemon.py  mecefo-store: a store that outlives every training rank
* bootstrap.py     a rank joins its job: the store, its replica's group, the control plane
"""
