#!/usr/bin/env bash
# Run the test suite (sets up .venv on first use). Extra arguments go to pytest.
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/env.sh"
cd "$ROOT"
exec python -m pytest "$@"
