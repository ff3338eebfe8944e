#!/usr/bin/env bash
# The test suite: set up, then run pytest. Extra arguments go to pytest.
#   ./test.sh [ARGS]              the whole suite in .venv (the pinned versions)
#   ./test.sh --floor [ARGS]      the suite in .venv-floor (every dependency at the floor pyproject.toml
#                                 declares), vLLM from .venv-serve-floor: what the floors can break
#                                 (readers, writers, Tunix, training, serving starts); without the main
#                                 job and the per-family serving runs (the code paths the other tests
#                                 take, one vLLM start each), the tests that build environments of their
#                                 own, the comparisons with ggml's converters, the JSON goldens (our
#                                 output, not the dependencies'), the tests marked pinned_only
#                                 (ckptbridge's own memory, kill safety, errors, command line and
#                                 watch loop), with the format matrix on one family (every reader and
#                                 writer; the families once, at the pins), and the checks through
#                                 Tunix, transformers and PEFT on one row each (tests/families.py)
#   ./test.sh --env VENV [ARGS]   the same selection in another environment (e.g. .venv-newest, which
#                                 scripts/setup.sh --newest builds anew)
#   ./test.sh --lint              ruff (ckptbridge/, configured in pyproject.toml), mypy (ckptbridge/) and the
#                                 documentation site (mkdocs build --strict: a broken link or a page
#                                 missing from mkdocs.yml's nav fails)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
if [ "${1:-}" = "--lint" ]; then
  scripts/setup.sh
  .venv/bin/ruff check ckptbridge
  .venv/bin/mypy
  site="$(mktemp -d)"
  status=0
  .venv-docs/bin/mkdocs build --strict -d "$site" || status=$?
  rm -rf "$site"
  exit "$status"
fi
venv=.venv
select=()
if [ "${1:-}" = "--floor" ]; then
  shift
  venv=.venv-floor
  export CKPTBRIDGE_SERVE_PYTHON="$PWD/.venv-serve-floor/bin/python"
  export CKPTBRIDGE_FLOOR=1
elif [ "${1:-}" = "--env" ]; then
  venv="${2:?--env needs a virtual environment}"
  shift 2
fi
if [ "$venv" != .venv ]; then
  # test_gcs: the GCS emulator drops aiohttp 3.9.0's kept-alive connections now and then ("Server
  # disconnected", out of gcsfs's retries; one CI run in two); at the floors it is run by hand:
  # ./test.sh --floor tests/test_gcs.py
  # test_gguf_export: ggml's converters (run with the environment's torch and transformers) against our
  # files, at the pinned versions; at the floors test_gguf.py covers the GGUF reader, writer and Q8_0.
  select=(--ignore=tests/test_pipeline.py --ignore=tests/test_serving_families.py --ignore=tests/test_quantize_reference.py
          --ignore=tests/test_packaging.py --ignore=tests/test_environments.py --ignore=tests/test_gcs.py
          --ignore=tests/test_gguf_export.py --ignore=tests/test_json_golden.py -m "not pinned_only")
fi
scripts/setup.sh
if [ ! -x "$venv/bin/python" ]; then
  echo "test.sh: $venv does not exist (scripts/setup.sh --newest builds .venv-newest)" >&2
  exit 2
fi
exec "$venv/bin/python" -m pytest "${select[@]}" "$@"
