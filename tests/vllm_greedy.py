"""Greedy token ids of models served by vLLM (offline engine, CPU), one model after another:

    .venv-serve/bin/python tests/vllm_greedy.py IDS MAX_TOKENS MODEL [MODEL ...]

prints one JSON object: model path -> greedy ids (vLLM's log names the linear kernels it chose).
"""

import gc
import json
import os
import sys


def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    ids = [int(x) for x in sys.argv[1].split(",")]
    n = int(sys.argv[2])
    out = {}
    for path in sys.argv[3:]:
        llm = LLM(path, dtype="bfloat16", max_model_len=256, enforce_eager=True, seed=0,
                  distributed_executor_backend="uni")
        got = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=n, min_tokens=n, temperature=0))
        out[path] = list(got[0].outputs[0].token_ids)
        del llm
        gc.collect()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
