"""Install one of our extras (what an upstream checkout's pretrain_gpt.py imports beyond our own
dependencies), plus optional packages, into a folder of its own, for the tests that run that
checkout: only their processes put it on PYTHONPATH. With transformers importable, every
`import deepspeed` takes about 1.4 s longer (DeepSpeed's hybrid engine imports it), which every
other process of the suite would pay.

    python scripts/extra_deps.py mds TARGET            # Megatron-DeepSpeed's
    python scripts/extra_deps.py mlm TARGET triton     # Megatron-LM's, and triton (it comes with CUDA torch)

pip resolves against this environment (and constraints.txt); TARGET gets what is missing.
"""

import ast
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def extra(name):
    tree = ast.parse(open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            return ast.literal_eval(node.value)[name]
    raise SystemExit("setup.py has no extras_require")


def main(name, target, *more):
    pip = [sys.executable, "-m", "pip", "install", "-q", "-c", os.path.join(ROOT, "constraints.txt")]
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        subprocess.run(pip + ["--dry-run", "--report", report] + extra(name) + list(more), check=True,
                       stdout=subprocess.DEVNULL)
        missing = [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in json.load(open(report))["install"]]
    if missing:
        subprocess.run(pip + ["--no-deps", "--target", target] + missing, check=True)
    os.makedirs(target, exist_ok=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
