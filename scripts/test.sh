#!/usr/bin/env bash
# Run the test suite (sets up .venv on first use). Extra arguments go to pytest.
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/env.sh"
cd "$ROOT"
# the tests that run Megatron-DeepSpeed / Megatron-LM find their extra packages here (scripts/extra_deps.py)
export MECEFO_MDS_DEPS="$VENV/mds-deps" MECEFO_MLM_DEPS="$VENV/mlm-deps"
if [ ! -f "$MECEFO_MDS_DEPS/.installed" ] || [ "$ROOT/setup.py" -nt "$MECEFO_MDS_DEPS/.installed" ]; then
  echo "[test] installing the mds extra into $MECEFO_MDS_DEPS" >&2
  python scripts/extra_deps.py mds "$MECEFO_MDS_DEPS" && touch "$MECEFO_MDS_DEPS/.installed"
fi
if [ ! -f "$MECEFO_MLM_DEPS/.installed" ] || [ "$ROOT/setup.py" -nt "$MECEFO_MLM_DEPS/.installed" ]; then
  echo "[test] installing the mlm extra and triton into $MECEFO_MLM_DEPS" >&2
  python scripts/extra_deps.py mlm "$MECEFO_MLM_DEPS" triton && touch "$MECEFO_MLM_DEPS/.installed"
fi
# test processes only: torch.compile does nothing (no compile work when Megatron-Core is imported);
# the shim runs the next sitecustomize on the path (a slow_start/ one, say) after its own
export PYTHONPATH="$ROOT/megatron_mecefo/testing/sitehooks${PYTHONPATH:+:$PYTHONPATH}"
exec python -m pytest "$@"
