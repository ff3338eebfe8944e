"""Quantize HF models with llm-compressor, data-free: the reference ckptbridge's quantized output
is compared with. Runs in .venv-quant (scripts/setup.sh):

    .venv-quant/bin/python tests/quant_reference.py OUT SRC [SRC ...]

writes OUT/<basename of SRC>/<scheme> for the W8A8 and FP8_DYNAMIC presets, as their documentation
does it: every Linear but lm_head, then ``save_pretrained(save_compressed=True)``. And

    .venv-quant/bin/python tests/quant_reference.py --logits IDS SOURCE QUANTIZED [QUANTIZED ...]

loads each model with transformers (a quantized one through compressed-tensors), computes float32
logits on the token ids IDS and prints, per quantized model, its relative L2 error against SOURCE
and the share of positions whose argmax agrees, as JSON.
"""

import json
import os
import sys

import torch
import transformers
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier

SCHEMES = {"int8": "W8A8", "fp8": "FP8_DYNAMIC"}


def main(out: str, sources: list[str]) -> None:
    for src in sources:
        auto = _auto(src)
        for name, preset in SCHEMES.items():
            model = auto.from_pretrained(src, dtype=torch.bfloat16)
            oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=preset, ignore=["lm_head"]))
            model.save_pretrained(os.path.join(out, os.path.basename(src), name), save_compressed=True)


def _auto(path: str):
    with open(os.path.join(path, "config.json")) as f:
        arch = json.load(f)["architectures"][0]
    return (transformers.AutoModelForImageTextToText if arch.endswith("ForConditionalGeneration")
            else transformers.AutoModelForCausalLM)


def _round_per_token(x, fp8: bool):
    """Activations quantized and dequantized per token, as compressed-tensors does in transformers
    (int8: the token's largest magnitude over 127.5)."""
    q_max = 448.0 if fp8 else 127.0
    scale = (x.abs().amax(-1, keepdim=True).float() / (448.0 if fp8 else 127.5)).clamp_min(1e-12)
    y = (x.float() / scale).clamp(-q_max - (0 if fp8 else 1), q_max)
    y = y.to(torch.float8_e4m3fn).float() if fp8 else y.round()
    return (y * scale).to(x.dtype)


def _dequantized(source: str, quantized: str, activations: bool = False):
    """SOURCE with each quantized weight replaced by weight * weight_scale from QUANTIZED (in bfloat16),
    and with ``activations`` the inputs of those layers rounded per token: the model the scheme's
    rounding alone makes."""
    from safetensors.torch import load_file

    model = _auto(source).from_pretrained(source, dtype=torch.bfloat16)
    stored = {}
    for name in os.listdir(quantized):
        if name.endswith(".safetensors"):
            stored.update(load_file(os.path.join(quantized, name)))
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    fp8 = any(t.dtype == torch.float8_e4m3fn for t in stored.values())
    done = 0
    with torch.no_grad():
        for key, scale in stored.items():
            if key.endswith(".weight_scale"):
                weight = key[: -len("_scale")]
                target = params[weight]
                target.copy_((stored[weight].float() * scale.float()).to(torch.bfloat16))
                if activations:
                    modules[weight[: -len(".weight")]].register_forward_pre_hook(
                        lambda _, args: (_round_per_token(args[0], fp8), *args[1:]))
                done += 1
    assert done, quantized
    return model


def logits(ids: list[int], source: str, quantized: list[str]) -> None:
    def run(model):
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float()

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    ref = run(_auto(source).from_pretrained(source, dtype=torch.bfloat16))
    out = {}
    for path in quantized:
        got = run(_auto(path).from_pretrained(path, dtype=torch.bfloat16))
        weights = run(_dequantized(source, path))
        both = run(_dequantized(source, path, activations=True))
        out[path] = {"rel_l2": rel(got, ref), "argmax_agree": float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
                     "rel_l2_weight_rounding": rel(weights, ref), "rel_l2_all_rounding": rel(both, ref),
                     "rel_l2_vs_all_rounding": rel(got, both)}
    print(json.dumps(out))


if __name__ == "__main__":
    if sys.argv[1] == "--logits":
        logits([int(x) for x in sys.argv[2].split(",")], sys.argv[3], sys.argv[4:])
    else:
        main(sys.argv[1], sys.argv[2:])
