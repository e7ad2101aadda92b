"""Import boundaries of the package layout (shared/DESIGN.md), checked in fresh interpreters."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# module -> top-level packages that must NOT be imported by importing it
FORBIDDEN = {
    "megatron_mecefo": ("megatron", "deepspeed"),
    "megatron_mecefo.approx": ("megatron", "deepspeed", "megatron_mecefo.layers", "megatron_mecefo.config"),
    "megatron_mecefo.config": ("megatron", "deepspeed"),
    "megatron_mecefo.params": ("megatron", "deepspeed"),
    "megatron_mecefo.layers": ("deepspeed",),
    "megatron_mecefo.elastic": ("megatron", "deepspeed", "megatron_mecefo.layers"),
    "megatron_mecefo.elastic.runtime": ("megatron", "deepspeed", "megatron_mecefo.layers"),
    "megatron_mecefo.elastic.launch": ("megatron", "deepspeed", "megatron_mecefo.layers"),
    # imported by a patched Megatron-DeepSpeed script, whose `megatron` is its own: never megatron-core's
    # layers; upstream and DeepSpeed are imported when install() runs
    "megatron_mecefo.integrations.megatron_deepspeed": ("megatron", "deepspeed", "megatron_mecefo.layers"),
    "megatron_mecefo.integrations.megatron_deepspeed.layers": ("megatron", "deepspeed", "megatron_mecefo.layers"),
    "megatron_mecefo.integrations.megatron_deepspeed.training": ("megatron", "deepspeed", "megatron_mecefo.layers"),
    # imported by a patched Megatron-LM script before upstream's own imports settle: nothing heavy
    "megatron_mecefo.integrations.megatron_lm": ("megatron", "deepspeed", "megatron_mecefo.layers"),
    "megatron_mecefo.integrations.megatron_lm.training": ("megatron", "deepspeed", "megatron_mecefo.layers"),
    "megatron_mecefo.integrations.megatron_lm.step": ("deepspeed",),
    "megatron_mecefo.elastic.bootstrap": ("megatron", "deepspeed", "megatron_mecefo.layers"),
    "megatron_mecefo.patch": ("torch", "megatron", "deepspeed"),
}


@pytest.mark.parametrize("module", sorted(FORBIDDEN))
def test_import_boundaries(module):
    code = (
        f"import sys, {module}\n"
        f"bad = [m for m in {FORBIDDEN[module]!r} if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing {module} pulled in {out.stdout.strip()}"


def test_approx_imports_nothing_of_ours_outside_approx():
    for path in (ROOT / "megatron_mecefo" / "approx").glob("*.py"):
        for line in path.read_text().splitlines():
            if line.startswith(("import ", "from ")) and "megatron_mecefo" in line:
                assert "megatron_mecefo.approx" in line, f"{path.name}: {line}"


def test_only_deepspeed_hook_imports_deepspeed():
    for path in (ROOT / "megatron_mecefo").rglob("*.py"):
        if "deepspeed_hook" in path.parts:
            continue
        for line in path.read_text().splitlines():
            stripped = line.strip()
            assert not stripped.startswith(("import deepspeed", "from deepspeed")), f"{path}: {line}"
