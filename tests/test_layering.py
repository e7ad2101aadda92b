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


def _imports(module: str, path: Path, known: set) -> set:
    """The package's modules that importing `module` may import, at module level or inside a
    function (a function-level import runs the same code, later), with the packages around them."""
    import ast

    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("megatron_mecefo")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.startswith("megatron_mecefo"):
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    out = set()
    for target in found:  # `import a.b.c` runs a/__init__, a/b/__init__ and a/b/c
        parts = target.split(".")
        out |= {".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in known}
    # a module's own enclosing packages are being imported already: not a dependency of it
    return {t for t in out if t != module and not module.startswith(t + ".")}


def test_no_import_runs_back_up_the_layering():
    """The package's import graph, function-level imports included, has no cycle: a module never
    imports (now or inside a function) something that imports it back. Catches what a subprocess
    import check cannot: config.py parsing traces through an import inside a function of a module
    whose package imports the runtime, which imports config."""
    files = {}
    for path in (ROOT / "megatron_mecefo").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {m: _imports(m, p, set(files)) for m, p in files.items()}
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycles.append(" -> ".join(stack[stack.index(n):] + [n]))
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "imports that run back up the layering:\n" + "\n".join(cycles)
