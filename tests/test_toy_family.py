"""Adding a family is one spec module: a Mistral spec written here (Llama's architecture; registered
only for these tests, on Tunix's Llama 3 model) converts a tiny transformers Mistral bit for bit,
builds the Tunix model with transformers' logits, and moves LoRA both ways, with no change
anywhere else."""

import numpy as np
import pytest

from ckptbridge.config import FULL, LayerConfig, ModelConfig, int_field
from ckptbridge.specs import FAMILIES, FamilySpec, ModelType, TensorRule, TunixModel, register

R = TensorRule
RULES = (
    R("embed", ("embed_tokens.weight",), "v d", "embedder.input_embedding", "v d", scope="model"),
    R("final_norm", ("norm.weight",), "d", "final_norm.w", "d", scope="model"),
    R("lm_head", ("lm_head.weight",), "v d", "lm_head.w", "d v", scope="model", when="untied", absolute=True),
    R("q", ("self_attn.q_proj.weight",), "(n h) d", "attn.q_proj.w", "d n h", lora="q_proj"),
    R("k", ("self_attn.k_proj.weight",), "(k h) d", "attn.k_proj.w", "d k h", lora="k_proj"),
    R("v", ("self_attn.v_proj.weight",), "(k h) d", "attn.v_proj.w", "d k h", lora="v_proj"),
    R("o", ("self_attn.o_proj.weight",), "d (n h)", "attn.o_proj.w", "n h d", lora="o_proj"),
    R("gate", ("mlp.gate_proj.weight",), "f d", "mlp.gate_proj.kernel", "d f", lora="gate_proj"),
    R("up", ("mlp.up_proj.weight",), "f d", "mlp.up_proj.kernel", "d f", lora="up_proj"),
    R("down", ("mlp.down_proj.weight",), "d f", "mlp.down_proj.kernel", "f d", lora="down_proj"),
    R("pre_attn_norm", ("input_layernorm.weight",), "d", "input_layernorm.w", "d"),
    R("post_attn_norm", ("post_attention_layernorm.weight",), "d", "post_attention_layernorm.w", "d"),
)


def parse(hf: dict, where: str = "config.json") -> ModelConfig:
    n, k, L = (int_field(hf, key, where) for key in ("num_attention_heads", "num_key_value_heads", "num_hidden_layers"))
    v, d, f = (int_field(hf, key, where) for key in ("vocab_size", "hidden_size", "intermediate_size"))
    h = hf.get("head_dim") or d // n
    sizes = {"v": v, "d": d, "n": n, "h": h, "k": k, "f": f, "one": 1}
    tie = bool(hf.get("tie_word_embeddings", False))
    return ModelConfig("toymistral", "mistral", v, d, f, n, tuple(LayerConfig(i, FULL, h, k, "full") for i in range(L)),
                       float(hf.get("rms_norm_eps", 1e-6)), tie, None, "model.", (), sizes, {"untied": not tie},
                       {}, hf)


def tunix_config(cfg: ModelConfig, *, dtype=None, param_dtype=None, remat=None, sharding=None):
    from tunix.models.llama3 import model as lm

    return lm.ModelConfig(num_layers=cfg.num_layers, vocab_size=cfg.vocab_size, embed_dim=cfg.hidden_size,
                          hidden_dim=cfg.intermediate_size, num_heads=cfg.num_heads, head_dim=cfg.layers[0].head_dim,
                          num_kv_heads=cfg.layers[0].num_kv_heads, rope_theta=1_000_000, norm_eps=cfg.rms_norm_eps,
                          weight_tying=cfg.tie_word_embeddings)


def tiny(**overrides) -> dict:
    return {"model_type": "mistral", "sliding_window": None, "vocab_size": 300, "hidden_size": 40, "intermediate_size": 56, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12, "rope_theta": 1e6,
            "tie_word_embeddings": False, "rms_norm_eps": 1e-6, **overrides}


TOY = FamilySpec(name="toymistral", types=(ModelType("mistral", "MistralForCausalLM", "model.", tiny),),
                 rules=RULES, key_prefixes=("model.",), parse_config=parse,
                 axes=("v", "d", "n", "h", "k", "f"), model_flags=("untied",), tied_keys=("lm_head.weight",),
                 tunix=TunixModel("tunix.models.llama3.model", "Llama3", tunix_config))


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    if any("mistral" in spec.model_types for spec in FAMILIES.values()):
        pytest.skip("a mistral family is registered already")
    register(TOY)
    try:
        from ckptbridge.testing import build_checkpoint

        yield build_checkpoint(str(tmp_path_factory.mktemp("toy") / "llama"), family="toymistral", tokenizer=False)
    finally:
        FAMILIES.pop("toymistral", None)


def test_spec_is_checked_against_its_vocabulary():
    with pytest.raises(ValueError, match="undeclared axes"):
        FamilySpec(name="bad", types=(ModelType("x", "X", "model."),), rules=(R("q", ("q",), "(n h) d", "q", "n z"),),
                   key_prefixes=("model.",), parse_config=parse, axes=("n", "h", "d"))
    with pytest.raises(ValueError, match="not one of the family's flags"):
        FamilySpec(name="bad", types=(ModelType("x", "X", "model."),),
                   rules=(R("q", ("q",), "d", "q", "d", when="nope"),), key_prefixes=("model.",),
                   parse_config=parse, axes=("d",))
    with pytest.raises(ValueError, match="later Tunix layout"):
        FamilySpec(name="bad", types=(ModelType("x", "X", "model."),),
                   rules=(R("q", ("q",), "(n h) d", "q", "d n h", tunix_layouts_after=(("0.1.7", "d n"),)),),
                   key_prefixes=("model.",), parse_config=parse, axes=("n", "h", "d"))


def test_tunix_layout_follows_the_version():
    from ckptbridge.specs.base import tunix_version_key

    rule = R("q", ("q",), "(n h) d", "q", "d n h", tunix_layouts_after=(("0.1.7", "d (n h)"), ("0.3", "(n h) d")))
    assert [rule.tunix_layout_for(v) for v in (None, "0.1.6", "0.1.7", "0.1.8.dev0", "v0.2.1", "0.3.0", "1.0")] == \
        ["d n h", "d n h", "d n h", "d (n h)", "d (n h)", "d (n h)", "(n h) d"]
    assert tunix_version_key("0.1.7+git.c7d8950") == (0, 1, 7)
    with pytest.raises(ValueError, match="not a version"):
        tunix_version_key("next")


def test_toy_family_end_to_end(toy, tmp_path):
    import jax

    from ckptbridge import convert_orbax_to_peft, convert_peft_to_orbax
    from ckptbridge import convert_orbax_to_safetensors, convert_safetensors_to_orbax
    from ckptbridge.testing import build_peft_adapter, build_tunix_lora, save_tunix_lora
    from ckptbridge.tunix_model import load_tunix_adapter
    from ckptbridge.verify import compare_tensors, logits_parity, peft_logits, rel_l2, tunix_logits

    jax.config.update("jax_default_matmul_precision", "highest")
    r = convert_safetensors_to_orbax(toy, str(tmp_path / "orbax"), progress=False)
    assert r.family == "toymistral" and r.tensors == 3 + 3 * 9
    convert_orbax_to_safetensors(str(tmp_path / "orbax"), str(tmp_path / "back"), progress=False)
    assert compare_tensors(toy, str(tmp_path / "back")).identical
    assert logits_parity(toy, str(tmp_path / "orbax")).rel_l2 <= 1e-5
    tokens = np.random.default_rng(0).integers(0, 300, size=(2, 9))
    peft_dir = build_peft_adapter(toy, str(tmp_path / "peft"), seed=1)
    convert_peft_to_orbax(peft_dir, str(tmp_path / "lora"), base=toy, progress=False)
    got = tunix_logits(load_tunix_adapter(toy, str(tmp_path / "lora")), tokens)
    assert rel_l2(got, peft_logits(toy, peft_dir, tokens)) <= 1e-5
    model, rules = build_tunix_lora(toy, seed=2)
    ckpt = save_tunix_lora(model, str(tmp_path / "tunix"), custom_metadata={"ckptbridge": {"lora": {"rules": rules}}})
    convert_orbax_to_peft(ckpt, str(tmp_path / "exported"), base=toy, progress=False)
    assert rel_l2(peft_logits(toy, str(tmp_path / "exported"), tokens), tunix_logits(model, tokens)) <= 1e-5
