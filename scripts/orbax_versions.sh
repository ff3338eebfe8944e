#!/usr/bin/env bash
# Every orbax-checkpoint release in a range against the rest of the floor environment: the Orbax
# contract and reader tests, and the conversions compared byte for byte with the pinned
# environment's (scripts/compat_check.py). Each release goes into an overlay of .venv-floor
# (a virtual environment whose own site-packages hold only that orbax-checkpoint).
#   scripts/orbax_versions.sh 0.12.0 0.12.1 ... 0.12.8
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh
ref=$(mktemp -d)
overlay=$(mktemp -d)
trap 'rm -rf "$ref" "$overlay"' EXIT
.venv/bin/python scripts/compat_check.py make "$ref/ref" >/dev/null 2>&1
python3 -m venv "$overlay/venv"
site="$overlay/venv/lib/python3.11/site-packages"
echo "$PWD/.venv-floor/lib/python3.11/site-packages" > "$site/floor.pth"
for v in "$@"; do
  rm -rf "$site"/orbax*
  "$overlay/venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --target "$site" \
    "orbax-checkpoint==$v" 2> >(grep -v "^WARNING" >&2)
  tests=$("$overlay/venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_orbax_contract.py \
    tests/test_orbax_reader.py 2>&1 | tail -1)
  compat=$("$overlay/venv/bin/python" scripts/compat_check.py check "$ref/ref" 2>/dev/null | python3 -c \
    "import json, sys; d = json.load(sys.stdin); print(d['versions']['orbax-checkpoint'], d['steps'])") || true
  echo "orbax-checkpoint $v: $tests; $compat"
done
