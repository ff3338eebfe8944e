"""A `--target vllm` adapter served by vLLM (CPU) gives HF+PEFT's greedy tokens."""

import json
import os
import subprocess

import numpy as np
import pytest

from ckptbridge import verify
from ckptbridge.adapters import convert_orbax_to_peft
from ckptbridge.testing import LORA_TARGETS, VLLM_DIMS, build_checkpoint, build_tunix_lora, save_tunix_lora

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVE_PYTHON = os.path.join(ROOT, ".venv-serve", "bin", "python")


@pytest.mark.skipif(not os.path.exists(SERVE_PYTHON), reason="no .venv-serve: run scripts/setup.sh")
def test_vllm_serves_the_vllm_target_adapter_exactly(tmp_path):
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    base = build_checkpoint(str(tmp_path / "base"), prefix="model.", **VLLM_DIMS)
    model, rules = build_tunix_lora(base, [{"module_path": LORA_TARGETS, "rank": 8, "alpha": 16.0}], seed=1, scale=1.0)
    root = save_tunix_lora(model, str(tmp_path / "ckpt"), custom_metadata={
        "ckptbridge": {"family": "gemma4", "kind": "lora", "lora": {"rules": rules}}})
    adapters = {t: str(tmp_path / f"adapter-{t}") for t in ("hf", "vllm")}
    for target, path in adapters.items():
        convert_orbax_to_peft(root, path, base=base, target=target, progress=False)
    ids = [int(x) for x in np.random.default_rng(0).integers(3, 512, size=10)]
    n = 16
    ref_base, ref_peft = verify.hf_greedy(base, None, ids, n), verify.hf_greedy(base, adapters["hf"], ids, n)
    assert ref_base != ref_peft  # the adapter matters

    spec = {"base": base, "adapters": adapters, "prompt_ids": ids, "max_tokens": n, "max_lora_rank": 8}
    proc = subprocess.run([SERVE_PYTHON, os.path.join(ROOT, "tests", "vllm_greedy.py"), json.dumps(spec)],
                          capture_output=True, text=True, timeout=900,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT "):])
    assert got["base"] == ref_base
    assert got["vllm"] == ref_peft
    # without the v_proj repeats vLLM leaves V of the k_eq_v layers without LoRA: why the target exists
    assert got["hf"] != ref_peft
