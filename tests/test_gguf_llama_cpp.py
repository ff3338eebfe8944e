"""Our GGUF files in ggml's own runtime (llama-cpp-python 0.3.36, built by ``scripts/setup.sh
--ggml`` into .venv-ggml; skipped without it, and CI does not build it: README, "GGUF"). Its logits
(float32 KV cache) against transformers' on the same tokens, for Gemma 4 (k_eq_v global layers),
Gemma 3, Qwen 3, Qwen 3 MoE and Llama 3: NMSE < 1e-10 in f32, < 1e-3 in bf16, < 1e-2 in q8_0 (at
widths of whole Q8_0 blocks); an adapter merged on the way against PEFT's logits (< 1e-10 in
f32); and the ids its tokenizer gives texts against HF's tokenizer.
"""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest

from families import TOKENS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = os.path.join(ROOT, ".venv-ggml", "bin", "python")
if not os.path.isfile(PYTHON):
    pytest.skip(".venv-ggml is not built (scripts/setup.sh --ggml)", allow_module_level=True)

ROWS = ["keqv_lm_f32_sharded", "gemma3_text", "qwen3_untied", "qwen3_moe", "llama3_tied"]
LIMITS = {"f32": 1e-10, "bf16": 1e-3, "q8_0": 1e-2}
TEXTS = ["module TopModule(input clk, input reset);", "<start_of_turn>user\nassign out = a & b;<end_of_turn>",
         "The quick brown fox 0123456789  spaces\n\nnew lines"]


def _nmse(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a.astype(np.float64) - b) ** 2).sum() / (b.astype(np.float64) ** 2).sum())


def _ggml(jobs: list[dict], tmp_path) -> dict:
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    proc = subprocess.run([PYTHON, os.path.join(ROOT, "tests", "ggml_logits.py"), str(tmp_path / "jobs.json"),
                           str(tmp_path / "out.npz")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(np.load(tmp_path / "out.npz"))


def test_ggml_computes_what_transformers_computes(checkpoints, wide, base_logits, adapters, tmp_path):
    from ckptbridge.gguf_export import convert_to_gguf
    from ckptbridge.verify import hf_logits

    jobs, expect = [], []
    for name in ROWS:
        for outtype in ("f32", "bf16", "q8_0"):
            src = wide[name] if outtype == "q8_0" else checkpoints[name]
            dst = str(tmp_path / f"{name}.{outtype}.gguf")
            convert_to_gguf(src, dst, outtype=outtype, progress=False)
            jobs.append({"gguf": dst, "tokens": TOKENS.tolist(), "texts": TEXTS if outtype == "f32" else []})
            ref = hf_logits(src, TOKENS) if outtype == "q8_0" else base_logits[name]
            expect.append((name, outtype, src, ref))
    name = "qwen3_untied"  # a PEFT adapter merged on the way
    dst = str(tmp_path / "merged.gguf")
    convert_to_gguf(checkpoints[name], dst, adapter=adapters[name].peft, outtype="f32", progress=False)
    jobs.append({"gguf": dst, "tokens": TOKENS.tolist()})
    expect.append((name + " + PEFT adapter", "f32", None, adapters[name].peft_logits))
    got = _ggml(jobs, tmp_path)

    from transformers import AutoTokenizer

    errors = {}
    for i, (name, outtype, src, ref) in enumerate(expect):
        errors[f"{name} {outtype}"] = err = _nmse(got[f"logits_{i}"], ref)
        assert err < LIMITS[outtype], (name, outtype, err)
        if src is not None and outtype == "f32":
            tok = AutoTokenizer.from_pretrained(src)
            for j, text in enumerate(TEXTS):
                assert got[f"ids_{i}_{j}"].tolist() == tok(text).input_ids, (name, text)
    print(json.dumps(errors, indent=1))
