"""A multimodal checkpoint's towers, proven by their own outputs.

The round trips of the towers through every format are the format matrix's multimodal rows
(tests/test_matrix.py) and the contract's (tests/test_contract.py); here is what only the towers
have:

- Gemma 3's SigLIP tower lands where Tunix's own safetensors mapping puts it (paths, shapes,
  values; its loader's one bug, the position table's missing reshape, is the one difference and
  makes the loader fail), and Tunix's vision encoder and projector, run on our Orbax checkpoint,
  give transformers' image features; a prompt with an image gives transformers' logits.
- A checkpoint written with the Hub's names of the tower (``vision_tower.vision_model.``) goes
  through Tunix and back under those names, bit for bit.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from ckptbridge import convert
from ckptbridge.formats.hf import open_hf_source
from ckptbridge.formats.tunix import open_orbax_source
from ckptbridge.verify import compare_tensors

G3 = "gemma3_mm"  # float32, Gemma3ForConditionalGeneration as transformers saves it (language_model.model.)


def hub_spelled(src: str, dst: str) -> str:
    """A copy of a Gemma 3 checkpoint with the tower's keys as the Hub holds them (``vision_tower.vision_model.``)."""
    import ml_dtypes  # noqa: F401  (numpy knows bfloat16)
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    for name in os.listdir(dst):
        if name.endswith(".safetensors"):
            t = load_file(os.path.join(dst, name))
            t = {("vision_tower.vision_model." + k[len("vision_tower."):] if k.startswith("vision_tower.")
                  and not k.startswith("vision_tower.vision_model.") else k): v for k, v in t.items()}
            save_file(t, os.path.join(dst, name), metadata={"format": "pt"})
    index = os.path.join(dst, "model.safetensors.index.json")
    assert not os.path.exists(index)
    return dst


@pytest.fixture(scope="module")
def g3(checkpoints, tmp_path_factory):
    """The Gemma 3 row in the Hub's names, and its Tunix checkpoint."""
    root = tmp_path_factory.mktemp("towers")
    hub = hub_spelled(checkpoints[G3], str(root / "hub"))
    convert(hub, str(root / "tunix"), to="tunix", progress=False)
    return hub, str(root / "tunix")


def test_gemma3_tower_lands_where_tunix_maps_it(g3):
    """Every tower tensor at the Tunix path Tunix's own mapping gives its HF key, with the values
    its permutation gives; the position table is the one reshaped (its (t, w) to Tunix's (1, t, w),
    which Tunix's mapping leaves out, so that its loader stops there)."""
    from tunix.models.gemma3 import params_safetensors
    from tunix.utils.torch_utils import torch_key_to_jax_key

    from ckptbridge.tunix_model import tunix_model_config

    hub, tunix = g3
    with open_hf_source(hub, keep_towers=True) as source, open_orbax_source(tunix) as stored:
        assert source.tower_spelling == {} and len(source.tower_entries) == 39
        tcfg = tunix_model_config(source.cfg, towers=True)
        mapping = params_safetensors._get_key_and_transform_mapping(tcfg)
        ours = {e.tunix_path: np.asarray(stored.leaf(e)) for e in stored.tower_entries}
        reshaped = []
        for e in source.tower_entries:
            (key,) = e.hf_keys
            path, transform = torch_key_to_jax_key(mapping, key)
            theirs = source.model.array(key)
            if transform is not None:
                permute, reshape = transform
                theirs = theirs.transpose(permute) if permute else theirs
                theirs = theirs.reshape(reshape) if reshape else theirs
            got = ours[tuple(path.split("."))]
            if got.shape != theirs.shape:
                reshaped.append(path)
                theirs = theirs.reshape(got.shape)
            assert got.dtype == theirs.dtype and np.array_equal(got, theirs), path
    assert reshaped == ["vision_encoder.siglip_encoder.pos_embedding"]
    with pytest.raises(AssertionError, match="pos_embedding.*expected \\(1, 16, 24\\), got \\(16, 24\\)"):
        params_safetensors.create_model_from_safe_tensors(hub, tcfg)


def test_hub_names_round_trip(g3, tmp_path):
    hub, tunix = g3
    back = str(tmp_path / "back")
    convert(tunix, back, to="hf", progress=False)
    assert compare_tensors(hub, back).identical


def _tunix_gemma3(tunix: str):
    """Tunix's Gemma 3 with its vision encoder, every parameter from the Orbax checkpoint restored
    with plain Orbax (no ckptbridge reader in between)."""
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx

    from ckptbridge.tunix_model import tunix_model_class, tunix_model_config

    with open_orbax_source(tunix) as s:
        tcfg, cls = tunix_model_config(s.cfg, towers=True), tunix_model_class(s.spec)
    tree = ocp.PyTreeCheckpointer().restore(os.path.abspath(tunix))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: cls(tcfg, rngs=nnx.Rngs(params=0))))
    pure = state.to_pure_dict()

    def fill(dst, src, where=()):
        assert {str(k) for k in dst} == set(src), where
        for key in dst:
            if isinstance(dst[key], dict):
                fill(dst[key], src[str(key)], where + (str(key),))
            else:
                assert tuple(dst[key].shape) == tuple(src[str(key)].shape), where + (str(key),)
                dst[key] = jax.numpy.asarray(src[str(key)])

    fill(pure, tree)
    return nnx.merge(graphdef, pure)


@pytest.mark.slow
def test_gemma3_tunix_sees_as_transformers(g3, precise):
    """Tunix's vision encoder + projector on our checkpoint give transformers' image features
    within 1e-5 (relative L2), and a prompt with an image in it (bidirectional over the image's
    soft tokens in both) transformers' logits within 5e-5, longer than the sliding window."""
    import jax.numpy as jnp
    import torch
    import transformers

    hub, tunix = g3
    model = _tunix_gemma3(tunix)
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(hub, dtype=torch.float32).eval()
    c = hf.config
    pixels = np.random.default_rng(3).standard_normal((2, 3, c.vision_config.image_size,
                                                        c.vision_config.image_size)).astype(np.float32)
    with torch.no_grad():
        want = hf.get_image_features(torch.tensor(pixels), return_dict=True).pooler_output.numpy()
    images = jnp.asarray(pixels.transpose(0, 2, 3, 1))[:, None]  # b n h w c
    got = np.asarray(model._encode_vision(images)).reshape(want.shape)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 1e-5

    image = [c.boi_token_id] + [c.image_token_id] * c.mm_tokens_per_image + [c.eoi_token_id]
    tokens = np.array([[2, 10, 11, *image, 20, 21, 22, 23, 24], [2, 30, *image, 40, 41, 42, 43, 44, 45]])
    assert tokens.shape[1] > 2 * c.text_config.sliding_window
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(tokens), pixel_values=torch.tensor(pixels),
                  token_type_ids=torch.tensor((tokens == c.image_token_id).astype(np.int64))).logits.numpy()
    positions = jnp.tile(jnp.arange(tokens.shape[1])[None], (len(tokens), 1))
    got, _ = model(jnp.asarray(tokens), positions, None, model.get_attention_mask(jnp.asarray(tokens)), images=images)
    got = np.asarray(got)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 5e-5
    assert np.array_equal(got.argmax(-1), want.argmax(-1))


def _eyes_and_ears(model_dir: str) -> tuple[np.ndarray, np.ndarray]:
    """A Gemma 4's image features (a 4 x 4 grid of patches) and audio features (32 frames), as
    transformers computes them from the files in ``model_dir`` (float32)."""
    import torch
    import transformers

    m = transformers.Gemma4ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    vc, ac = m.config.vision_config, m.config.audio_config
    g = torch.Generator().manual_seed(4)
    positions = torch.tensor([[(x, y) for y in range(4) for x in range(4)]])
    pixels = torch.randn(1, 16, 3 * vc.patch_size ** 2, generator=g)
    frames = torch.randn(1, 32, ac.subsampling_conv_channels[0], generator=g)
    with torch.no_grad():
        image = m.get_image_features(pixels, positions).pooler_output.numpy()
        audio = m.model.get_audio_features(frames, torch.ones(1, 32, dtype=torch.bool)).pooler_output.numpy()
    return image, audio


@pytest.mark.slow
def test_training_on_a_multimodal_base_keeps_its_towers(checkpoints, tmp_path):
    """A text LoRA trained (the tiny preset) on a Gemma 4 E2B-shaped base with vision and audio
    towers, merged into Tunix's checkpoint of the base (its towers under towers/) and exported: a
    Gemma4ForConditionalGeneration whose image and audio features are the base's, bit for bit,
    and whose text model is the base's plus the adapter."""
    import json
    import subprocess
    import sys

    from training.cli import SAMPLE_DATA

    from ckptbridge.formats.hf import open_hf_source

    base = checkpoints["gemma4_e2b_mm"]
    tunix, run, merged = str(tmp_path / "tunix"), str(tmp_path / "run"), str(tmp_path / "merged")
    convert(base, tunix, to="tunix", progress=False)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "training", "--preset", "tiny-cpu", "--quiet", "--base", base,
                           "--data", SAMPLE_DATA, "--out", run, "--max-steps", "2", "max_length=256", "grad_accum=1",
                           "learning_rate=5e-2"], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["steps"] == 2
    r = convert(tunix, merged, to="hf", adapter=os.path.join(run, "checkpoints"), progress=False)
    assert r.merged_tensors > 0
    cmp = compare_tensors(base, merged)
    with open_hf_source(base, keep_towers=True) as source:
        towers = {k for e in source.tower_entries for k in e.hf_keys}
        text = {k for e in source.entries for k in e.hf_keys}
    assert cmp.only_in_a == [] and cmp.only_in_b == [] and cmp.differing and set(cmp.differing) <= text
    assert not towers & set(cmp.differing) and len(towers) == 219
    readme = open(os.path.join(merged, "README.md")).read()
    assert "image-text-to-text" in readme and "vision (87 tensors), audio (132 tensors)" in readme
    for got, want in zip(_eyes_and_ears(merged), _eyes_and_ears(base)):
        assert got.shape == want.shape and np.array_equal(got, want)


def test_adapter_verbs_on_a_multimodal_base(adapters, tmp_path):
    """A PEFT adapter (made by PEFT) on the text modules of a Gemma 4 with its vision tower: verify
    adapter passes all three checks, and combine (``cat``) gives the sum of its deltas with itself
    (the conversions both ways and the merge are the contract's ``lora`` check on the same row)."""
    from ckptbridge.adapter import combine
    from ckptbridge.adapter_check import verify_adapter

    a = adapters["gemma4_mm"]
    report = verify_adapter(a.peft, a.base)
    assert report.ok and report.live is not None and report.exact is not None, report.summary()
    assert report.exact["rel_l2"] <= 1e-5, report.summary()
    doubled = str(tmp_path / "doubled")
    combine([a.peft, a.peft], doubled, method="cat", base=a.base, progress=False)
    from test_matrix import _deltas

    want, got = _deltas(a.peft, a.base), _deltas(doubled, a.base)
    assert set(got) == set(want) and all(k.startswith("model.language_model.") for k in got)
    for key in want:
        np.testing.assert_allclose(got[key], 2 * want[key], rtol=1e-5, atol=1e-7)


def test_towers_a_format_cannot_hold_are_refused_in_one_line(checkpoints, tmp_path):
    """A tower a destination has no place for (MaxText's E2B-shaped Gemma 4 has none), a projector
    file without the image normalization it records (no processor config), a projector file that
    is not one: each one line, its exit code, nothing written; with --skip-multimodal the text
    model converts."""
    from conftest import run_cli, tree_hash
    from test_errors import check_failure

    e2b = checkpoints["gemma4_e2b_mm"]
    before, dst = tree_hash(e2b), str(tmp_path / "mt")
    check_failure(run_cli("convert", e2b, dst, "--to", "maxtext"), 5, "MaxText's gemma4 has no audio tower",
                  "has vision and audio towers", "--skip-multimodal", src=e2b, before=before, dst=dst)
    proc = run_cli("convert", e2b, dst, "--to", "maxtext", "--skip-multimodal", "--quiet")
    assert proc.returncode == 0 and "\n  towers:" not in proc.stdout, proc.stderr
    assert "dropped 219 vision/audio tensors (--skip-multimodal)" in proc.stdout
    bare = str(tmp_path / "bare")
    shutil.copytree(checkpoints[G3], bare, ignore=shutil.ignore_patterns("processor_config.json"))
    out = str(tmp_path / "m.gguf")
    check_failure(run_cli("convert", bare, out), 8, "image_mean", "processor config", dst=out)
    assert not os.path.exists(tmp_path / "mmproj-m.gguf")
    text = str(tmp_path / "text.gguf")
    assert run_cli("convert", checkpoints[G3], text, "--skip-multimodal", "--quiet").returncode == 0
    assert not os.path.exists(tmp_path / "mmproj-text.gguf")
    check_failure(run_cli("convert", text, str(tmp_path / "back"), "--to", "hf", "--config", checkpoints[G3],
                          "--mmproj", text), 6, "not a projector file", dst=str(tmp_path / "back"))
