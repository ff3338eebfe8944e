import json

import pytest

from ckptbridge.config import FULL, SLIDING
from ckptbridge.errors import ConfigError, UnsupportedError
from ckptbridge.specs import parse_config
from ckptbridge.specs.gemma4 import text_config_kwargs, to_per_layer_config


def text(**kw):
    base = text_config_kwargs(k_eq_v=True)
    base.update(model_type="gemma4_text", num_hidden_layers=12)
    base.update(kw)
    return base


def wrapped(**kw):
    return {"model_type": "gemma4", "text_config": text(**kw), "vision_config": None, "audio_config": None}


def test_layer_kinds_31b_shape():
    cfg = parse_config(text())
    kinds = [(layer.attention, layer.head_dim, layer.num_kv_heads, layer.flags["k_eq_v"]) for layer in cfg.layers]
    assert kinds[:5] == [(SLIDING, 12, 2, False)] * 5
    assert kinds[5] == (FULL, 20, 1, True)
    assert kinds[11] == (FULL, 20, 1, True)
    assert cfg.layer_kinds() == {"sliding": 10, "global (k_eq_v)": 2}
    assert cfg.default_key_prefix == "model."


def test_global_without_k_eq_v_uses_global_head_dim_and_plain_kv_heads():
    cfg = parse_config(text(attention_k_eq_v=False))
    g = cfg.layers[5]
    # transformers applies num_global_key_value_heads only to k_eq_v layers
    assert (g.head_dim, g.num_kv_heads, g.flags["k_eq_v"]) == (20, 2, False)
    assert g.flags == {"k_eq_v": False, "kv_fused": True, "global": True, "moe": False, "kv_shared": False}


def test_model_types_agree():
    a, b = parse_config(text()), parse_config(wrapped())
    assert a.layers == b.layers
    assert b.model_type == "gemma4" and b.default_key_prefix == "model.language_model."


@pytest.mark.parametrize("k_eq_v", [True, False])
@pytest.mark.parametrize("wrap", [False, True])
def test_per_layer_config_dialect_equals_legacy(tmp_path, k_eq_v, wrap):
    legacy = wrapped(attention_k_eq_v=k_eq_v) if wrap else text(attention_k_eq_v=k_eq_v)
    inner = legacy["text_config"] if wrap else legacy
    inner["layer_types"] = [SLIDING if (i + 1) % 6 else FULL for i in range(12)]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(legacy))
    to_per_layer_config(str(path))
    new = json.loads(path.read_text())
    inner = new["text_config"] if wrap else new
    assert "global_head_dim" not in inner and "per_layer_config" in inner
    a, b = parse_config(legacy), parse_config(new)
    assert a.layers == b.layers
    assert (a.dialect, b.dialect) == ("legacy", "per_layer_config")


def test_defaults_follow_transformers():
    cfg = parse_config({"model_type": "gemma4_text", "num_hidden_layers": 7, "hidden_size_per_layer_input": 0})
    # 5:1 pattern, last layer forced to full attention; global_head_dim default 512
    assert [layer.is_global for layer in cfg.layers] == [False] * 5 + [True, True]
    assert cfg.layers[6].head_dim == 512 and cfg.layers[0].head_dim == 256


@pytest.mark.parametrize(
    "override, needle",
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
    ],
)
def test_unsupported_variants_are_named(override, needle):
    with pytest.raises(UnsupportedError, match=needle):
        parse_config(text(**override))


def test_per_layer_embeddings_and_kv_shared_layers():
    """E2B-style: per-layer embeddings on by transformers' default (P 256), the last layers kv-shared
    (no k/v rows in HF) with a double-wide MLP."""
    hf = text(num_kv_shared_layers=2, use_double_wide_mlp=True)
    del hf["hidden_size_per_layer_input"]
    cfg = parse_config(hf)
    assert cfg.flags["ple"] and (cfg.sizes["l"], cfg.sizes["p"], cfg.sizes["u"]) == (12, 256, 262_144)
    assert [layer.flags["kv_shared"] for layer in cfg.layers] == [False] * 10 + [True] * 2
    assert [cfg.layer_sizes(layer)["f"] for layer in cfg.layers] == [56] * 10 + [112] * 2
    with pytest.raises(ConfigError, match="num_kv_shared_layers 12"):
        parse_config(text(num_kv_shared_layers=12))


def test_moe_needs_its_sizes():
    with pytest.raises(ConfigError, match="num_experts"):
        parse_config(text(enable_moe_block=True))
    cfg = parse_config(text(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=8))
    assert cfg.sizes["e"] == 4 and all(layer.flags["moe"] for layer in cfg.layers)


def test_unknown_model_type():
    with pytest.raises(UnsupportedError, match="model_type 'mixtral'.*gemma4"):
        parse_config({"model_type": "mixtral"})


def test_bad_values():
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        parse_config(text(num_hidden_layers=0))
    with pytest.raises(ConfigError, match="layer_types"):
        parse_config(text(layer_types=["sliding_attention"]))
    with pytest.raises(ConfigError, match="per_layer_config key 'x'"):
        parse_config(text(per_layer_config={"x": {}}))


def test_towers_are_noted():
    cfg = parse_config({**wrapped(), "vision_config": {"hidden_size": 8}})
    assert cfg.towers == ("vision",)
