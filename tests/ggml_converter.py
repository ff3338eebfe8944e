"""Run ggml's own converter (convert_hf_to_gguf.py with its conversion/ package and gguf-py, as
scripts/setup.sh unpacks them from the llama-cpp-python sdist into build/ggml) on several models in
one process: ``python tests/ggml_converter.py CONVERTER_DIR JOBS.json``, JOBS a list of
``[model_dir, out_file, outtype]`` (and ``"mmproj"`` after them for the projector file of a
multimodal model's towers: the converter's ``--mmproj``).

Two things the converter cannot do for the tests' tiny models are given to it, both about their
tokenizer (a byte-level BPE trained on a few sentences): the name of its pre-tokenizer, which the
converter finds by hashing the token ids of a fixed text (it knows the hashes of published
tokenizers only), and, for Gemma 1, 2 and 4, the byte-level form instead of their own SentencePiece
(-style) vocabularies, which it assumes. Everything else (names, shapes, types, values, metadata) is the converter's own.
"""

import json
import os
import sys

root, jobs = sys.argv[1], json.load(open(sys.argv[2]))
sys.path[:0] = [os.path.join(root, "gguf-py"), root]
import convert_hf_to_gguf  # noqa: E402
from conversion import base, gemma  # noqa: E402

base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"  # GPT-2's regex: a plain ByteLevel pre-tokenizer
for model in (gemma.GemmaModel, gemma.Gemma2Model, gemma.Gemma4Model):
    model.set_vocab = lambda self: self._set_vocab_gpt2()
for src, dst, outtype, *mmproj in jobs:
    sys.argv = ["convert_hf_to_gguf.py", src, "--outfile", dst, "--outtype", outtype] + \
        (["--mmproj"] if mmproj == ["mmproj"] else [])
    convert_hf_to_gguf.main()
