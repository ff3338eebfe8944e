"""ckptbridge's quantized models against llm-compressor's, byte for byte.

llm-compressor (in .venv-quant, scripts/setup.sh) quantizes the same bfloat16 checkpoints with its
data-free W8A8 and FP8_DYNAMIC presets (tests/quant_reference.py); ``ckptbridge quantize`` must
write the same tensors (every weight, scale and untouched tensor: names, dtypes, shapes, bytes) and
the same ``quantization_config``. Rows: Gemma 4 with k_eq_v global layers (no v_proj there) and
Qwen 3 with an untied head, from two shards.
"""

import json
import os
import subprocess

import pytest

from ckptbridge.io.hf import HFModelDir
from ckptbridge.merge import quantize_model
from ckptbridge.quantize import SCHEMES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUANT_PYTHON = os.environ.get("CKPTBRIDGE_QUANT_PYTHON") or os.path.join(ROOT, ".venv-quant", "bin", "python")
ROWS = ["keqv_text_bf16_single", "qwen3_untied_bf16_sharded"]

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.exists(QUANT_PYTHON), reason="no .venv-quant: run scripts/setup.sh")]


@pytest.fixture(scope="module")
def reference(checkpoints, tmp_path_factory):
    """row -> scheme -> llm-compressor's output directory (one process for every row and scheme)."""
    out = tmp_path_factory.mktemp("llmcompressor")
    sources = [checkpoints[row] for row in ROWS]
    proc = subprocess.run([QUANT_PYTHON, os.path.join(ROOT, "tests", "quant_reference.py"), str(out), *sources],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {row: {s: str(out / os.path.basename(src) / s) for s in SCHEMES} for row, src in zip(ROWS, sources)}


def _tensors(path: str) -> dict[str, tuple[str, list[int], bytes]]:
    with HFModelDir(path) as m:
        return {k: (m.info(k).dtype, list(m.info(k).shape), m.file_of(k).raw(k)) for k in m.keys()}


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("row", ROWS)
def test_quantized_model_equals_llm_compressor_byte_for_byte(row, scheme, checkpoints, reference, tmp_path):
    ours = str(tmp_path / "ours")
    report = quantize_model(checkpoints[row], ours, scheme=scheme, progress=False)
    theirs = reference[row][scheme]
    mine, ref = _tensors(ours), _tensors(theirs)
    assert sorted(mine) == sorted(ref)
    quantized = [k for k in ref if k.endswith(".weight_scale")]
    assert len(quantized) == report.quantized_tensors > 0
    for key in ref:
        assert mine[key][:2] == ref[key][:2], key
        assert mine[key][2] == ref[key][2], f"{key}: bytes differ"
    with open(os.path.join(ours, "config.json")) as f:
        q_ours = json.load(f)["quantization_config"]
    with open(os.path.join(theirs, "config.json")) as f:
        q_ref = json.load(f)["quantization_config"]
    assert json.dumps(q_ours, sort_keys=True) == json.dumps(q_ref, sort_keys=True)


def test_reference_environment_is_the_one_the_format_version_names():
    out = subprocess.run([QUANT_PYTHON, "-c", "import compressed_tensors; print(compressed_tensors.__version__)"],
                         capture_output=True, text=True, check=True).stdout.strip()
    from ckptbridge.quantize import COMPRESSED_TENSORS_VERSION

    assert out == COMPRESSED_TENSORS_VERSION
