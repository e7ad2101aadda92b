"""The upstream patches of each host: one table (patches.py), applied for one `pretrain()` call and
undone when it returns, and shown in docs/design.md as the table generates it."""

import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from megatron_mecefo.integrations.patches import Patch, patched
from megatron_mecefo.testing import mds, mlm

ROOT = Path(__file__).resolve().parents[2]


def test_a_table_is_applied_for_the_block_and_undone_after_it_even_on_an_error(monkeypatch):
    upstream = types.ModuleType("fake_upstream")
    upstream.step = original_step = lambda: "upstream"
    upstream.log = original_log = lambda: "upstream log"
    monkeypatch.setitem(sys.modules, "fake_upstream", upstream)
    table = [Patch("fake_upstream", "step", "why", lambda f: lambda: "mecefo " + f()),
             Patch("fake_upstream", "log", "why", lambda f: lambda: "mecefo log"),
             Patch("fake_upstream", "log", "documented only", scope="call")]
    with patched(table):
        assert (upstream.step(), upstream.log()) == ("mecefo upstream", "mecefo log")
    assert upstream.step is original_step and upstream.log is original_log
    with pytest.raises(RuntimeError), patched(table):
        raise RuntimeError("a run that fails")
    assert upstream.step is original_step and upstream.log is original_log


def test_the_own_loop_turns_deepspeeds_shm_op_off_only_around_its_initialize():
    """`deepspeed_hook.initialize` runs DeepSpeed's initialize with the shm op off; another engine
    built in the same process afterwards finds DeepSpeed's table as it was."""
    import deepspeed

    from megatron_mecefo.deepspeed_hook.initialize import cpu_shm_build_skipped

    ops = deepspeed.ops.__compatible_ops__
    before = dict(ops)
    with pytest.raises(RuntimeError), cpu_shm_build_skipped():
        assert ops["deepspeed_shm_comm"] is False
        raise RuntimeError("an initialize that fails")
    assert dict(ops) == before
    ops["deepspeed_shm_comm"] = "sentinel"
    try:
        with cpu_shm_build_skipped():
            assert ops["deepspeed_shm_comm"] is False
        assert ops["deepspeed_shm_comm"] == "sentinel"
    finally:
        ops.clear()
        ops.update(before)


# In a process with the host's upstream importable: every "run" row names a global that exists, is
# replaced inside `patched` and is upstream's own again after it; prints the table as markdown.
_CHECK = """
import importlib, sys
from megatron_mecefo.integrations.patches import markdown, patched
from megatron_mecefo.integrations.run import Run
table = importlib.import_module(sys.argv[1]).table(Run())
rows = [p for p in table if p.scope == "run"]
before = [getattr(importlib.import_module(p.module), p.name) for p in rows]
with patched(table):
    during = [getattr(importlib.import_module(p.module), p.name) for p in rows]
after = [getattr(importlib.import_module(p.module), p.name) for p in rows]
assert all(d is not b for d, b in zip(during, before)), [p.name for p, d, b in zip(rows, during, before) if d is b]
assert all(a is b for a, b in zip(after, before)), [p.name for p, a, b in zip(rows, after, before) if a is not b]
print("TABLE-START")
print(markdown(table))
"""


@pytest.mark.parametrize("host", ["megatron_lm", "megatron_deepspeed"])
def test_each_host_patches_for_the_run_only_and_the_design_shows_its_table(host, request):
    if host == "megatron_lm":
        root, env = request.getfixturevalue("mlm_checkout"), mlm.env()
    else:
        root, env = request.getfixturevalue("mds_checkout")[0], mds.env()
    proc = subprocess.run([sys.executable, "-c", _CHECK, f"megatron_mecefo.integrations.{host}.patches"], cwd=root,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout.split("TABLE-START\n", 1)[1].strip()
    design = (ROOT / "docs" / "design.md").read_text()
    shown = re.search(rf"<!-- patches: {host} -->\n(.*?)\n<!-- /patches -->", design, re.S)
    assert shown is not None and shown.group(1).strip() == table, \
        f"docs/design.md's table of {host}'s patches is not the table in its patches.py; it is:\n{table}"
