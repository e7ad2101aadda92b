"""A tiny data-parallel training job on the bare ElasticRuntime, for the fault tests and benchmarks.

Run under mecefo-launch:  mecefo-launch --nproc-per-node 3 --master-port 0 megatron_mecefo/testing/toy_train.py --out DIR ...
Reference (one process, no runtime, the whole global batch each step):  python megatron_mecefo/testing/toy_train.py --reference --world 3 --out DIR

Each step every live rank runs its micro-batches (own + adopted), sums their gradients, lets the
runtime all-reduce and scale them, and takes an Adam step when the step commits. At the end each
rank saves its parameters and optimizer state to DIR/final_rank{R}.pt.
"""

import argparse
import hashlib
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from megatron_mecefo.config import MeCeFOConfig
from megatron_mecefo.elastic.plan.fold import sample_range
from megatron_mecefo.errors import run_to_exit
from megatron_mecefo.params import GradGroup, tag_parameters

D = 8


def make_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(D, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    tag_parameters(model[0], GradGroup.MHA)  # stands in for attention: its own divisor
    return model


def sample(i):
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(D, generator=g)
    return x, torch.sin(x.sum()).reshape(1)


def micro_batch_loss(model, ids):
    xs, ys = zip(*(sample(i) for i in ids))
    return torch.nn.functional.mse_loss(model(torch.stack(xs)), torch.stack(ys))


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--k", type=int, default=2, help="micro-batches per replica")
    p.add_argument("--mb", type=int, default=4, help="samples per micro-batch")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--reference", action="store_true")
    p.add_argument("--world", type=int, default=None)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of fake compute per micro-batch")
    p.add_argument("--late-rank", type=int, default=-1,
                   help="this rank starts once the others have agreed on generation 0 without it (a late starter)")
    p.add_argument("--sharded", action="store_true",
                   help="ZeRO-1: the Adam state sharded over the live replicas (elastic/sharding/zero.py, shard_redundancy)")
    p.add_argument("--skip-micro-batch", default=None, metavar="RANK:STEP",
                   help="a buggy loop: this rank leaves out its last micro-batch at this step")
    p.add_argument("--abort-hangs", type=int, default=-1, metavar="RANK",
                   help="this rank's first abort of a data-parallel group never returns (as NCCL's can)")
    MeCeFOConfig.add_cli_args(p)
    return p.parse_args()


def hang_first_abort() -> None:
    """The first abort of a built group gets a group whose abort never returns, through the real
    bounded abort (groups.destroy_group); the real group is left to the process's exit."""
    import threading
    import types

    from megatron_mecefo.elastic.comm import groups

    real = groups.destroy_group

    def destroy(group, deadline_s=60.0):
        if group is not None and not hung:
            hung.append(group)
            group = types.SimpleNamespace(abort=threading.Event().wait)
        real(group, deadline_s)

    hung = []
    groups.destroy_group = destroy


def reference(args):
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(args.steps):
        opt.zero_grad()
        n = args.world * args.k
        for d in range(args.world):
            for j in range(args.k):
                ids = sample_range(step, d, j, micro_batch_size=args.mb, dp=args.world, k=args.k)
                micro_batch_loss(model, ids).backward()
        for p in model.parameters():
            p.grad /= n
        opt.step()
    torch.save({"params": [p.detach() for p in model.parameters()], "opt": opt.state_dict()}, args.out / "reference.pt")


def wait_for_generation_0(env) -> None:
    """Block until the job's first generation has been agreed (without this rank): a late starter
    keyed to the event, not to a delay that a slow machine could outlast."""
    from datetime import timedelta

    from megatron_mecefo.elastic.comm import store

    raw = store.client(env.master_addr, env.master_port, timedelta(seconds=300))
    job = store.job_store(raw, store.read_job(raw, f"{env.master_addr}:{env.master_port}", env.job_id)["id"])
    while not job.check(["gen0/agreed"]):
        time.sleep(0.05)


def main():
    args = parse()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.reference:
        return reference(args)
    from megatron_mecefo.elastic.faults.inject import FaultInjector
    from megatron_mecefo.elastic.interface import StateHooks
    from megatron_mecefo.elastic.reduction import Reduction
    from megatron_mecefo.elastic.runtime import ElasticRuntime

    from megatron_mecefo.config import LaunchEnv

    env = LaunchEnv.read()
    rank, world = env.rank, env.world
    if rank == args.late_rank:
        wait_for_generation_0(env)
    if rank == args.abort_hangs and env.incarnation == 0:
        hang_first_abort()
    cfg = MeCeFOConfig.from_args(args, {"log_dir": str(args.out)})
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sharded = None
    if args.sharded:
        from megatron_mecefo.elastic.sharding.zero import ShardedOptimizer

        sharded = ShardedOptimizer(opt, neighbour_copy=cfg.shard_redundancy == "neighbour", on_loss=cfg.on_shard_loss)

    def save_checkpoint():  # the runtime calls it on one state holder when the job gives up
        path = args.out / f"checkpoint_rank{rank}.pt"
        torch.save({"params": [p.detach() for p in model.parameters()], "opt": opt.state_dict(), "step": rt.step}, path)
        return str(path)

    def save_shards():  # every holder of a sharded state, beside the one save_checkpoint
        torch.save({"step": rt.step, "shards": held_shards()}, args.out / f"giveup_shards_rank{rank}.pt")

    def held_shards():  # what this rank holds: (start, end, per-element state, step per element)
        return [(h.start, h.end, {k: h.state[k].clone() for k in sharded.keys},
                 sharded._scalar_elems(h, h.start, h.end)[0]) for h in sharded.held.values()]

    state = StateHooks(get=lambda: {"model": model.state_dict(), "opt": opt.state_dict()},
                       set=lambda s: (model.load_state_dict(s["model"]), opt.load_state_dict(s["opt"])),
                       save_checkpoint=save_checkpoint, save_shards=save_shards if sharded is not None else None)
    rt = ElasticRuntime(cfg, env, micro_batches=args.k, state=state, sharding=sharded,
                        injector=FaultInjector.for_job(cfg, env, train_iters=args.steps))
    reduction = Reduction(rt.latch, sharding=sharded)
    step = 0

    def train():  # run_to_exit maps how it ends to the launchers' exit codes, as the examples do
        nonlocal step
        step = rt.start()
        while step < args.steps:
            rt.begin_step(step)
            plan = rt.plan()
            digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
            opt.zero_grad(set_to_none=True)
            loss_sum, samples = 0.0, 0
            skip = args.skip_micro_batch == f"{rank}:{step}"
            for mb in plan.micro_batches[:-1] if skip else plan.micro_batches:
                ids = sample_range(step, mb.replica, mb.index, micro_batch_size=args.mb, dp=world, k=args.k)
                rt.latch.fire("forward")
                loss = micro_batch_loss(model, ids)
                rt.latch.fire("backward")
                loss.backward()
                time.sleep(args.step_sleep)
                loss_sum += loss.item()
                samples += len(ids)
            total_loss, total_samples = reduction.reduce(model.parameters(), stats=[loss_sum, samples],
                                                         micro_batches=len(plan.micro_batches) - skip)
            if rt.commit(loss=total_loss / plan.divisor, samples=int(total_samples), param_sha256=digest):
                rt.latch.fire("optimizer")
                opt.step()
                step += 1
                rt.after_optimizer_step()  # a peer died after the commit (the parameter gather): regroup now
        return True

    if not run_to_exit(train):  # JobFinished: a restarted rank came back after the end
        return
    shards = held_shards() if sharded is not None else None
    torch.save({"params": [p.detach() for p in model.parameters()], "opt": opt.state_dict(), "step": step,
                "generation": rt.generation, "shards": shards}, args.out / f"final_rank{rank}.pt")
    rt.close()


if __name__ == "__main__":
    main()
