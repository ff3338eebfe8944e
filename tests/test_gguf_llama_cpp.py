"""Our GGUF files in ggml's own runtime (llama-cpp-python 0.3.36, built by ``scripts/setup.sh
--ggml`` into .venv-ggml; skipped without it, and CI does not build it: README, "GGUF"). Its logits
(float32 KV cache) against transformers' on the same tokens, for Gemma 4 (k_eq_v global layers),
Gemma 3, Qwen 3, Qwen 3 MoE and Llama 3: NMSE < 1e-10 in f32, < 1e-3 in bf16, < 1e-2 in q8_0 (at
widths of whole Q8_0 blocks); an adapter merged on the way against PEFT's logits (< 1e-10 in
f32); and the ids its tokenizer gives texts against HF's tokenizer.

ggml's CPU backend computes GELU (Gemma's MLP activation) from a float16 table: the input rounded
to float16, the output a float16 (``GGML_GELU_FP16``, always defined in ggml-cpu/vec.h). For the
Gemma rows the f32 reference is therefore transformers with that GELU in the MLPs (the gap to
plain transformers is measured: 5e-7 to 7e-7 on these models), and the limit there is 1e-7: what
remains (2.7e-10 for Gemma 4, 6e-9 to 1e-8 for Gemma 3, with or without its linear RoPE scaling)
is ggml's arithmetic too, as the file is byte for byte the one ggml's converter writes
(tests/test_gguf_export.py).
"""

from __future__ import annotations

import functools
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


GELU_ROWS = {"keqv_lm_f32_sharded", "gemma3_text"}
GELU_F32_LIMIT = 1e-7


def _table_gelu():
    """GELU as ggml's CPU backend computes it: tanh-GELU of the input rounded to float16, rounded to
    float16 (inputs <= -10 give 0, >= 10 themselves)."""
    import torch

    class Float16TableGelu(torch.nn.Module):
        def forward(self, x):
            return _gelu(x)

    return Float16TableGelu()


def _gelu(x):
    import torch

    table = torch.from_numpy(_TABLE())
    idx = x.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    y = table[idx]
    return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, y)).to(x.dtype)


@functools.cache
def _TABLE() -> np.ndarray:
    """ggml's ``ggml_table_gelu_f16``: for every float16 f, float16(0.5 f (1 + tanhf(sqrt(2/pi) f (1 +
    0.044715 f^2)))) computed in float32 with the C library's ``tanhf`` (numpy's tanh differs from
    it in the last bit for a fifth of the inputs, which moves 235 entries), as float32."""
    import ctypes
    import ctypes.util

    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.tanhf.restype, libm.tanhf.argtypes = ctypes.c_float, [ctypes.c_float]
    f = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    with np.errstate(all="ignore"):
        inner = np.float32(0.7978845608028654) * f * (np.float32(1) + np.float32(0.044715) * f * f)
        t = np.array([libm.tanhf(float(v)) for v in inner], dtype=np.float32)
        g = np.float32(0.5) * f * (np.float32(1) + t)
    return g.astype(np.float16).astype(np.float32)


def _logits_with_table_gelu(src: str) -> np.ndarray:
    import torch

    from ckptbridge.verify import hf_model_class

    model = hf_model_class(src).from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()
    swapped = 0
    for module in model.modules():
        if hasattr(module, "act_fn") and hasattr(module, "down_proj"):
            module.act_fn = _table_gelu()
            swapped += 1
    assert swapped
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(TOKENS)).logits.float().numpy()


def _ggml(jobs: list[dict], tmp_path) -> dict:
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    proc = subprocess.run([PYTHON, os.path.join(ROOT, "tests", "ggml_logits.py"), str(tmp_path / "jobs.json"),
                           str(tmp_path / "out.npz")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(np.load(tmp_path / "out.npz"))


def test_ggml_computes_what_transformers_computes(checkpoints, wide, base_logits, adapters, tmp_path):
    from ckptbridge import convert_to_gguf
    from ckptbridge.verify import hf_logits

    jobs, expect, gaps = [], [], {}
    for name in ROWS:
        for outtype in ("f32", "bf16", "q8_0"):
            src = wide[name] if outtype == "q8_0" else checkpoints[name]
            dst = str(tmp_path / f"{name}.{outtype}.gguf")
            convert_to_gguf(src, dst, outtype=outtype, progress=False)
            jobs.append({"gguf": dst, "tokens": TOKENS.tolist(), "texts": TEXTS if outtype == "f32" else []})
            ref = hf_logits(src, TOKENS) if outtype == "q8_0" else base_logits[name]
            if outtype == "f32" and name in GELU_ROWS:
                gaps[name] = _nmse(_logits_with_table_gelu(src), ref)
                ref = _logits_with_table_gelu(src)
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
        errors[f"{name} {outtype}"] = _nmse(got[f"logits_{i}"], ref)
        if src is not None and outtype == "f32":
            tok = AutoTokenizer.from_pretrained(src)
            for j, text in enumerate(TEXTS):
                assert got[f"ids_{i}_{j}"].tolist() == tok(text).input_ids, (name, text)
    print(json.dumps({"nmse": errors, "float16 GELU vs transformers": gaps}, indent=1))
    assert all(1e-9 < g < 1e-5 for g in gaps.values()), gaps
    over = {k: v for k, v in errors.items()
            if v >= (GELU_F32_LIMIT if k.split(" ")[0] in GELU_ROWS and k.endswith(" f32") else LIMITS[k.rsplit(" ", 1)[1]])}
    assert not over, over


def test_a_gguf_lora_on_its_base_is_the_merged_model(checkpoints, adapters, tmp_path):
    """ggml applying our GGUF LoRA to the base's GGUF (f32) computes what it computes on the model
    merged on the way and what PEFT (or Tunix) computes, NMSE < 1e-10: one-scale PEFT adapters (Qwen 3;
    Llama 3, q/k rows reordered in B) and a PEFT adapter with rank and alpha patterns (scales folded
    into B; Qwen 3). Gemma 4 (a PEFT pattern, a Tunix LoRA with kv at its own rank and alpha, both
    folded): against the merged model only, NMSE < 1e-6, as ggml's float16 GELU table turns the last
    bit of W x + s B (A x) against (W + s B A) x into a float16 step now and then."""
    from ckptbridge import convert_adapter_to_gguf
    from ckptbridge import convert_to_gguf
    from ckptbridge.testing import build_peft_adapter
    from ckptbridge.verify import peft_logits

    patterned = build_peft_adapter(checkpoints["qwen3_untied"], str(tmp_path / "patterned"), r=4, lora_alpha=10,
                                   seed=4, rank_pattern={"down_proj": 6}, alpha_pattern={"down_proj": 3})
    cases = [("qwen3_untied", "peft"), ("llama3_tied", "peft"), ("qwen3_untied", "patterned"),
             ("keqv_lm_f32_sharded", "peft"), ("keqv_lm_f32_sharded", "tunix")]
    jobs, bases = [], {}
    for name, kind in cases:
        base = checkpoints[name]
        adapter = patterned if kind == "patterned" else getattr(adapters[name], kind)
        if name not in bases:
            bases[name] = str(tmp_path / f"{name}.gguf")
            convert_to_gguf(base, bases[name], outtype="f32", progress=False)
        lora = str(tmp_path / f"{name}-{kind}.lora.gguf")
        convert_adapter_to_gguf(adapter, lora, base=base, progress=False)
        merged = str(tmp_path / f"{name}-{kind}.merged.gguf")
        convert_to_gguf(base, merged, adapter=adapter, outtype="f32", progress=False)
        jobs += [{"gguf": bases[name], "tokens": TOKENS.tolist(), "lora": lora},
                 {"gguf": merged, "tokens": TOKENS.tolist()}]
    got = _ggml(jobs, tmp_path)
    errors = {}
    for i, (name, kind) in enumerate(cases):
        with_lora, merged = got[f"logits_{2 * i}"], got[f"logits_{2 * i + 1}"]
        errors[f"{name} {kind}: LoRA vs merged"] = _nmse(with_lora, merged)
        if name not in GELU_ROWS:
            ref = (peft_logits(checkpoints[name], patterned, TOKENS) if kind == "patterned" else
                   adapters[name].peft_logits if kind == "peft" else adapters[name].tunix_logits)
            errors[f"{name} {kind}: LoRA vs {'peft' if kind == 'patterned' else kind}"] = _nmse(with_lora, ref)
    print(json.dumps(errors, indent=1))
    over = {k: v for k, v in errors.items() if v >= (1e-6 if k.split(" ")[0] in GELU_ROWS else 1e-10)}
    assert not over, over
