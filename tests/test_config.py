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
        ("basis", "output", r'"basis" .* --mecefo-basis must be one of \'weight\', \'activation\', \'gradient\', got \'output\''),
        ("attention_floor", 1.5, r'"attention_floor" .* --mecefo-attention-floor must be a number in \[0, 1\], got 1.5'),
        ("covering_budget", 0.9, r'"covering_budget" .* --mecefo-covering-budget must be a number >= 1'),
        ("cover", "ring", r'"cover" .* --mecefo-cover must be one of .neighbour., .spread.'),
        ("rebalance", "on", r'"rebalance" .* --mecefo-rebalance must be true or false'),
        ("rebalance_threshold", 1.0, r'"rebalance_threshold" .* --mecefo-rebalance-threshold must be a number > 1'),
        ("rebalance_threshold", 0.8, r"--mecefo-rebalance-threshold must be a number > 1"),
        ("rebalance_window", 1, r'"rebalance_window" .* --mecefo-rebalance-window must be an integer >= 2, got 1'),
        ("retire_slower_than", 1.1, r'"retire_slower_than" .* --mecefo-retire-slower-than must be a number above '
                                    r'rebalance_threshold \(1.2\), got 1.1'),
        ("enable", "yes", r'"enable" .* --mecefo must be true or false'),
        ("skip_attention", 1, r"--mecefo-skip-attention must be true or false"),
        ("lowrank_ffn", None, r"--mecefo-lowrank-ffn must be true or false"),
    ],
)
def test_every_invalid_value_names_its_key(key, value, message):
    with pytest.raises(ValueError, match=message):
        MeCeFOConfig.from_ds_config({key: value})


def test_retire_slower_than_needs_rebalance():
    with pytest.raises(ValueError, match=r"--mecefo-retire-slower-than needs rebalance on"):
        MeCeFOConfig.from_ds_config({"retire_slower_than": 3})
    assert MeCeFOConfig.from_ds_config({"rebalance": True, "retire_slower_than": 3}).retire_slower_than == 3.0


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


def test_basis_flag_reaches_the_cover_policy():
    parser = MeCeFOConfig.add_cli_args(argparse.ArgumentParser())
    assert MeCeFOConfig().cover_policy(3).basis == "weight"  # the paper's rule
    c = MeCeFOConfig.from_args(parser.parse_args(["--mecefo", "--mecefo-basis", "activation"]), {"basis": "weight"})
    assert c.cover_policy(3).basis == "activation"
    assert MeCeFOConfig.from_ds_config({"basis": "activation"}).cover_policy(0).basis == "activation"
    assert MeCeFOConfig.from_ds_config({"basis": "gradient"}).cover_policy(0).basis == "gradient"
    with pytest.raises(SystemExit):  # argparse's choices
        parser.parse_args(["--mecefo-basis", "output"])


def test_cover_policy_recompute_auto_follows_live_microbatches():
    c = MeCeFOConfig(enable=True, rank=8, tau=10)
    p = c.cover_policy(5)
    assert (p.step, p.rank, p.tau, p.skip_attention, p.lowrank_ffn, p.recompute_ffn) == (5, 8, 10, True, True, False)
    assert c.cover_policy(5, live_microbatches=2).recompute_ffn
    assert MeCeFOConfig(recompute_ffn="always").cover_policy(0).recompute_ffn
    assert not MeCeFOConfig(recompute_ffn="never").cover_policy(0, live_microbatches=4).recompute_ffn


def test_trace_events_replay():
    assert MeCeFOConfig(trace={"events": [[1, 5, 9], [2, 6, 10]]}).trace == {"events": [[1, 5, 9], [2, 6, 10]]}


def test_trace_scenarios_scale_the_paper_rates():
    c = MeCeFOConfig(trace={"scenario": "high", "steps_per_hour": 20, "seed": 4})
    assert c.trace == {"mtbf_steps": 10.0, "recovery_steps": 40, "seed": 4}
    assert MeCeFOConfig(trace={"mtbf_steps": 5, "recovery_steps": 3}).trace["seed"] == 0


@pytest.mark.parametrize(
    "trace, message",
    [
        ({"scenario": "extreme", "steps_per_hour": 10}, "scenario must be one of"),
        ({"scenario": "low"}, "steps_per_hour must be a number > 0"),
        ({"mtbf_steps": 0, "recovery_steps": 3}, "mtbf_steps must be > 0"),
        ({"mtbf_steps": 5, "recovery_steps": 0}, "recovery_steps must be an integer >= 1"),
        ({"mtbf_steps": 5}, 'needs "mtbf_steps" and "recovery_steps"'),
        ("high", "must be an object"),
        ({"events": [[1, 5, 3]]}, "rejoin > fail"),
        ({"events": [[1, 5, 9]], "seed": 2}, "alone"),
    ],
)
def test_trace_errors_name_the_key(trace, message):
    with pytest.raises(ValueError, match=message):
        MeCeFOConfig.from_ds_config({"trace": trace})


@pytest.mark.parametrize(
    "rule, message",
    [
        ("kill:1", r"is not kill\|hang\|error:RANK:STEP"),
        ("hold:1:*", "a hold names a step"),
        ("hold:1:2:x", "must be integers"),
        ("hold:1:2:1:4", r"or hold:RANK:STEP\[:INCARNATION\]"),
        ("explode:1:2", "kind must be one of"),
        ("kill:1:2:sideways", "phase must be one of"),
        ("kill:x:2", "must be integers"),
        ({"kind": "kill", "rank": 1, "step": 2, "when": 3}, "unknown field"),
        ("slow:1:2", r"is not slow:RANK:FACTOR:FROM\[:TO\]"),
        ("slow:1:1.0:3", "factor of a slow-down must be a number > 1"),
        ("slow:1:x:3", "FACTOR a number"),
        ("slow:1:2:5:5", "ends after it starts"),
        ({"kind": "slow", "rank": 1, "factor": 2, "from": 3, "step": 4}, "unknown field"),
    ],
)
def test_inject_errors_name_the_key(rule, message):
    with pytest.raises(ValueError, match=message):
        MeCeFOConfig.from_ds_config({"inject": [rule]})


def test_a_hold_waits_for_the_next_incarnation_by_default():
    rules = MeCeFOConfig.from_ds_config({"inject": ["hold:2:7", "hold:1:3:0", "kill:2:*:transfer:1"]}).inject
    assert [(r["kind"], r["rank"], r["step"], r["incarnation"]) for r in rules] == \
        [("hold", 2, 7, 1), ("hold", 1, 3, 0), ("kill", 2, "*", 1)]


def test_runtime_timeouts_are_checked_together():
    with pytest.raises(ValueError, match="heartbeat_timeout_s.*at least twice"):
        MeCeFOConfig(heartbeat_interval_s=1.0, heartbeat_timeout_s=1.5)
    with pytest.raises(ValueError, match="agree_timeout_s.*must exceed collective_timeout_s"):
        MeCeFOConfig(collective_timeout_s=60, agree_timeout_s=30)
    with pytest.raises(ValueError, match="agree_timeout_s.*must exceed twice heartbeat_timeout_s.*lower heartbeat"):
        MeCeFOConfig(collective_timeout_s=4, heartbeat_timeout_s=5, agree_timeout_s=8)
    with pytest.raises(ValueError, match="--mecefo-collective-timeout-s must be a number > 0"):
        MeCeFOConfig(collective_timeout_s=0)


def test_one_source_for_the_readme_table_the_help_and_the_defaults():
    """The README's reference is the one generated from the fields' docstrings, and every flag's
    --help carries its field's first sentence and default."""
    import argparse
    import dataclasses
    import re
    import subprocess
    import sys
    from pathlib import Path

    from megatron_mecefo.config import _default_text, _first_sentence, field_docs, reference_table

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    block = re.search(r"<!-- config-reference:[^\n]*-->\n(.*?)\n<!-- /config-reference -->", readme, re.S)
    assert block and block.group(1) == reference_table(), "run: python scripts/config_reference.py --write"
    docs = field_docs()
    assert set(docs) == {f.name for f in dataclasses.fields(MeCeFOConfig)}, "every field has a docstring"
    parser = MeCeFOConfig.add_cli_args(argparse.ArgumentParser())
    helps = {a.dest: a.help for a in parser._actions if a.dest.startswith("mecefo")}
    for f in dataclasses.fields(MeCeFOConfig):
        dest = "mecefo" if f.name == "enable" else f"mecefo_{f.name}"
        assert f"(default: {_default_text(f.default)})" in helps[dest], dest
        assert helps[dest].startswith(_first_sentence(docs[f.name])) and len(helps[dest]) > 20, dest
    out = subprocess.run([sys.executable, str(root / "scripts/config_reference.py")], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == reference_table()
