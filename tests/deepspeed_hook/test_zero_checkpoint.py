"""DeepSpeed's ZeRO partition files read as MeCeFO's flat optimizer state (zero_checkpoint.py).

The files are written here the way DeepSpeed's stage 1/2 optimizer writes them (the integration
test in tests/integrations reads real ones): per data-parallel rank, per param group, the unpadded
fp32 partition and the base optimizer's state, padded at the last rank's end ("rigid") or
unpadded ("elastic_checkpoint")."""

from __future__ import annotations

import pytest
import torch

from megatron_mecefo.deepspeed_hook.zero_checkpoint import _load, zero_state


def _write(tag, groups, ranks, *, elastic=False, step=7.0):
    """Split each flat group of `groups` (name -> per-group tensors) over `ranks` as DeepSpeed does:
    equal partitions, the last one padded to the partition size."""
    _load.cache_clear()
    for r in range(ranks):
        masters, base = [], []
        for g, full in enumerate(groups["master"]):
            size = -(-full.numel() // ranks)
            part = {k: v[g][r * size:(r + 1) * size] for k, v in groups.items()}
            pad = size - part["master"].numel()
            masters.append(part["master"].clone())
            st = {k: (v.clone() if elastic else torch.cat([v, torch.zeros(pad)])) for k, v in part.items() if k != "master"}
            base.append({**st, "step": torch.tensor(step)})
        sd = {"zero_stage": 1, "single_partition_of_fp32_groups": masters, "partition_count": [ranks] * len(masters),
              "base_optimizer_state": base if elastic else {"state": dict(enumerate(base)), "param_groups": []}}
        torch.save({"optimizer_state_dict": sd}, tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")


@pytest.mark.parametrize("ranks,elastic", [(1, False), (3, False), (2, True)])
def test_partitions_concatenate_into_the_flat_state(tmp_path, ranks, elastic):
    gen = torch.Generator().manual_seed(0)
    sizes = [10, 7]
    groups = {k: [torch.randn(n, generator=gen) for n in sizes] for k in ("master", "exp_avg", "exp_avg_sq")}
    _write(tmp_path, groups, ranks, elastic=elastic)
    src = zero_state(str(tmp_path), sizes, ["exp_avg", "exp_avg_sq"])
    src.check(17, ["exp_avg", "exp_avg_sq", "master"])
    for k in groups:
        assert torch.equal(src.read(k, 0, 17), torch.cat(groups[k]))
        assert torch.equal(src.read(k, 4, 13), torch.cat(groups[k])[4:13])
    assert torch.equal(src.scalars({"step": torch.tensor(0.0)}, 3, 15)[0], torch.full((12,), 7.0))


def test_what_does_not_fit_is_refused(tmp_path):
    groups = {k: [torch.ones(10), torch.ones(7)] for k in ("master", "exp_avg")}
    _write(tmp_path, groups, 2)
    with pytest.raises(ValueError, match="param group 1 holds 7 elements, this model's has 8"):
        zero_state(str(tmp_path), [10, 8], ["exp_avg"])
    with pytest.raises(ValueError, match="2 param groups, this job's optimizer has 1"):
        zero_state(str(tmp_path), [17], ["exp_avg"])
    with pytest.raises(ValueError, match="needs \\['exp_avg_sq'\\] too"):
        zero_state(str(tmp_path), [10, 7], ["exp_avg"]).check(17, ["exp_avg", "exp_avg_sq"])
    (tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(ValueError, match="a rank's file is missing"):
        zero_state(str(tmp_path), [10, 7], ["exp_avg"])
    assert zero_state(str(tmp_path / "none"), [10, 7], ["exp_avg"]) is None
