#!/usr/bin/env bash
# The main job: set up, then build a tiny Gemma 4 (31B-shaped), convert HF -> Orbax -> HF,
# check bytes and cross-framework logits, and write out/report.md. Options: see --help.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
scripts/setup.sh
exec .venv/bin/python -m ckptbridge.demo "$@"
