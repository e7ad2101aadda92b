"""Plot a MeCeFO run (examples/tiny_gpt or examples/pretrain_gpt with a log dir): loss per step with degraded steps shaded, and the
cover map over time (which replica ran whose micro-batches).

    python examples/plot_run.py runs/demo        # writes runs/demo/run.png
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap


def load(run: Path):
    steps = {}
    world = 0
    for path in sorted(run.glob("steps_rank*.jsonl")):
        world = max(world, int(path.stem.replace("steps_rank", "")) + 1)
        for rec in map(json.loads, path.read_text().splitlines()):
            steps.setdefault(rec["step"], []).append(rec)
    return steps, world


def main(run: Path) -> Path:
    steps, world = load(run)
    xs = sorted(steps)
    loss = [steps[s][0]["loss"] for s in xs]
    degraded = [any(r["degraded"] for r in steps[s]) for s in xs]
    # cover map: 0 healthy, 1 failed (its micro-batches run elsewhere), 2 covering a failed replica
    grid = np.zeros((world, len(xs)))
    for j, s in enumerate(xs):
        live = set(steps[s][0]["live"])
        for d in range(world):
            if d not in live:
                grid[d, j] = 1
        for c in steps[s][0]["cover"].values():
            grid[c, j] = 2
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]})
    ax.plot(xs, loss, lw=1.2, color="tab:blue", label="training loss (global batch)")
    for j, s in enumerate(xs):
        if degraded[j]:
            ax.axvspan(s - 0.5, s + 0.5, color="tab:orange", alpha=0.25, lw=0)
    ax.plot([], [], color="tab:orange", alpha=0.4, lw=8, label="degraded: a neighbour covers a failed rank")
    ax.set_ylabel("loss")
    ax.legend(loc="upper right")
    ax.set_title(f"MeCeFO: {world} data-parallel ranks, every step consumes the full global batch")
    ax2.imshow(grid, aspect="auto", interpolation="nearest", cmap=ListedColormap(["#d9ead3", "#cc0000", "#f6b26b"]),
               extent=(xs[0] - 0.5, xs[-1] + 0.5, world - 0.5, -0.5), vmin=0, vmax=2)
    ax2.set_yticks(range(world), [f"rank {d}" for d in range(world)])
    ax2.set_xlabel("step")
    ax2.set_title("cover map: green healthy, red failed, orange covering", fontsize=9)
    fig.tight_layout()
    out = run / "run.png"
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    print(main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/demo")))
