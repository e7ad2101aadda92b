"""The record (integrations/record.py) on one rank, with fakes for the job's store and upstream's
training module: what a non-lead replica holds is printed, and written to TensorBoard, by it once
it leads, after the store's mark; the last entries of a lead that died at the end are printed by
the lowest replica left."""

import types

import pytest
import torch

from megatron_mecefo.elastic.current import Current
from megatron_mecefo.elastic.marks import HostMarks
from megatron_mecefo.elastic.plan.topology import CoverMap, Grid
from megatron_mecefo.integrations.record import Record

pytestmark = pytest.mark.unit


class FakeStore(dict):
    def check(self, keys):
        return all(k in self for k in keys)

    def get(self, key):
        return super().__getitem__(key).encode()

    def set(self, key, value):
        self[key] = value


class FakeWriter:
    def __init__(self):
        self.calls = []

    def add_scalar(self, *args):
        self.calls.append(args)


def make(replica, lead, alive=(0, 1, 2), grid=None, store=None, rank=None):
    store, writer = FakeStore() if store is None else store, FakeWriter()
    grid = grid or Grid(dp=3)
    now = Current(rank=replica if rank is None else rank, grid=grid, k=1,
                  cover=CoverMap(grid=grid, live=(0, 1, 2), cover={}))
    membership = types.SimpleNamespace(alive=lambda ranks: [r for r in ranks if r in alive])
    rt = types.SimpleNamespace(marks=HostMarks(store, now, membership))  # the runtime's own answers
    driver = types.SimpleNamespace(runtime=rt, committed=0)
    run = types.SimpleNamespace(active=True, driver=driver, lead=lambda: lead[0])
    training = types.SimpleNamespace(get_tensorboard_writer=lambda: None, get_wandb_writer=lambda: None)

    def training_log(iteration):  # upstream's: prints and writes through the module's getter
        print(f" iteration {iteration}")
        w = training.get_tensorboard_writer()
        if w is not None:
            w.add_scalar("lm loss", 1.0 / iteration, iteration)

    record = Record(run, training, make_tb_writer=lambda: writer)
    return record, record.wrap(training_log), driver, store, writer


def test_a_new_lead_prints_what_the_old_one_had_not(capsys):
    lead = [False]
    record, log, driver, store, writer = make(replica=1, lead=lead)
    for it in (4, 5):
        driver.committed = it
        log(it)
    assert capsys.readouterr().out == "" and writer.calls == []  # not the lead: held
    store.set("record/emitted/t0p0", "[4, 0]")  # the old lead printed iteration 4, then died
    lead[0] = True
    driver.committed = 6
    log(6)
    assert capsys.readouterr().out == " iteration 5\n iteration 6\n"
    assert writer.calls == [("lm loss", 1 / 5, 5), ("lm loss", 1 / 6, 6)], "TensorBoard moves with the lead"
    assert store["record/emitted/t0p0"] == "[6, 0]"
    driver.committed = 7
    log(7)
    assert capsys.readouterr().out == " iteration 7\n"


def test_each_position_of_a_replica_keeps_its_own_mark(capsys):
    """A pipeline's first stage emitting its entry of an iteration (its memory report) must not
    hide the last stage's loss line of the same iteration: the marks are per (tp, pp) position."""
    grid, store = Grid(dp=2, pp=2), FakeStore()  # replica 0: rank 0 (stage 0), rank 2 (stage 1)
    first, log_first, d_first, _, _ = make(0, [True], grid=grid, store=store, rank=0)
    last, log_last, d_last, _, _ = make(0, [True], grid=grid, store=store, rank=2)
    d_first.committed = d_last.committed = 1
    log_first(1)  # the first stage prints (and marks) its entry of iteration 1 first
    log_last(1)
    assert capsys.readouterr().out == " iteration 1\n iteration 1\n"
    assert store["record/emitted/t0p0"] == store["record/emitted/t0p1"] == "[1, 0]"


def test_the_lowest_replica_left_prints_the_end_of_a_dead_lead(capsys):
    record, log, driver, store, writer = make(replica=1, lead=[False], alive=(1, 2))
    driver.committed = 8
    log(8)
    store.set("record/emitted/t0p0", "[7, 0]")
    record.finish(timeout_s=1.0)
    assert capsys.readouterr().out == " iteration 8\n"
    other, log2, driver2, store2, _ = make(replica=2, lead=[False], alive=(1, 2))
    driver2.committed = 8
    log2(8)
    store2.set("record/emitted/t0p0", "[7, 0]")
    other.finish(timeout_s=0.3)  # replica 1 is alive and lower: replica 2 stays quiet
    assert capsys.readouterr().out == ""


def _upstream_training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                           skipped_iter, grad_norm, params_norm, num_zeros_in_grad, is_first_iteration=False):
    """Megatron-LM's accumulation, log interval 2: sums per interval, the first line keeps them."""
    total_loss_dict["advanced iterations"] = total_loss_dict.get("advanced iterations", 0) + 1
    for key, value in loss_dict.items():
        total_loss_dict[key] = total_loss_dict.get(key, torch.tensor([0.0])) + value
    if iteration % 2 == 0 or is_first_iteration:
        mean = total_loss_dict["lm loss"].item() / total_loss_dict["advanced iterations"]
        print(f" iteration {iteration} | lm loss: {mean:.6E} |" + (" memory" if report_memory_flag else ""))
        report_memory_flag = False
        if not is_first_iteration:
            total_loss_dict["lm loss"] = torch.tensor([0.0])
            total_loss_dict["advanced iterations"] = 0
    return report_memory_flag


def _train(driver, log, iterations, losses, loop=None):
    """upstream's train(): its locals (`loop`) start afresh in every process."""
    loop = loop if loop is not None else {"sums": {}, "flag": True, "first": True}
    for it in iterations:
        driver.committed = it
        loop["flag"] = log({"lm loss": torch.tensor([losses[it]])}, loop["sums"], 1e-3, it, 1.0, loop["flag"], 0,
                           1.0, None, None, is_first_iteration=loop["first"])
        loop["first"] = False
    return loop


def test_a_rejoining_rank_takes_the_others_log_sums_and_flags(capsys):
    """A rank restarted in the middle of a log interval prints the line the others print: it
    receives their sums (here iteration 5's loss), their memory flag (reported already) and that
    the first line is behind them; a rank that starts afresh would print iteration 6 alone."""
    losses = {it: float(it) for it in range(3, 9)}
    stayed, _, stayed_driver, _, _ = make(replica=1, lead=[True])
    stayed_log = stayed.wrap(_upstream_training_log, carries=True)
    loop = _train(stayed_driver, stayed_log, range(3, 6), losses)  # logs 3 (first) and 4, holds 5
    assert stayed.carry.state() == {"sums": {"advanced iterations": 1, "lm loss": 5.0}, "report_memory": False}
    joiner, _, joiner_driver, _, _ = make(replica=0, lead=[True])
    joiner.carry.receive(stayed.carry.state())  # with the counters, in the state transfer
    capsys.readouterr()
    _train(joiner_driver, joiner.wrap(_upstream_training_log, carries=True), range(6, 9), losses)
    _train(stayed_driver, stayed_log, range(6, 9), losses, loop)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [" iteration 6 | lm loss: 5.500000E+00 |", " iteration 8 | lm loss: 7.500000E+00 |"] * 2
    fresh, _, fresh_driver, _, _ = make(replica=2, lead=[True])
    _train(fresh_driver, fresh.wrap(_upstream_training_log, carries=True), range(6, 7), losses)
    assert capsys.readouterr().out.splitlines() == [" iteration 6 | lm loss: 6.000000E+00 | memory"]
