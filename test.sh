#!/usr/bin/env bash
# The whole test suite: set up, then run pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
