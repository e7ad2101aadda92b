"""Import boundaries of the package layout (docs/design.md), checked in fresh interpreters."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# module -> top-level packages that must NOT be imported by importing it
FORBIDDEN = {
    "megatron_mecefo": ("megatron", "deepspeed"),
    "megatron_mecefo.approx": ("megatron", "deepspeed", "megatron_mecefo.layers", "megatron_mecefo.config"),
    # below the runtime: config.py validates its block without importing what uses it
    "megatron_mecefo.config": ("megatron", "deepspeed", "megatron_mecefo.elastic", "megatron_mecefo.integrations",
                               "megatron_mecefo.deepspeed_hook", "megatron_mecefo.layers"),
    "megatron_mecefo.params": ("megatron", "deepspeed"),
    "megatron_mecefo.layers": ("deepspeed",),
    "megatron_mecefo.elastic": ("megatron", "deepspeed", "megatron_mecefo.layers"),
    "megatron_mecefo.elastic.runtime": ("megatron", "deepspeed", "megatron_mecefo.layers"),
    "megatron_mecefo.elastic.launch.cli": ("megatron", "deepspeed", "megatron_mecefo.layers"),
    # imported by a patched Megatron-DeepSpeed script, whose `megatron` is its own: never megatron-core's
    # layers; upstream and DeepSpeed are imported when install() runs
    "megatron_mecefo.integrations.megatron_deepspeed": ("megatron", "deepspeed", "megatron_mecefo.layers"),
    "megatron_mecefo.integrations.megatron_deepspeed.layers": ("megatron", "deepspeed", "megatron_mecefo.layers"),
    "megatron_mecefo.integrations.megatron_deepspeed.training": ("megatron", "deepspeed", "megatron_mecefo.layers"),
    # imported by a patched Megatron-LM script before upstream's own imports settle: nothing heavy
    "megatron_mecefo.integrations.megatron_lm": ("megatron", "deepspeed", "megatron_mecefo.layers"),
    "megatron_mecefo.integrations.megatron_lm.training": ("megatron", "deepspeed", "megatron_mecefo.layers"),
    "megatron_mecefo.integrations.megatron_lm.host": ("deepspeed",),
    "megatron_mecefo.elastic.launch.bootstrap": ("megatron", "deepspeed", "megatron_mecefo.layers"),
    "megatron_mecefo.patch": ("torch", "megatron", "deepspeed"),
}


# One fresh interpreter imports torch (every module here may use it) and forks a child per module:
# the child imports the module on an otherwise clean sys.modules and reports what came with it.
# Saves a torch import per module; `megatron_mecefo.patch` (which must not import torch) gets an
# interpreter of its own.
_CHECK = """
import json, os, sys
forbidden = json.loads(sys.argv[1])
if sys.argv[2] == "torch":
    import torch  # noqa: F401
for module, names in forbidden.items():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            __import__(module)
            report = {"bad": [m for m in names if m in sys.modules]}
        except BaseException as e:
            report = {"error": f"{type(e).__name__}: {e}"}
        os.write(w, json.dumps(report).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        print(json.dumps({module: json.loads(f.read())}))
    os.waitpid(pid, 0)
"""


@pytest.fixture(scope="module")
def imported():
    """module -> {"bad": forbidden packages its import pulled in} or {"error": ...}."""
    import json

    out = {}
    for preload in ("torch", "none"):
        group = {m: names for m, names in FORBIDDEN.items() if ("torch" in names) == (preload == "none")}
        proc = subprocess.run([sys.executable, "-c", _CHECK, json.dumps(group), preload], cwd=ROOT, capture_output=True,
                              text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr
        for line in proc.stdout.splitlines():
            out.update(json.loads(line))
    return out


@pytest.mark.parametrize("module", sorted(FORBIDDEN))
def test_import_boundaries(module, imported):
    report = imported[module]
    assert "error" not in report, f"importing {module} failed: {report.get('error')}"
    assert report["bad"] == [], f"importing {module} pulled in {','.join(report['bad'])}"


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


# The package's own top-level modules sit below its subpackages (approx/, the math, is the one they
# may use): nothing they import, at module level or inside a function, runs back up into a layer
# that builds on them.
_BASE = ("megatron_mecefo.config", "megatron_mecefo.errors", "megatron_mecefo.fault_rules", "megatron_mecefo.log",
         "megatron_mecefo.params", "megatron_mecefo.rng", "megatron_mecefo.locks")
_ABOVE = ("megatron_mecefo.elastic", "megatron_mecefo.integrations", "megatron_mecefo.deepspeed_hook",
          "megatron_mecefo.layers", "megatron_mecefo.sim", "megatron_mecefo.data", "megatron_mecefo.testing")


def test_base_modules_import_nothing_above_them():
    files = {}
    for path in (ROOT / "megatron_mecefo").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for module in _BASE:
        up = sorted(t for t in _imports(module, files[module], set(files)) if t.startswith(_ABOVE))
        assert not up, f"{module} imports {up}: move what it needs below it"


# elastic/ in layers (docs/design.md, "Where things are"): a sub-package imports only the ones below
# it, and none imports the step and its runtime at the top of elastic/.
_ELASTIC_BELOW = {
    "plan": set(), "comm": set(), "membership": set(),
    "faults": {"plan"}, "sharding": {"plan", "comm"}, "launch": {"plan", "comm", "membership"},
}


def test_elastic_sub_packages_import_only_below_them():
    files = {}
    for path in (ROOT / "megatron_mecefo").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    subs = {m.split(".")[2] for m, p in files.items() if m.count(".") == 2 and p.name == "__init__.py"
            and m.startswith("megatron_mecefo.elastic.")}
    assert subs == set(_ELASTIC_BELOW), f"sub-packages of elastic/ without a layer here: {subs ^ set(_ELASTIC_BELOW)}"

    def where(module):  # the sub-package of elastic/ a module is in, "top" for elastic/*.py
        parts = module.split(".")
        return parts[2] if len(parts) > 3 or (len(parts) == 3 and parts[2] in subs) else "top"

    bad = []
    for m, path in files.items():
        if not m.startswith("megatron_mecefo.elastic.") or where(m) == "top":
            continue
        for t in _imports(m, path, set(files)):
            if t.startswith("megatron_mecefo.elastic.") and where(t) != where(m) and where(t) not in _ELASTIC_BELOW[where(m)]:
                bad.append(f"{m} imports {t}")
    assert not bad, "imports that climb up elastic/'s layers:\n" + "\n".join(sorted(bad))


# The cross-replica gradient collectives and the reduction's arithmetic: called from the step's
# reduction part only (elastic/reduction.py over gradients.py and shard_grads.py, which use groups.py).
_REDUCTION_CALLS = ("allreduce_sum_", "allreduce_sum_async_", "reduce_with_divisors", "reduce_scatter_with_divisors")
_REDUCTION_PART = {"elastic/reduction.py", "elastic/comm/gradients.py", "elastic/comm/shard_grads.py", "elastic/comm/groups.py"}


def test_no_gradient_reduction_outside_the_reduction_part():
    import ast

    for path in (ROOT / "megatron_mecefo").rglob("*.py"):
        if path.relative_to(ROOT / "megatron_mecefo").as_posix() in _REDUCTION_PART:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", getattr(node.func, "id", None))
                assert name not in _REDUCTION_CALLS, f"{path.relative_to(ROOT)}:{node.lineno} calls {name}: " \
                                                     "reduce through the step driver's Reduction"


def test_the_runtime_takes_typed_parts():
    """ElasticRuntime's constructor: at most 10 parameters, every one named (no **kwargs)."""
    import inspect

    from megatron_mecefo.elastic.runtime import ElasticRuntime

    params = list(inspect.signature(ElasticRuntime.__init__).parameters.values())[1:]
    assert len(params) <= 10, [p.name for p in params]
    assert not [p.name for p in params if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
