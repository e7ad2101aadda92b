#!/usr/bin/env bash
# Run the test suite (sets up .venv on first use). Extra arguments go to pytest.
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/env.sh"
cd "$ROOT"
# the tests that run Megatron-DeepSpeed find its extra packages here (see scripts/mds_deps.py)
export MECEFO_MDS_DEPS="$VENV/mds-deps"
if [ ! -f "$MECEFO_MDS_DEPS/.installed" ] || [ "$ROOT/setup.py" -nt "$MECEFO_MDS_DEPS/.installed" ]; then
  echo "[test] installing the mds extra into $MECEFO_MDS_DEPS" >&2
  python scripts/mds_deps.py "$MECEFO_MDS_DEPS" && touch "$MECEFO_MDS_DEPS/.installed"
fi
exec python -m pytest "$@"
