#!/usr/bin/env bash
# The main job: set up, then the whole pipeline on an embedded tiny model (--family gemma4|gemma3|gemma2|gemma|qwen3|qwen2|llama3;
# default the Gemma 4 shaped like 31B):
# LoRA fine-tune -> conversions -> merge -> vLLM serve -> bench -> verilog-eval; writes out/report.md.
# Options (--family, --base, --data, --problems, --out, --smallest): see ./run.sh --help.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
scripts/setup.sh
exec .venv/bin/python -m pipeline "$@"
