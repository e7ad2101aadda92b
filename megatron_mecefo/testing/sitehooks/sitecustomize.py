"""Tests only: the site hook of every test process (`scripts/test.sh` puts this folder first on
PYTHONPATH, and the tests keep it there for the processes they start; a user's process never loads
it). It does two things:

* `torch.compile` returns what it is given, so importing Megatron-Core does no compile work;
* a `mecefo-launch` process with MECEFO_LAUNCHER_SERVER set stands in for a launcher forked from the
  session's zygote server (testing/forked_launcher.py): it does not import torch for its store again.

Megatron-Core's fusions wrap about 45 functions in `torch.compile` at import, which imports Dynamo
and Inductor: about 2 of the 5 CPU-seconds of `import megatron.core` on a 2-core machine. The tests
run with the fusions off, so nothing they run is compiled anyway.

Python imports only the first `sitecustomize` on the path, so this one then runs the next one it
finds after its own folder (the machine's, `slow_start`'s, a checkout's shims), as if it were first.
Run again (a rank forked from a preloaded parent reloads its site hooks), it runs that one again too.
"""
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys


def _no_compile(torch) -> None:
    if getattr(torch.compile, "_mecefo_no_compile", False):
        return

    def compile(model=None, **_):
        return (lambda fn: fn) if model is None else model

    compile._mecefo_no_compile = True
    torch.compile = compile


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Patch torch right after it is imported, without importing it here (most test processes
    never import torch: the launchers, the store)."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            exec_module = spec.loader.exec_module

            def exec_then_patch(module):
                exec_module(module)
                _no_compile(module)

            spec.loader.exec_module = exec_then_patch
        return spec


if "torch" in sys.modules:
    _no_compile(sys.modules["torch"])
elif not any(isinstance(f, _AfterTorch) or type(f).__name__ == "_AfterTorch" for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterTorch())


def _run_next() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    entries = [os.path.abspath(p or os.getcwd()) for p in sys.path]
    after = entries[entries.index(here) + 1:] if here in entries else entries
    for entry in after:
        candidate = os.path.join(entry, "sitecustomize.py")
        if entry != here and os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_mecefo_next_sitecustomize", candidate)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            return


def _launcher_from_server() -> None:
    """After the next hook (a slow-start delay reaches the launcher's start as before)."""
    path = os.environ.get("MECEFO_LAUNCHER_SERVER", "")
    if path in ("", "0") or not hasattr(sys, "orig_argv"):
        return
    try:
        from megatron_mecefo.testing import forked_launcher
    except ImportError:
        return
    forked_launcher.run(path, sys.orig_argv)  # exits with the launcher's status where the server answers


_run_next()
_launcher_from_server()
