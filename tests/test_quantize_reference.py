"""ckptbridge's quantized models against llm-compressor's, byte for byte.

llm-compressor (in .venv-quant, scripts/setup.sh) quantizes the same bfloat16 checkpoints with its
data-free W8A8 and FP8_DYNAMIC presets (tests/quant_reference.py); ``ckptbridge quantize`` must
write the same tensors (every weight, scale and untouched tensor: names, dtypes, shapes, bytes) and
the same ``quantization_config``. Rows: Gemma 4 with k_eq_v global layers (no v_proj there) and
Qwen 3 with an untied head, from two shards. transformers (with compressed-tensors) loads both
schemes and their logits error is the size the schemes' rounding makes; vLLM (CPU) serves them, and
our int8 model gives the greedy tokens llm-compressor's does.
"""

import json
import os
import subprocess

import pytest

from ckptbridge.io.hf import HFModelDir
from ckptbridge import quantize_model
from ckptbridge.formats.compressed_tensors import SCHEMES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUANT_PYTHON = os.environ.get("CKPTBRIDGE_QUANT_PYTHON") or os.path.join(ROOT, ".venv-quant", "bin", "python")
SERVE_PYTHON = os.environ.get("CKPTBRIDGE_SERVE_PYTHON") or os.path.join(ROOT, ".venv-serve", "bin", "python")
ROWS = ["keqv_text_bf16_single", "qwen3_untied_bf16_sharded"]
SERVED = "vllm-gemma4"  # a Gemma 4 (k_eq_v) of the head sizes vLLM's CPU attention takes
IDS = "2,10,20,30,40,50,60,70,80,90,100,110"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.exists(QUANT_PYTHON), reason="no .venv-quant: run scripts/setup.sh")]


@pytest.fixture(scope="module")
def sources(checkpoints, tmp_path_factory):
    """name -> bfloat16 HF checkpoint: the rows, and SERVED."""
    from ckptbridge.specs.gemma4 import VLLM_DIMS
    from ckptbridge.testing import build_checkpoint

    served = build_checkpoint(str(tmp_path_factory.mktemp("served") / SERVED), prefix="model.", dtype="bfloat16",
                              attention_k_eq_v=True, max_position_embeddings=256, seed=1, **VLLM_DIMS)
    return {**{row: checkpoints[row] for row in ROWS}, SERVED: served}


@pytest.fixture(scope="module")
def reference(sources, tmp_path_factory):
    """name -> scheme -> llm-compressor's output directory (one process for every model and scheme)."""
    out = tmp_path_factory.mktemp("llmcompressor")
    proc = subprocess.run([QUANT_PYTHON, os.path.join(ROOT, "tests", "quant_reference.py"), str(out),
                           *sources.values()], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {name: {s: str(out / os.path.basename(src) / s) for s in SCHEMES} for name, src in sources.items()}


@pytest.fixture(scope="module")
def ours(sources, tmp_path_factory):
    """name -> scheme -> ``ckptbridge quantize`` output directory."""
    out = tmp_path_factory.mktemp("ours")
    return {name: {s: quantize_model(src, str(out / f"{name}-{s}"), scheme=s, progress=False).destination
                   for s in SCHEMES} for name, src in sources.items()}


def _tensors(path: str) -> dict[str, tuple[str, list[int], bytes]]:
    with HFModelDir(path) as m:
        return {k: (m.info(k).dtype, list(m.info(k).shape), m.file_of(k).raw(k)) for k in m.keys()}


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("row", ROWS)
def test_quantized_model_equals_llm_compressor_byte_for_byte(row, scheme, sources, reference, tmp_path):
    ours = str(tmp_path / "ours")
    report = quantize_model(sources[row], ours, scheme=scheme, progress=False)
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
    from ckptbridge.formats.compressed_tensors import COMPRESSED_TENSORS_VERSION

    assert out == COMPRESSED_TENSORS_VERSION


@pytest.mark.parametrize("row", ROWS)
def test_transformers_loads_both_schemes_with_the_error_their_rounding_makes(row, sources, ours):
    """Logits through compressed-tensors against the bfloat16 source, next to the same model with only
    the schemes' rounding applied (weights as stored, inputs of the quantized layers rounded per token)."""
    proc = subprocess.run([QUANT_PYTHON, os.path.join(ROOT, "tests", "quant_reference.py"), "--logits", IDS,
                           sources[row], *(ours[row][s] for s in sorted(SCHEMES))],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    for scheme in sorted(SCHEMES):
        f = figures[ours[row][scheme]]
        print(f"{row} {scheme}: relative L2 {f['rel_l2']:.4f} (rounding alone {f['rel_l2_all_rounding']:.4f}, "
              f"weights' rounding {f['rel_l2_weight_rounding']:.4f}), argmax agrees at {f['argmax_agree']:.0%}")
        assert 0 < f["rel_l2_weight_rounding"] and f["rel_l2"] <= 1.5 * f["rel_l2_all_rounding"], f
    # e4m3 keeps 3 bits of mantissa, int8 about 7: fp8 costs more
    assert figures[ours[row]["fp8"]]["rel_l2_weight_rounding"] > figures[ours[row]["int8"]]["rel_l2_weight_rounding"]


@pytest.mark.skipif(not os.path.exists(SERVE_PYTHON), reason="no .venv-serve: run scripts/setup.sh")
def test_vllm_serves_our_int8_model_as_llm_compressors(sources, ours, reference):
    import shutil

    theirs = reference[SERVED]["int8"]
    for name in os.listdir(sources[SERVED]):  # llm-compressor's save_pretrained writes no tokenizer
        if name.startswith("tokenizer") or name.endswith(".jinja"):
            shutil.copy(os.path.join(sources[SERVED], name), theirs)
    models = [ours[SERVED]["int8"], theirs, ours[SERVED]["fp8"]]
    proc = subprocess.run([SERVE_PYTHON, os.path.join(ROOT, "tests", "vllm_greedy.py"), IDS, "16", *models],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ids[models[0]] == ids[models[1]]
    # vLLM ran them as quantized models, with its int8 and fp8 kernels
    log = proc.stdout + proc.stderr
    assert "for CompressedTensorsW8A8Int8" in log and "for CompressedTensorsW8A8Fp8" in log
