#!/usr/bin/env bash
# Create or update the project's environment(s). Idempotent: a second run with nothing changed
# returns in well under a second.
#   .venv        core + training (jax, tunix, qwix, orbax, transformers <= 5.12.1, torch CPU)
# Usage: scripts/setup.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

python_bin="${PYTHON:-}"
if [ -z "$python_bin" ]; then
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      python_bin="$candidate"; break
    fi
  done
fi
if [ -z "$python_bin" ]; then
  echo "setup: Python 3.11 is required (set PYTHON=/path/to/python3.11)" >&2
  exit 1
fi

stamp_of() { cat "$@" | sha256sum | cut -c1-16; }

venv=.venv
want="$(stamp_of requirements/core.txt requirements/core.lock pyproject.toml)"
if [ -f "$venv/.setup-stamp" ] && [ "$(cat "$venv/.setup-stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi
echo "setup: building $venv (first run takes a few minutes)" >&2
[ -x "$venv/bin/python" ] || "$python_bin" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
# torch first, pinned to the local CPU build, so that no later requirement pulls a CUDA build.
"${pip[@]}" install "torch==2.13.0"
"${pip[@]}" install -r requirements/core.txt -c requirements/core.lock
"${pip[@]}" install --no-deps -e .
echo "$want" > "$venv/.setup-stamp"
echo "setup: $venv ready" >&2
