#!/usr/bin/env bash
# The main job for now: a covering rank vs a normal rank on a small LLaMA-style Megatron-Core GPT,
# on CPU (sets up .venv on first use). Prints the table; writes JSON + PNG under benchmarks/results/.
# Extra arguments go to benchmarks/covering_cost.py (e.g. drop --quick for the full-size run).
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/env.sh"
cd "$ROOT"
exec python benchmarks/covering_cost.py "${@:---quick}"
