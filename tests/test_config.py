import argparse

import pytest

from megatron_mecefo.config import MeCeFOConfig

pytestmark = pytest.mark.unit


def test_defaults_are_the_documented_ones():
    c = MeCeFOConfig()
    assert (c.enable, c.rank, c.tau, c.svd_method, c.skip_attention, c.lowrank_ffn, c.recompute_ffn, c.approximate) == (
        False, 64, 200, "auto", True, True, "auto", "all",
    )


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("rank", 0, r'"rank" .* --mecefo-rank must be an integer >= 1, got 0'),
        ("rank", -3, r"--mecefo-rank must be an integer >= 1"),
        ("rank", 2.5, r"--mecefo-rank must be an integer"),
        ("rank", True, r"--mecefo-rank must be an integer"),
        ("tau", 0, r'"tau" .* --mecefo-tau must be an integer >= 1, got 0'),
        ("svd_exact_max_dim", 0, r"--mecefo-svd-exact-max-dim must be an integer >= 1"),
        ("svd_method", "qr", r"--mecefo-svd-method must be one of 'auto', 'exact', 'randomized', got 'qr'"),
        ("recompute_ffn", "sometimes", r"--mecefo-recompute-ffn must be one of 'auto', 'always', 'never'"),
        ("approximate", "own", r"--mecefo-approximate must be one of 'all', 'adopted'"),
        ("enable", "yes", r'"enable" .* --mecefo must be true or false'),
        ("skip_attention", 1, r"--mecefo-skip-attention must be true or false"),
        ("lowrank_ffn", None, r"--mecefo-lowrank-ffn must be true or false"),
    ],
)
def test_every_invalid_value_names_its_key(key, value, message):
    with pytest.raises(ValueError, match=message):
        MeCeFOConfig.from_ds_config({key: value})


def test_unknown_key_is_rejected_with_the_allowed_list():
    with pytest.raises(ValueError, match=r"unknown key\(s\) in ds_config \"mecefo\": rnak; allowed: enable, rank"):
        MeCeFOConfig.from_ds_config({"rnak": 8})


def test_block_must_be_an_object():
    with pytest.raises(ValueError, match="JSON object"):
        MeCeFOConfig.from_ds_config([1, 2])


def test_cli_overrides_ds_config_and_absent_flags_do_not():
    parser = MeCeFOConfig.add_cli_args(argparse.ArgumentParser())
    block = {"enable": True, "rank": 32, "tau": 50, "lowrank_ffn": False}
    args = parser.parse_args(["--mecefo-rank", "16", "--mecefo-recompute-ffn", "always"])
    c = MeCeFOConfig.from_args(args, block)
    assert (c.enable, c.rank, c.tau, c.lowrank_ffn, c.recompute_ffn) == (True, 16, 50, False, "always")
    c = MeCeFOConfig.from_args(parser.parse_args(["--mecefo", "--no-mecefo-skip-attention"]))
    assert c.enable and not c.skip_attention
    with pytest.raises(ValueError, match="--mecefo-rank"):
        MeCeFOConfig.from_args(parser.parse_args(["--mecefo-rank", "0"]))


def test_cover_policy_recompute_auto_follows_live_microbatches():
    c = MeCeFOConfig(enable=True, rank=8, tau=10)
    p = c.cover_policy(5)
    assert (p.step, p.rank, p.tau, p.skip_attention, p.lowrank_ffn, p.recompute_ffn) == (5, 8, 10, True, True, False)
    assert c.cover_policy(5, live_microbatches=2).recompute_ffn
    assert MeCeFOConfig(recompute_ffn="always").cover_policy(0).recompute_ffn
    assert not MeCeFOConfig(recompute_ffn="never").cover_policy(0, live_microbatches=4).recompute_ffn
