#!/bin/bash
# ckptbridge in an environment it did not set up: a stock CUDA or TPU image with its own jax, flax,
# orbax-checkpoint, tensorstore, transformers and torch. ckptbridge runs from this checkout on PYTHONPATH;
# nothing of the image is changed. Prepare, where scripts/setup.sh has run:
#   .venv/bin/python scripts/compat_check.py make .compat/ref      # inputs + the pinned environment's digests
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     -d .compat/whl google-tunix==0.1.7 qwix==0.1.8 grain==0.2.18 ...   # what the image lacks (see
#     ../shared/tools/gpu/README.md); and flax==0.12.8 into .compat/flax (a combination that does not import)
# then on the image, from the checkout with .compat beside it: bash scripts/compat_image.sh (OUT=DIR for files).
# Prints: the versions found, `ckptbridge env`, the conversions compared byte for byte with both Orbax
# writers, Tunix logits against transformers, and the one-line errors for a flax that does not import.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TOKENIZERS_PARALLELISM=false
O=${OUT:-/tmp/out}; mkdir -p $O
PY=${PY:-python3}
[ -n "$SKIP_PIP" ] || $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .compat/whl/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:/tmp/site
$PY -c "
import sys
from ckptbridge import deps
print('python', sys.version.split()[0], ' '.join(f'{p} {deps.installed_version(p)}' for p in ('jax', 'jaxlib', 'flax', 'orbax-checkpoint', 'tensorstore', 'transformers', 'safetensors', 'torch', 'numpy', 'ml_dtypes', 'packaging', 'tqdm', 'threadpoolctl')))
" 2>&1 | tail -1
echo "== env"; $PY -m ckptbridge env > $O/env.txt 2>&1; echo "rc=$?"; grep -A3 "^accelerators" $O/env.txt; grep -E "^  (core|orbax|verify|train) " $O/env.txt
$PY -m ckptbridge env --json > $O/env.json 2>$O/env.err; echo "env --json rc=$?"
echo "== compat (default writer)"; t=$EPOCHREALTIME; $PY scripts/compat_check.py check .compat/ref > $O/compat_default.json 2>$O/compat_default.err; echo "rc=$? $(awk "BEGIN{print $EPOCHREALTIME-$t}") s"; tail -11 $O/compat_default.json; tail -3 $O/compat_default.err
echo "== compat (public writer)"; CKPTBRIDGE_ORBAX_WRITER=public $PY scripts/compat_check.py check .compat/ref > $O/compat_public.json 2>$O/compat_public.err; echo "rc=$?"; tail -11 $O/compat_public.json | tr -d '\n '; echo
$PY -c "from ckptbridge.io import orbax as o; print('orbax writer chosen:', o.orbax_writer())"
echo "== verify logits (Tunix on this jax/flax, CPU and GPU)"
$PY -m ckptbridge verify logits /tmp/ckptbridge-compat/inputs/base 2>&1 | tail -3; echo "rc=$?"
JAX_PLATFORMS=cuda $PY -m ckptbridge verify logits /tmp/ckptbridge-compat/inputs/base --tolerance 1e-3 2>&1 | tail -3
echo "== flax 0.12.8 forced in beside this jax"
$PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/oldflax .compat/flax/*.whl 2>&1 | tail -2
PYTHONPATH=/tmp/oldflax:$PYTHONPATH $PY -m ckptbridge verify logits /tmp/ckptbridge-compat/inputs/base; echo "rc=$?"
PYTHONPATH=/tmp/oldflax:$PYTHONPATH $PY -c "
from ckptbridge import deps
deps.CONFLICTS = ()  # the import itself, as for a combination nobody has seen
try:
    deps.load('tunix.models.gemma4.model', 'verify')
except deps.DependencyError as e:
    print('unknown-combination line:', e)
" 2>&1 | tail -2
echo "== contract tests here"
if $PY -m pytest --version >/dev/null 2>&1; then
  JAX_PLATFORMS=cpu timeout 300 $PY -m pytest -q -x -p no:cacheprovider tests/test_orbax_contract.py tests/test_orbax_reader.py 2>&1 | tail -4
else echo "no pytest on this image"; fi
