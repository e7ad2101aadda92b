"""How a MeCeFO rank ends (errors.run_to_exit): the exit code the launcher reads, and nothing left
behind that holds the launcher's output open."""

import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.dist

# `main` starts a multiprocessing child (as upstream's checkpoint writers do) and then fails
RANK = textwrap.dedent("""
    import multiprocessing, sys, time
    from megatron_mecefo.errors import GaveUp, run_to_exit

    def main():
        child = multiprocessing.Process(target=time.sleep, args=(600,))
        child.start()
        print(child.pid, flush=True)
        raise {error}

    run_to_exit(main)
""")


@pytest.mark.parametrize("error, code, said", [
    ("ValueError('--bad-flag')", 2, "error: --bad-flag"),
    ("GaveUp('no cover')", 3, "MeCeFO: cannot continue: no cover (no checkpoint written here)"),
])
def test_a_rank_that_ends_ends_its_multiprocessing_children(error, code, said):
    """A usage error or a give-up ends the rank without interpreter teardown (its destructors can
    std::terminate beside a broken process group), so the children the teardown would have ended
    are ended first: an orphan kept the launcher's pipe open until its timeout."""
    proc = subprocess.run([sys.executable, "-c", RANK.format(error=error)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == code, proc.stderr
    assert said in proc.stderr
    child = int(proc.stdout.split()[0])
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)
