"""Quantize HF models with llm-compressor, data-free: the reference ckptbridge's quantized output
is compared with. Runs in .venv-quant (scripts/setup.sh):

    .venv-quant/bin/python tests/quant_reference.py OUT SRC [SRC ...]

writes OUT/<basename of SRC>/<scheme> for the W8A8 and FP8_DYNAMIC presets, as their documentation
does it: every Linear but lm_head, then ``save_pretrained(save_compressed=True)``.
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
        with open(os.path.join(src, "config.json")) as f:
            arch = json.load(f)["architectures"][0]
        auto = (transformers.AutoModelForImageTextToText if arch.endswith("ForConditionalGeneration")
                else transformers.AutoModelForCausalLM)
        for name, preset in SCHEMES.items():
            model = auto.from_pretrained(src, dtype=torch.bfloat16)
            oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=preset, ignore=["lm_head"]))
            model.save_pretrained(os.path.join(out, os.path.basename(src), name), save_compressed=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
