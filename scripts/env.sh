#!/usr/bin/env bash
# Create (once) the project's virtual environment in .venv with the pinned CPU stack, and install
# the package in editable mode. Sourced by the other scripts; safe to run again (it is a no-op then).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MECEFO_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
STAMP="$VENV/.mecefo-installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/setup.py" -nt "$STAMP" ] || [ "$ROOT/constraints.txt" -nt "$STAMP" ]; then
  echo "[env] setting up $VENV (first run: ~1 min)" >&2
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  # torch first, pinned: its CPU wheel; an unpinned torch would pull a multi-GB CUDA build
  "$VENV/bin/python" -m pip install -q -c "$ROOT/constraints.txt" "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q -c "$ROOT/constraints.txt" -e "$ROOT[test,bench]"
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
