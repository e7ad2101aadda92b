"""The sharded optimizer (ZeRO-1 with neighbour copies) against a replicated AdamW, over real gloo
groups: the same parameters after steps at 4 replicas, after a re-shard to 3 (a replica gone,
its shard taken from the copy), after a joiner comes back (4 again), and from a sharded checkpoint
at another replica count; two adjacent replicas gone lose a shard."""

import gc
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_mecefo.elastic.sharding.zero import ShardedOptimizer, ShardLost
from megatron_mecefo.params import GradGroup
from megatron_mecefo.testing.launch import free_port

pytestmark = pytest.mark.dist


def model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3)).to(dtype)


def optimizer(m):
    decay = [p for p in m.parameters() if p.dim() > 1]
    rest = [p for p in m.parameters() if p.dim() <= 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=1e-2, betas=(0.9, 0.95))


def grads_of_step(m, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in m.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def reference(steps, dtype=torch.float32):
    """Parameters of a replicated AdamW after each step, with the test's schedule (lr halves at 3);
    a bf16 model the mixed-precision way (fp32 masters stepped, copied into the model)."""
    m = model(dtype)
    masters = m if dtype == torch.float32 else model()  # fp32 copies of the same initial values
    with torch.no_grad():
        for p, q in zip(masters.parameters(), m.parameters()):
            p.copy_(q.float())
    opt = optimizer(masters)
    out = []
    for s in range(steps):
        for group in opt.param_groups:
            group["lr"] = 1e-2 if s < 3 else 5e-3
        grads_of_step(m, s)
        for p, q in zip(masters.parameters(), m.parameters()):
            p.grad = q.grad.float()
        opt.step()
        with torch.no_grad():
            for p, q in zip(masters.parameters(), m.parameters()):
                q.copy_(p)
        out.append(torch.cat([p.detach().reshape(-1).clone() for p in m.parameters()]))
    return out


def group_of(store, generation, peers, rank):
    prefix = dist.PrefixStore(f"gen{generation}", store)
    return dist.ProcessGroupGloo(prefix, peers.index(rank), len(peers), timedelta(seconds=30))


def worker(rank, port, schedule, load, save, start_step, out, on_loss="give_up", dtype=torch.float32):
    """`schedule`: [(live ranks, steps)], one generation each; a rank not live in a generation is
    gone and comes back without state (a joiner). `load`/`save`: shard files to start from / to
    write at the end. Writes its parameters after every step."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, None, rank == 0, timeout=timedelta(seconds=60), wait_for_workers=False)
    m = model(dtype)
    sharded = ShardedOptimizer(optimizer(m), on_loss=on_loss)
    if load:
        sharded.load(load)
        with torch.no_grad():  # the module of the checkpoint (every replica loads it)
            for p, v in zip(m.parameters(), torch.load(os.path.join(load, "module.pt"))):
                p.copy_(v)
    params, step, record, group = list(m.parameters()), start_step, {}, None
    for generation, (live, steps) in enumerate(schedule):
        if rank not in live:
            sharded = ShardedOptimizer(optimizer(m), on_loss=on_loss)  # its state is gone with it
            step += steps
            continue
        previous = schedule[generation - 1][0] if generation else live
        holders = [r for r in live if r in previous]
        group = group_of(store, generation, list(live), rank)
        try:
            pending = sharded.resharding.regroup(group, list(live), list(live), holders, rank, replicas_total=5)
        except ShardLost as e:
            record["lost"] = str(e)
            break
        sharded.resharding.install(pending)
        record.setdefault("lost_ranges", []).extend(sharded.last_reshard.lost)
        for _ in range(steps):
            for group_ in sharded.optimizer.param_groups:
                group_["lr"] = 1e-2 if step < 3 else 5e-3
            grads_of_step(m, step)
            sharded.optimizer.step()
            assert sharded.gather_error is None, sharded.gather_error
            record[step] = torch.cat([p.detach().reshape(-1).clone() for p in params])
            step += 1
        record["bytes"] = sharded.nbytes()
        record["replicated_bytes"] = sharded.replicated_nbytes()
    if save and "lost" not in record:
        sharded.files.save(save)
        if rank == 0:
            torch.save([p.detach().clone() for p in params], os.path.join(save, "module.pt"))
    torch.save(record, os.path.join(out, f"rank{rank}.pt"))
    # destroy the gloo group while the interpreter is alive: destroyed during interpreter teardown, it
    # can abort the process ("terminate called without an active exception") after a passing run
    sharded = group = None
    gc.collect()


def run(out, schedule, world=4, load=None, save=None, start_step=0, on_loss="give_up", dtype=torch.float32):
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    mp.spawn(worker, args=(port, schedule, load, save, start_step, str(out), on_loss, dtype), nprocs=world, join=True)
    return {r: torch.load(out / f"rank{r}.pt") for r in range(world)}


def test_sharded_steps_equal_replicated_through_a_failure_a_rejoin_and_a_checkpoint(tmp_path):
    ref = reference(12)
    ckpt = str(tmp_path / "ckpt")
    # 4 replicas, replica 1 gone (its shard from replica 2's copy), back (it receives its shard and copy)
    records = run(tmp_path / "a", [([0, 1, 2, 3], 2), ([0, 2, 3], 2), ([0, 1, 2, 3], 3)], save=ckpt)
    for rank, rec in records.items():
        steps = [s for s in rec if isinstance(s, int)]
        assert steps == ([0, 1, 2, 3, 4, 5, 6] if rank != 1 else [0, 1, 4, 5, 6])
        for s in steps:
            assert torch.equal(rec[s], ref[s]), (rank, s, (rec[s] - ref[s]).abs().max())
    numel = ref[0].numel()
    assert records[0]["replicated_bytes"] == numel * 8  # exp_avg, exp_avg_sq (the parameters are the model)
    assert sum(rec["bytes"] for rec in records.values()) == 2 * numel * 8  # each element twice: shard + copy
    # the checkpoint of 4 replicas resumes at 3, and 2 replicas then lose their shard
    resumed = run(tmp_path / "b", [([0, 1, 2], 5)], world=3, load=ckpt, start_step=7)
    for rank, rec in resumed.items():
        for s in range(7, 12):
            assert torch.equal(rec[s], ref[s]), (rank, s)


def test_a_bf16_model_keeps_sharded_fp32_masters(tmp_path):
    """The optimizer's parameters in bf16 (no host fp32 copies): the held ranges keep fp32 masters,
    which travel in the re-shard and the shard files. The bf16 parameters equal a replicated
    mixed-precision AdamW's bit for bit through a failure, a rejoin and a resume at 3 replicas."""
    ref = reference(12, torch.bfloat16)
    ckpt = str(tmp_path / "ckpt")
    records = run(tmp_path / "a", [([0, 1, 2, 3], 2), ([0, 2, 3], 2), ([0, 1, 2, 3], 3)], save=ckpt,
                  dtype=torch.bfloat16)
    for rank, rec in records.items():
        for s in (s for s in rec if isinstance(s, int)):
            assert torch.equal(rec[s], ref[s]), (rank, s, (rec[s].float() - ref[s].float()).abs().max())
    numel = ref[0].numel()
    assert records[0]["replicated_bytes"] == numel * 12  # fp32 master, exp_avg, exp_avg_sq
    assert sum(rec["bytes"] for rec in records.values()) == 2 * numel * 12  # each element twice: shard + copy
    resumed = run(tmp_path / "b", [([0, 1, 2], 5)], world=3, load=ckpt, start_step=7, dtype=torch.bfloat16)
    for rank, rec in resumed.items():
        for s in range(7, 12):
            assert torch.equal(rec[s], ref[s]), (rank, s)


def test_two_adjacent_replicas_gone_lose_a_shard_everywhere(tmp_path):
    records = run(tmp_path, [([0, 1, 2, 3], 1), ([0, 3], 1)])
    for rank in (0, 3):
        assert "lost" in records[rank] and "[" in records[rank]["lost"]


def test_reinit_restarts_only_the_lost_range_as_a_fresh_adamw(tmp_path):
    """on_loss "reinit": replicas 1 and 2 gone together after step 1 lose replica 1's shard (its
    copy was on 2). Outside it the survivors go on exactly as the replicated AdamW; inside it as a
    fresh AdamW started from the parameters of that moment (moments zero, step 0: the bias
    correction of a fresh start); and through a checkpoint of mixed step counts too."""
    ckpt = str(tmp_path / "ckpt")
    records = run(tmp_path / "a", [([0, 1, 2, 3], 2), ([0, 3], 3)], on_loss="reinit", save=ckpt)
    ref = reference(5)
    m = model()
    with torch.no_grad():
        for p, v in zip(m.parameters(), torch.split(ref[1], [p.numel() for p in m.parameters()])):
            p.copy_(v.view_as(p))
    fresh = optimizer(m)
    restarted = {}
    for s in range(2, 8):
        for group in fresh.param_groups:
            group["lr"] = 1e-2 if s < 3 else 5e-3
        grads_of_step(m, s)
        fresh.step()
        restarted[s] = torch.cat([p.detach().reshape(-1).clone() for p in m.parameters()])
    (a, b), = records[0]["lost_ranges"]
    assert (a, b) == records[3]["lost_ranges"][0] and 0 < a < b < ref[0].numel()
    for rank in (0, 3):
        for s in range(2, 5):
            got = records[rank][s]
            assert torch.equal(got[:a], ref[s][:a]) and torch.equal(got[b:], ref[s][b:]), (rank, s)
            assert torch.equal(got[a:b], restarted[s][a:b]), (rank, s)
    resumed = run(tmp_path / "b", [([0, 1, 2], 3)], world=3, load=ckpt, start_step=5)
    full = reference(8)
    for s in range(5, 8):
        got = resumed[0][s]
        assert torch.equal(got[:a], full[s][:a]) and torch.equal(got[a:b], restarted[s][a:b]), s


def rs_worker(rank, port, world, neighbour, out):
    """Every rank's own summed gradients (and stats), reduced both ways over one gloo group."""
    from megatron_mecefo.elastic.comm.gradients import divisor_scale, reduce_with_divisors
    from megatron_mecefo.elastic.comm.shard_grads import reduce_scatter_with_divisors

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, None, rank == 0, timeout=timedelta(seconds=60), wait_for_workers=False)
    live = list(range(world))
    m = model()
    m[2].weight.mecefo_grad_group = GradGroup.MHA  # one attention-like parameter: its own divisor
    sharded = ShardedOptimizer(optimizer(m), neighbour_copy=neighbour)
    reshard = sharded.resharding
    reshard.install(reshard.regroup(group_of(store, 0, live, rank), live, live, live, rank, replicas_total=world))
    group = group_of(store, 1, live, rank)

    def local():
        g = torch.Generator().manual_seed(7 + rank)
        for p in m.parameters():
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)

    local()
    stats = reduce_with_divisors(group, list(m.parameters()), [1.0 + rank, 2.0], divisor=6, divisor_mha=4)
    whole = [p.grad.clone() for p in sharded.params]  # the layout's order: the optimizer's groups
    local()
    scattered_stats = reduce_scatter_with_divisors(sharded, group, [1.0 + rank, 2.0], attr="grad",
                                                   scale=lambda p, _stats: divisor_scale(p, 6, 4))
    torch.save({"stats": (stats, scattered_stats), "whole": whole, "got": [p.grad.clone() for p in sharded.params],
                "sq": [sharded.grad_norm_sq(p) for p in sharded.params],
                "held": [(a, b) for a, b in sharded.layout.held(rank).values()]}, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.parametrize("neighbour", [True, False])
def test_reduce_scatter_gives_each_rank_its_ranges_of_the_all_reduced_gradient(tmp_path, neighbour):
    """The sharded step's reduction (shard_grads.py) against the all-reduce: each rank holds the
    all-reduced, divided gradient on its shard (and on its copy, from the copy's owner), zeros
    elsewhere; the per-parameter squared norms are the whole gradient's on every rank."""
    world = 3
    port = free_port()
    mp.spawn(rs_worker, args=(port, world, neighbour, str(tmp_path)), nprocs=world, join=True)
    for rank in range(world):
        rec = torch.load(tmp_path / f"rank{rank}.pt")
        assert rec["stats"][0] == rec["stats"][1] == [6.0, 6.0]
        whole = torch.cat([g.reshape(-1) for g in rec["whole"]])
        got = torch.cat([g.reshape(-1) for g in rec["got"]])
        mask = torch.zeros_like(whole, dtype=torch.bool)
        for a, b in rec["held"]:
            mask[a:b] = True
        assert len(rec["held"]) == (2 if neighbour else 1)
        assert torch.allclose(got[mask], whole[mask], rtol=1e-6, atol=1e-7) and not got[~mask].any()
        for g, sq in zip(rec["whole"], rec["sq"]):
            assert sq == pytest.approx(float(g.double().square().sum()), rel=1e-6)


class _LeavesBeforeTheMoves:
    """A peer's group that, at the re-shard's moves, marks the generation failed and stops taking
    part without closing its connections (as a peer that saw another failure first does)."""

    def __init__(self, group, store):
        self.group, self.store = group, store

    def __getattr__(self, name):
        return getattr(self.group, name)

    def alltoall_base(self, *args):
        self.store.set("gen1/formed", "no")
        raise RuntimeError("left the generation")


def abort_worker(rank, port, where, out):
    """Generation 0: 4 replicas. Generation 1: replica 3 gone; rank 2 leaves it `where` ("layout":
    before anything, "moves": at the all-to-all) and marks it failed, keeping its sockets open;
    ranks 0 and 1 re-shard with the runtime's should_abort and must stop at once, not after the
    group's 30 s timeout."""
    import time

    from megatron_mecefo.elastic.comm.groups import PeerAborted

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, None, rank == 0, timeout=timedelta(seconds=60), wait_for_workers=False)
    live = [0, 1, 2, 3]
    sharded = ShardedOptimizer(optimizer(model()))
    reshard = sharded.resharding
    reshard.install(reshard.regroup(group_of(store, 0, live, rank), live, live, live, rank, replicas_total=4))
    if rank == 3:
        store.wait(["done/0", "done/1"])
        return
    live = [0, 1, 2]
    group = group_of(store, 1, live, rank)
    failed = lambda: store.check(["gen1/formed"]) and store.get("gen1/formed") == b"no"  # noqa: E731
    if rank == 2:
        if where == "layout":
            store.set("gen1/formed", "no")
        else:
            try:
                sharded.resharding.regroup(_LeavesBeforeTheMoves(group, store), live, live, live, rank, replicas_total=4)
            except RuntimeError:
                pass
        store.wait(["done/0", "done/1"])
        return
    t0 = time.monotonic()
    try:
        sharded.resharding.regroup(group, live, live, live, rank, replicas_total=4, should_abort=failed)
        outcome = "finished"
    except PeerAborted:
        outcome = "aborted"
    except Exception as e:  # noqa: BLE001 - the test inspects it
        outcome = f"{type(e).__name__}: {e}"
    torch.save({"outcome": outcome, "s": time.monotonic() - t0}, os.path.join(out, f"rank{rank}.pt"))
    store.set(f"done/{rank}", "1")
    group = None
    gc.collect()


@pytest.mark.parametrize("where", ["layout", "moves"])
def test_a_regroup_stops_waiting_once_a_peer_marks_the_generation_failed(tmp_path, where):
    mp.spawn(abort_worker, args=(free_port(), where, str(tmp_path)), nprocs=4, join=True)
    for rank in (0, 1):
        rec = torch.load(tmp_path / f"rank{rank}.pt")
        assert rec["outcome"] == "aborted" and rec["s"] < 15, rec
