"""The family contract, weights: what every row of tests/families.py guarantees (its ``checks``).

HF -> Orbax -> HF bit for bit; our Tunix parameters equal to the ones Tunix's own safetensors
loader builds; the Orbax tree, restored with plain Orbax into the family's Tunix model, gives
transformers' logits; inspect; bad inputs named. Below the parametrized tests: the parts of the
conversions that do not depend on the family, checked on one row.
"""

import json
import os
import re

import numpy as np
import pytest

from ckptbridge import convert_orbax_to_safetensors, convert_safetensors_to_orbax
from ckptbridge.errors import ConfigError, MismatchError, UnsupportedError
from ckptbridge.io.hf import HFModelDir
from ckptbridge.io.orbax import OrbaxCheckpoint, nest
from ckptbridge.mapping import Entry
from ckptbridge.formats.hf import open_hf_source
from ckptbridge.verify import compare_tensors, logits_parity, tunix_logits

from conftest import flat_state, rewrite_checkpoint, run_cli, tree_hash
from families import CASES, TOKENS, rows

ASSETS = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def _restore(orbax_dir: str) -> dict:
    """The Orbax tree as plain Orbax restores it (no ckptbridge code)."""
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer().restore(os.path.abspath(orbax_dir))


def _leaf(tree: dict, path: tuple[str, ...]):
    for p in path:
        tree = tree[p]
    return tree


@pytest.mark.parametrize("name", rows("round_trip"))
def test_round_trip_is_bitwise(checkpoints, converted, tmp_path, name):
    """HF -> Orbax -> HF gives every tensor back bit for bit (key, dtype, bytes), under the prefix
    found on disk, with config and tokenizer files, a multimodal row's towers too; the Orbax
    checkpoint records family, prefix, config and the towers it holds; the input is untouched."""
    case, src = CASES[name], checkpoints[name]
    orbax_dir, r = converted[name]
    assert r.key_prefix == case.prefix
    back = str(tmp_path / "back")
    shard = {"max_shard_size": case.back_shard} if case.back_shard else {}  # else the default: one file here
    r2 = convert_orbax_to_safetensors(orbax_dir, back, progress=False, **shard)
    assert r2.key_prefix == case.prefix
    cmp = compare_tensors(src, back)
    assert cmp.identical and cmp.tensors > 0, cmp
    with open_hf_source(src, keep_towers=True) as source:
        towers = sorted(source.tower_keys)
        assert source.prefix == case.prefix
        # every HF tensor maps to one entry (the towers' too), each entry to its own Tunix parameter
        mapped = [k for e in source.all_entries for k in e.hf_keys]
        assert len(mapped) == len(set(mapped))
        assert set(mapped) == set(source.model.keys()) - set(source.tied_keys)
        assert len({e.tunix_path for e in source.all_entries}) == len(source.all_entries)
        assert all(isinstance(e, Entry) for e in source.all_entries)
        assert sorted(k for e in source.tower_entries for k in e.hf_keys) == towers
    assert bool(towers) == case.multimodal and r.towers_dropped == 0
    with HFModelDir(src) as a, HFModelDir(back) as b:
        text = sorted(a.keys())
        assert sorted(b.keys()) == text
        for k in text:
            assert a.info(k).dtype == b.info(k).dtype, k
            assert a.array(k).tobytes() == b.array(k).tobytes(), k
    shards = [f for f in r2.files if f.endswith(".safetensors")]
    if case.back_shard:
        assert len(shards) > 1
        index = json.load(open(os.path.join(back, "model.safetensors.index.json")))
        assert set(index["weight_map"]) == set(text) and set(index["weight_map"].values()) == set(shards)
    else:
        assert shards == ["model.safetensors"]
    assert json.load(open(os.path.join(back, "config.json"))) == json.load(open(os.path.join(src, "config.json")))
    others = [f for f in os.listdir(src) if not f.endswith(".safetensors") and f not in
              ("config.json", "model.safetensors.index.json")]
    assert set(ASSETS) <= set(others)
    for f in others:
        assert open(os.path.join(back, f), "rb").read() == open(os.path.join(src, f), "rb").read(), f
    with OrbaxCheckpoint(orbax_dir) as ck:
        meta = ck.ckptbridge_metadata
    assert meta["family"] == case.family and meta["key_prefix"] == case.prefix
    assert meta["hf_config"] == json.load(open(os.path.join(src, "config.json")))
    assert meta["format_version"] == 1 and meta["kind"] == "weights"
    assert sum(t["tensors"] for k, t in meta.get("towers", {}).items() if k != "spelling") == len(towers)
    assert tree_hash(src) == checkpoints.hashes[name]


def _tunix_loader(case, src, tcfg):
    """The model Tunix's own safetensors loader builds from ``src``."""
    import importlib

    return importlib.import_module(case.tunix_loader).create_model_from_safe_tensors(src, tcfg)


@pytest.mark.parametrize("name", rows("tunix_tree"))
def test_tree_equals_tunix_loader(checkpoints, name):
    """Our map gives exactly the parameters Tunix's own loader builds from the same HF files, and so
    does the Tunix model we build from them (this fails if Tunix changes its layout); where Tunix's
    loader cannot load the row, it fails as the row says."""
    from ckptbridge.tunix_model import load_tunix_model, tunix_model_config

    case, src = CASES[name], checkpoints[name]
    with open_hf_source(src, skip_multimodal=True) as source:
        tcfg = tunix_model_config(source.cfg, param_dtype=np.float32)
        if case.loader_fails:
            with pytest.raises(Exception, match=case.loader_fails):
                _tunix_loader(case, src, tcfg)
            return
        theirs = {path: np.asarray(leaf) for path, leaf in flat_state(_tunix_loader(case, src, tcfg)).items()}
        ours = {e.tunix_path: source.tunix_value(e) for e in source.entries}
    assert set(ours) == set(theirs)
    for path, value in ours.items():
        assert value.shape == theirs[path].shape and np.array_equal(value, theirs[path]), path
    model, _ = load_tunix_model(src, param_dtype=np.float32, skip_multimodal=True)
    built = flat_state(model)
    assert set(built) == set(theirs)
    for path, value in built.items():
        np.testing.assert_array_equal(np.asarray(value), theirs[path], err_msg=str(path))


def _tunix_from_restored_tree(tree: dict, source):
    """The family's Tunix model with the parameters of a plain-Orbax-restored tree put in by hand
    (every parameter the model has must be in the tree, shaped as the model wants it): with the
    towers where Tunix's model holds them; a subtree of towers it does not hold (``towers/``) is
    what the model does not read."""
    import jax
    from flax import nnx

    from ckptbridge.specs.base import BESIDE
    from ckptbridge.tunix_model import tunix_model_class, tunix_model_config

    cls = tunix_model_class(source.spec)
    held = bool(source.tower_entries) and all(source.spec.tower(t).tunix for t in source.cfg.towers)
    tcfg = tunix_model_config(source.cfg, towers=held)
    tree = {k: v for k, v in tree.items() if k != BESIDE}
    graphdef, state = nnx.split(nnx.eval_shape(lambda: cls(tcfg, rngs=nnx.Rngs(params=0))))
    pure = state.to_pure_dict()

    def fill(dst, src, where=()):
        assert {str(k) for k in dst} == set(src), where
        for key in dst:
            value = src[str(key)]
            if isinstance(dst[key], dict):
                fill(dst[key], value, where + (str(key),))
            else:
                assert tuple(dst[key].shape) == tuple(value.shape), where + (str(key),)
                dst[key] = jax.numpy.asarray(np.asarray(value, dtype=np.float32))

    fill(pure, tree)
    return nnx.merge(graphdef, pure)


@pytest.mark.slow
@pytest.mark.parametrize("name", rows("logits"))
def test_orbax_tree_gives_transformers_logits(checkpoints, converted, precise, name):
    """``verify logits`` on the Orbax checkpoint agrees with transformers (float32). The Orbax tree,
    restored with plain Orbax, is the Tunix state: every parameter as the map gives it, in the
    source dtype (bfloat16 stays bfloat16); put by hand into the family's Tunix model it gives
    transformers' logits too."""
    from ckptbridge.verify import hf_logits

    src = checkpoints[name]
    orbax_dir, _ = converted[name]
    r = logits_parity(src, orbax_dir)
    assert r.rel_l2 <= 1e-5 and r.argmax_agreement == 1.0, r
    if r.sliding_window:
        assert r.tokens[1] > 2 * r.sliding_window
    tree = _restore(orbax_dir)
    with open_hf_source(src, keep_towers=True) as source:
        leaves = 0
        for e in source.all_entries:
            got, want = np.asarray(_leaf(tree, e.tunix_path)), source.tunix_value(e)
            assert got.dtype == want.dtype == source.dtype(e), e.tunix_path
            assert got.shape == want.shape and got.tobytes() == want.tobytes(), e.tunix_path
            leaves += 1
        import jax

        assert len(jax.tree_util.tree_leaves(tree)) == leaves
        model = _tunix_from_restored_tree(tree, source)
    # other tokens of the shape verify used (a Tunix forward of a new shape compiles anew)
    tokens = np.random.default_rng(7).integers(3, source.cfg.vocab_size, size=tuple(r.tokens))
    ours, ref = tunix_logits(model, tokens), hf_logits(src, tokens)
    rel = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
    assert rel <= 1e-5, rel
    assert np.array_equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("name", rows("logits"))
def test_head_on_kept_hidden_states_gives_the_forward_logits(checkpoints, name):
    """The family's Tunix model, its last norm kept (what the training loss in chunks reads), and
    the spec's output head on those hidden states give the logits of its own forward, bit for bit:
    fails where a Tunix release computes its head otherwise or calls its norm other than once."""
    import jax.numpy as jnp

    from ckptbridge.tunix_model import forward, head, hidden_states, keep_hidden_states, load_tunix_model

    model, _ = load_tunix_model(checkpoints[name], param_dtype=np.float32, skip_multimodal=True)
    tokens = jnp.asarray(TOKENS, jnp.int32)
    b, t = tokens.shape
    positions, mask = jnp.tile(jnp.arange(t)[None], (b, 1)), jnp.tril(jnp.ones((b, t, t), bool))
    want = np.asarray(forward(model, tokens, positions, mask))
    keep_hidden_states(model)
    h = hidden_states(model, tokens, positions, mask)
    assert h.shape[:2] == (b, t) and h.shape[2] != want.shape[2]
    got = np.asarray(head(model, h))
    assert got.dtype == want.dtype and np.array_equal(got, want)
    assert np.array_equal(np.asarray(forward(model, tokens, positions, mask)), want)  # the model is unchanged


@pytest.mark.slow
@pytest.mark.parametrize("name", rows("hf_logits"))
def test_verify_logits_from_hf_directory(checkpoints, name):
    """``verify logits`` with the HF directory alone: Tunix built from the HF files."""
    r = logits_parity(checkpoints[name], seq_len=11)
    assert r.rel_l2 <= 1e-5 and r.argmax_agreement == 1.0, r
    assert r.tokens == [2, 11] and (r.sliding_window is None or 11 > r.sliding_window)


@pytest.mark.parametrize("name", rows("inspect"))
def test_inspect(checkpoints, name):
    r = run_cli("inspect", checkpoints[name], "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["family"] == CASES[name].family and info["valid"] is True
    assert info["key_prefix"] == CASES[name].prefix


@pytest.mark.parametrize("name", rows("bad_inputs"))
def test_bad_inputs(checkpoints, tmp_path, name):
    """A tensor missing, a tensor too many, one tensor under another prefix of the family: each
    named in the error, nothing written; of a multimodal checkpoint's towers too (a tensor missing,
    one of another shape)."""
    from ckptbridge.specs import get_family

    case, src = CASES[name], checkpoints[name]
    skip = {"skip_multimodal": True} if case.multimodal else {}
    with open_hf_source(src, skip_multimodal=True) as source:
        keys = sorted(k for e in source.entries for k in e.hf_keys)
        layer_key = next(k for k in keys if k.startswith(f"{case.prefix}layers.1."))
    missing = rewrite_checkpoint(src, tmp_path / "missing", drop=keys[-1])
    with pytest.raises(MismatchError, match=f"'{re.escape(keys[-1])}' is missing"):
        convert_safetensors_to_orbax(missing, str(tmp_path / "o1"), progress=False, **skip)
    extra_key = f"{case.prefix}layers.0.self_attn.q_proj.extra"
    extra = rewrite_checkpoint(src, tmp_path / "extra", add=extra_key)
    with pytest.raises(MismatchError, match=f"unexpected tensor '{re.escape(extra_key)}'"):
        convert_safetensors_to_orbax(extra, str(tmp_path / "o2"), progress=False, **skip)
    written = ["o1", "o2"]
    others = [p for p in get_family(case.family).key_prefixes if p != case.prefix]
    for i, other in enumerate(others):  # a prefix mix-up
        moved = other + layer_key[len(case.prefix):]
        mixed = rewrite_checkpoint(src, tmp_path / f"mixed{i}", rename=(layer_key, moved))
        with pytest.raises(MismatchError, match=f"unexpected tensor '{re.escape(moved)}'"):
            convert_safetensors_to_orbax(mixed, str(tmp_path / f"m{i}"), progress=False, **skip)
        written.append(f"m{i}")
    if case.multimodal:
        with open_hf_source(src, keep_towers=True) as source:
            tower_key, tower = source.tower_entries[-1].hf_keys[0], source.tower_entries[-1].tower
        gone = rewrite_checkpoint(src, tmp_path / "gone", drop=tower_key)
        with pytest.raises(MismatchError, match=f"'{re.escape(tower_key)}' of the {tower} tower is missing"):
            convert_safetensors_to_orbax(gone, str(tmp_path / "o3"), progress=False)
        wrong = rewrite_checkpoint(src, tmp_path / "wrong", reshape=(tower_key, (3, 5)))
        with pytest.raises(MismatchError, match=rf"'{re.escape(tower_key)}' has shape \(3, 5\), config.json "
                                                rf"\({tower}_config\) implies"):
            convert_safetensors_to_orbax(wrong, str(tmp_path / "o4"), progress=False)
        written += ["o3", "o4"]
    for out in written:
        assert not os.path.exists(tmp_path / out), out


# ----------------------------------------------------------------- independent of the family, one row


def test_sharded_output_with_index(checkpoints, converted, tmp_path):
    src = checkpoints["keqv_lm_f32_sharded"]
    orbax_dir, _ = converted["keqv_lm_f32_sharded"]
    back = str(tmp_path / "back")
    r = convert_orbax_to_safetensors(orbax_dir, back, max_shard_size="100KB", progress=False)
    shards = [f for f in r.files if f.endswith(".safetensors")]
    assert len(shards) > 2
    index = json.load(open(os.path.join(back, "model.safetensors.index.json")))
    assert set(index["weight_map"].values()) == set(shards)
    sizes = [os.path.getsize(os.path.join(back, s)) for s in shards]
    assert max(sizes) < 100_000 + 4096  # header slack
    assert compare_tensors(src, back).identical


def test_tunix_tree_without_metadata_needs_config(checkpoints, tmp_path):
    """A tree written by Tunix itself (nnx state with 'value' leaves, no ckptbridge metadata)."""
    import orbax.checkpoint as ocp

    src = checkpoints["kv_lm_bf16_sharded"]
    flat = {}
    with open_hf_source(src) as source:
        for e in source.entries:
            flat[e.tunix_path + ("value",)] = np.array(source.tunix_value(e))
    tree = nest(flat)
    ckpt = os.path.abspath(str(tmp_path / "tunix_tree"))
    ocp.PyTreeCheckpointer().save(ckpt, tree)
    with pytest.raises(ConfigError, match="--config"):
        convert_orbax_to_safetensors(ckpt, str(tmp_path / "x"), progress=False)
    assert not os.path.exists(tmp_path / "x")
    back = str(tmp_path / "back")
    convert_orbax_to_safetensors(ckpt, back, config=src, progress=False)
    assert compare_tensors(src, back).identical


def test_checkpoint_manager_layout_is_found(checkpoints, tmp_path):
    src = checkpoints["keqv_text_bf16_single"]
    root = tmp_path / "run"
    (root / "100").mkdir(parents=True)
    convert_safetensors_to_orbax(src, str(root / "100" / "model_params"), progress=False)
    back = str(tmp_path / "back")
    convert_orbax_to_safetensors(str(root), back, progress=False)
    assert compare_tensors(src, back).identical
