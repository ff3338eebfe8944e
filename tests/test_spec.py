"""Every rule of the Gemma 4 table pinned on a config whose dims are all distinct."""

import numpy as np
import pytest

from ckptbridge import mapping
from ckptbridge.specs import GEMMA4, parse_config
from ckptbridge.specs.gemma4 import text_config_kwargs

from conftest import flat_state

V, D, N, K, H, HG, KG, F = 300, 40, 4, 2, 12, 20, 1, 56


def cfg(k_eq_v=True):
    return parse_config({"model_type": "gemma4_text", **text_config_kwargs(k_eq_v=k_eq_v)})


def by_name(entries, name, layer):
    return next(e for e in entries if e.rule.name == name and (e.layer.index if e.layer else None) == layer)


def test_dims_are_distinct():
    assert len({V, D, N, K, H, HG, KG, F}) == 8


@pytest.mark.parametrize("k_eq_v", [True, False])
def test_every_entry_round_trips(k_eq_v):
    rng = np.random.default_rng(0)
    for e in mapping.entries(cfg(k_eq_v), GEMMA4, "model."):
        arrays = [rng.standard_normal(e.hf_shape).astype(np.float32) for _ in e.hf_keys]
        value = mapping.hf_to_tunix(e, arrays)
        assert value.shape == e.tunix_shape
        back = mapping.tunix_to_hf(e, value)
        for a, b in zip(arrays, back):
            np.testing.assert_array_equal(a, b)


def test_rules_against_explicit_numpy():
    rng = np.random.default_rng(1)
    ents = mapping.entries(cfg(True), GEMMA4, "model.language_model.")
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731

    q = by_name(ents, "q", 0)
    assert q.hf_keys == ("model.language_model.layers.0.self_attn.q_proj.weight",)
    w = r(N * H, D)
    np.testing.assert_array_equal(mapping.hf_to_tunix(q, [w]), w.reshape(N, H, D).transpose(0, 2, 1))

    qg = by_name(ents, "q", 5)
    w = r(N * HG, D)
    np.testing.assert_array_equal(mapping.hf_to_tunix(qg, [w]), w.reshape(N, HG, D).transpose(0, 2, 1))

    kv = by_name(ents, "kv", 0)
    assert kv.hf_keys[0].endswith("k_proj.weight") and kv.hf_keys[1].endswith("v_proj.weight")
    k, v = r(K * H, D), r(K * H, D)
    expected = np.stack([k.reshape(K, H, D).transpose(0, 2, 1), v.reshape(K, H, D).transpose(0, 2, 1)])
    got = mapping.hf_to_tunix(kv, [k, v])
    assert got.shape == (2, K, D, H)
    np.testing.assert_array_equal(got, expected)

    kg = by_name(ents, "k", 5)
    assert kg.tunix_path == ("layers", "5", "attn", "k_einsum", "w")
    k = r(KG * HG, D)
    np.testing.assert_array_equal(mapping.hf_to_tunix(kg, [k]), k.reshape(KG, HG, D).transpose(0, 2, 1))

    o = by_name(ents, "o", 5)
    w = r(D, N * HG)
    np.testing.assert_array_equal(mapping.hf_to_tunix(o, [w]), w.reshape(D, N, HG).transpose(1, 2, 0))

    for name in ("gate", "up"):
        e = by_name(ents, name, 3)
        w = r(F, D)
        np.testing.assert_array_equal(mapping.hf_to_tunix(e, [w]), w.T)
    down = by_name(ents, "down", 3)
    w = r(D, F)
    np.testing.assert_array_equal(mapping.hf_to_tunix(down, [w]), w.T)

    emb = by_name(ents, "embed", None)
    assert emb.hf_shape == (V, D) and emb.tunix_path == ("embedder", "input_embedding")
    assert by_name(ents, "layer_scalar", 2).tunix_path == ("layers", "2", "skip_scale")
    assert by_name(ents, "k_norm", 5).hf_shape == (HG,)


def test_layer_kinds_select_rules():
    ents = mapping.entries(cfg(True), GEMMA4, "model.")
    names = {(e.layer.index if e.layer else None, e.rule.name) for e in ents}
    assert (5, "k") in names and (5, "kv") not in names
    assert (0, "kv") in names and (0, "k") not in names
    assert not any("v_proj" in k for e in ents if e.layer and e.layer.index == 5 for k in e.hf_keys)
    ents = mapping.entries(cfg(False), GEMMA4, "model.")
    kv5 = by_name(ents, "kv", 5)
    assert kv5.tunix_shape == (2, K, D, HG)


def test_tunix_parameter_tree_matches_spec():
    """The spec covers exactly Tunix's Gemma4 parameters, with Tunix's shapes (fails if Tunix changes)."""
    from flax import nnx
    from tunix.models.gemma4 import model as gm

    from ckptbridge.tunix_model import tunix_model_config

    for k_eq_v in (True, False):
        c = cfg(k_eq_v)
        abstract = nnx.eval_shape(lambda: gm.Gemma4(tunix_model_config(c), rngs=nnx.Rngs(params=0)))
        flat = {path: tuple(leaf.shape) for path, leaf in flat_state(abstract).items()}
        ours = {e.tunix_path: e.tunix_shape for e in mapping.entries(c, GEMMA4, "model.")}
        assert ours == flat
