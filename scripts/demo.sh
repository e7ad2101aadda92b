#!/usr/bin/env bash
# The main job: MeCeFO on CPU. 4 data-parallel ranks pretrain a small LLaMA-style Megatron-Core GPT
# (examples/pretrain_gpt, on the Python standard library's sources) in DeepSpeed engines; rank 1 is
# killed (SIGKILL) at step 60, its neighbour covers its micro-batches, and it is restarted 6 s later
# and rejoins (the job waits for it at step 120 if it is not back by then: "hold", so the demo shows
# the rejoin on any machine). Sets up .venv on first use. Writes runs/demo/ (per-step JSONL, recovery events,
# run.png). Extra arguments go to examples/pretrain_gpt/pretrain_gpt.py. The ranks, the restarted one
# included, are forked from a parent that imported torch, DeepSpeed and Megatron-Core once
# (mecefo-launch's preload); MECEFO_PRELOAD=0 bash scripts/demo.sh spawns each instead.
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/env.sh"
cd "$ROOT"
OUT=runs/demo
rm -rf "$OUT"
export PYTHONWARNINGS=ignore
export MECEFO_PRELOAD="${MECEFO_PRELOAD:-1}"
mecefo-launch --nproc-per-node 4 --master-port 0 --restart-failed-after 6 examples/pretrain_gpt/pretrain_gpt.py \
  --deepspeed_config examples/pretrain_gpt/ds_config.json --mecefo --mecefo-log-dir "$OUT" \
  --num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --normalization RMSNorm --swiglu \
  --position-embedding-type rope --micro-batch-size 2 --global-batch-size 16 --train-iters 300 \
  --lr 2e-3 --min-lr 2e-4 --lr-warmup-iters 20 --eval-interval 100 --eval-iters 8 --log-interval 10 \
  --mecefo-rank 32 --mecefo-inject kill:1:60:backward --mecefo-inject hold:1:120 "$@" 2>&1 \
  | grep -v -E "^\[20[0-9-]+ [0-9:,]+\] \[(INFO|WARNING)\]|^\s*$|legacy tokenizer"
python examples/plot_run.py "$OUT"
python - "$OUT" <<'PY'
import json, sys, pathlib
run = pathlib.Path(sys.argv[1])
recs = {}
for p in run.glob("steps_rank*.jsonl"):
    for r in map(json.loads, p.read_text().splitlines()):
        recs.setdefault(r["step"], []).append(r)
bad = [s for s, rs in recs.items() if sorted((m[0], m[1]) for r in rs for m in r["micro_batches"]) != sorted((d, j) for d in range(4) for j in range(2))]
deg = sum(any(r["degraded"] for r in rs) for rs in recs.values())
print(f"{len(recs)} steps, {deg} degraded, every step consumed the whole global batch: {not bad}")
events = [json.loads(l) for l in (run / "events_rank1.jsonl").read_text().splitlines()]
kill = next(e["time"] for e in events if e["event"] == "inject" and e["kind"] == "kill")
back = next(e["time"] for e in events if e["event"] == "started" and e["incarnation"] == 1)
print(f"rank 1: {back - kill:.1f} s from the kill to its restarted incarnation's start (6 s of it the launcher's "
      f"--restart-failed-after; ranks {'forked from the preloaded parent' if __import__('os').environ.get('MECEFO_PRELOAD') not in ('', '0') else 'spawned'})")
PY
echo "plot: $OUT/run.png"
