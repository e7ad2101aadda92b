"""What a rejoining rank receives (elastic/step.py `training_state`): the peer's scheduler replaces
the rank's own, even where the host's scheduler adds a loaded step count to its own."""

import pytest
import torch

from megatron_mecefo.elastic.step import training_state

pytestmark = pytest.mark.unit


def _scheduler(optimizer):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=12,
                                   lr_decay_steps=72, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                   wd_incr_steps=72, wd_incr_style="constant")


def test_a_rank_that_loaded_a_checkpoint_takes_the_peers_scheduler_count():
    """Megatron's scheduler loads a count by stepping it onto its own (`step(increment=...)`); a
    restarted rank that loaded --load (36 samples) and then received the peer's state (54) would
    be at 90, its learning rate decayed to the floor."""
    def make():
        module = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.0)
        return module, optimizer, _scheduler(optimizer)

    peer_module, peer_optimizer, peer_scheduler = make()
    peer_scheduler.step(increment=54)
    get, _ = training_state((peer_module.state_dict, peer_module.load_state_dict), peer_optimizer, peer_scheduler)
    module, optimizer, scheduler = make()
    scheduler.step(increment=36)  # what --load gave the restarted rank
    _, set_ = training_state((module.state_dict, module.load_state_dict), optimizer, scheduler)
    set_(get())
    assert scheduler.num_steps == 54
    assert optimizer.param_groups[0]["lr"] == peer_optimizer.param_groups[0]["lr"] > 1e-4
