"""Cross-framework logits: transformers on the HF checkpoint vs Tunix on the converted weights."""

import os

import numpy as np
import pytest

from ckptbridge.convert import convert_safetensors_to_orbax
from ckptbridge.verify import hf_logits, logits_parity, tunix_logits

from conftest import CASES

pytestmark = pytest.mark.slow
SEQ = 11  # > 2 x sliding window (4)


def tunix_from_restored_tree(orbax_dir, hf_dir):
    """Load the Orbax tree with plain Orbax and put it into tunix's Gemma4 by hand."""
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx
    from tunix.models.gemma4 import model as gm

    from ckptbridge.config import read_config_file
    from ckptbridge.specs import parse_config
    from ckptbridge.tunix_model import tunix_model_config

    tree = ocp.StandardCheckpointer().restore(os.path.abspath(orbax_dir))
    cfg = parse_config(read_config_file(os.path.join(hf_dir, "config.json")))
    tcfg = tunix_model_config(cfg)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: gm.Gemma4(tcfg, rngs=nnx.Rngs(params=0))))
    pure = state.to_pure_dict()

    def fill(dst, src):
        for key in dst:
            value = src[str(key)]
            if isinstance(dst[key], dict):
                fill(dst[key], value)
            else:
                assert tuple(dst[key].shape) == tuple(value.shape), key
                dst[key] = jax.numpy.asarray(np.asarray(value, dtype=np.float32))

    fill(pure, tree)
    return nnx.merge(graphdef, pure)


@pytest.mark.parametrize("case", list(CASES))
def test_restored_orbax_tree_gives_hf_logits(checkpoints, tmp_path, case):
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    hf_dir = checkpoints[case]
    orbax_dir = str(tmp_path / "orbax")
    convert_safetensors_to_orbax(hf_dir, orbax_dir, progress=False)
    model = tunix_from_restored_tree(orbax_dir, hf_dir)
    tokens = np.random.default_rng(7).integers(0, 300, size=(2, SEQ))
    ours, ref = tunix_logits(model, tokens), hf_logits(hf_dir, tokens)
    rel = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
    assert rel <= 1e-5, rel
    assert np.array_equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("case", ["keqv_lm_f32_sharded", "kv_text_f32_sharded"])
def test_loader_parity_from_hf_directory(checkpoints, case):
    r = logits_parity(checkpoints[case], seq_len=SEQ)
    assert r.rel_l2 <= 1e-5 and r.argmax_agreement == 1.0, r
    assert r.tokens == [2, SEQ] and SEQ > r.sliding_window


def test_matches_tunix_own_loader_where_it_works(checkpoints):
    """On a `model.language_model.` checkpoint Tunix's own loader and ours give the same parameters
    (this fails if Tunix changes its layout)."""
    import jax
    from flax import nnx
    from tunix.models.gemma4 import params_safetensors

    from ckptbridge.tunix_model import load_tunix_model

    hf_dir = checkpoints["keqv_lm_f32_sharded"]
    ours, tcfg = load_tunix_model(hf_dir)
    theirs = params_safetensors.create_model_from_safe_tensors(hf_dir, tcfg)
    a = jax.tree_util.tree_leaves_with_path(nnx.state(ours).to_pure_dict())
    b = dict(jax.tree_util.tree_leaves_with_path(nnx.state(theirs).to_pure_dict()))
    assert len(a) == len(b)
    for path, value in a:
        np.testing.assert_array_equal(np.asarray(value), np.asarray(b[path]), err_msg=str(path))
