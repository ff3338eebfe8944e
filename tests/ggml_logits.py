"""ggml's own logits and tokens of GGUF files, with llama-cpp-python (in .venv-ggml):
``python tests/ggml_logits.py JOBS.json OUT.npz``, JOBS a list of ``{"gguf": path, "tokens": [[ids]],
"texts": [str], "lora": a GGUF LoRA applied at scale 1 (optional)}``. For job i, OUT holds
``logits_i`` (sequences x positions x vocab, float32, the KV cache in float32) and ``ids_i_j``: the
ids ggml's tokenizer gives text j (special tokens parsed, a BOS added as the file says)."""

import json
import sys

import llama_cpp
import numpy as np

jobs, out = json.load(open(sys.argv[1])), {}
for i, job in enumerate(jobs):
    llm = llama_cpp.Llama(model_path=job["gguf"], n_ctx=64, logits_all=True, verbose=False, n_threads=2,
                          type_k=0, type_v=0, flash_attn=False,  # type 0: float32 KV cache
                          lora_path=job.get("lora"))
    rows = []
    for seq in job["tokens"]:
        llm.reset()
        llm.eval(seq)
        rows.append(np.array(llm.scores[: len(seq)], dtype=np.float32))
    out[f"logits_{i}"] = np.stack(rows)
    for j, text in enumerate(job.get("texts", [])):
        out[f"ids_{i}_{j}"] = np.array(llm.tokenize(text.encode(), add_bos=True, special=True))
    del llm
np.savez(sys.argv[2], **out)
