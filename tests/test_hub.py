"""Hub ids (ORG/NAME[@REV], --revision) wherever a model or adapter directory is accepted, resolved
offline (HF_HUB_OFFLINE=1) from a Hugging Face cache the test fills in the Hub's own layout
(blobs, snapshots, refs): the same outputs as from the local directories, model cards naming the
ids, one line when an id is not there."""

import json
import os

import pytest
from huggingface_hub import ModelCard
from safetensors.numpy import load_file

from ckptbridge import convert_peft_to_orbax
from ckptbridge.io.hf import INDEX_NAME
from ckptbridge.testing import build_peft_adapter, fill_hub_cache
from ckptbridge.verify import compare_tensors

from conftest import run_cli


@pytest.fixture(scope="module")
def hub(checkpoints, tmp_path_factory):
    import shutil

    root = tmp_path_factory.mktemp("hub")
    base = str(root / "base")
    shutil.copytree(checkpoints["kv_text_f32_sharded"], base)  # sharded: the index names the keys
    with open(os.path.join(base, "generation_config.json"), "w") as f:
        json.dump({"top_k": 64}, f)
    peft_dir = build_peft_adapter(base, str(root / "peft"), r=4, lora_alpha=8, seed=3)
    tunix = str(root / "tunix")
    convert_peft_to_orbax(peft_dir, tunix, base=base, step=7, progress=False)
    cache = str(root / "cache")
    fill_hub_cache(cache, "acme/tiny-gemma", base)
    fill_hub_cache(cache, "acme/tiny-gemma", base, revision="v1", commit="1" * 40)
    fill_hub_cache(cache, "acme/tiny-lora", peft_dir)
    only_config = str(root / "only-config")  # what `hf download --include config.json *.index.json` leaves
    os.makedirs(only_config)
    for name in ("config.json", INDEX_NAME):
        with open(os.path.join(base, name)) as src, open(os.path.join(only_config, name), "w") as dst:
            dst.write(src.read())
    fill_hub_cache(cache, "acme/config-only", only_config)
    return {"cache": cache, "base": base, "peft": peft_dir, "tunix": tunix}


@pytest.fixture
def offline(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", hub["cache"])
    return hub


def _tensors(path):
    return load_file(os.path.join(path, "adapter_model.safetensors"))


def test_orbax_to_peft_with_a_hub_base(offline, tmp_path):
    """The base's config and index alone: weights are neither read nor needed in the cache."""
    local, by_id = str(tmp_path / "local"), str(tmp_path / "by-id")
    assert run_cli("convert", "orbax-to-peft", offline["tunix"], local, "--base", offline["base"], "--quiet").returncode == 0
    cli = run_cli("convert", "orbax-to-peft", offline["tunix"], by_id, "--base", "acme/config-only", "--quiet")
    assert cli.returncode == 0, cli.stderr
    a, b = _tensors(local), _tensors(by_id)
    assert set(a) == set(b) and all(a[k].tobytes() == b[k].tobytes() for k in a)
    card = ModelCard.load(os.path.join(by_id, "README.md")).data.to_dict()
    assert card["base_model"] == "acme/config-only"
    assert json.load(open(os.path.join(by_id, "adapter_config.json")))["base_model_name_or_path"] == "acme/config-only"


def test_merge_ids_and_revisions(offline, tmp_path):
    local = str(tmp_path / "local")
    assert run_cli("merge", offline["base"], offline["peft"], local, "--quiet").returncode == 0
    for args in (("acme/tiny-gemma", "acme/tiny-lora"), ("acme/tiny-gemma", "acme/tiny-lora", "--revision", "v1"),
                 ("acme/tiny-gemma@v1", "acme/tiny-lora@main")):
        dst = str(tmp_path / "merged")
        cli = run_cli("merge", *args, dst, "--quiet", "--overwrite")
        assert cli.returncode == 0, (args, cli.stderr)
        assert compare_tensors(local, dst).identical, args
        assert json.load(open(os.path.join(dst, "generation_config.json"))) == {"top_k": 64}
        card = ModelCard.load(os.path.join(dst, "README.md"))
        assert card.data.to_dict()["base_model"] == ["acme/tiny-gemma"] and "acme/tiny-lora" in card.text


def test_peft_to_orbax_and_s2o_with_ids(offline, tmp_path):
    cli = run_cli("convert", "peft-to-orbax", "acme/tiny-lora", str(tmp_path / "lora"), "--base", "acme/config-only",
                  "--quiet")
    assert cli.returncode == 0, cli.stderr
    cli = run_cli("convert", "safetensors-to-orbax", "acme/tiny-gemma", str(tmp_path / "orbax"), "--quiet")
    assert cli.returncode == 0, cli.stderr
    back = run_cli("convert", "orbax-to-safetensors", str(tmp_path / "orbax"), str(tmp_path / "back"), "--quiet")
    assert back.returncode == 0 and compare_tensors(offline["base"], str(tmp_path / "back")).identical
    same = run_cli("verify", "tensors", "acme/tiny-gemma@v1", str(tmp_path / "back"))
    assert same.returncode == 0 and "identical" in same.stdout, same.stderr
    info = run_cli("inspect", "acme/tiny-gemma", "--json")
    assert info.returncode == 0 and '"family": "gemma4"' in info.stdout, info.stderr


@pytest.mark.parametrize("argv, message", [
    (("merge", "acme/not-there", "acme/tiny-lora"), "acme/not-there: not in the Hugging Face cache"),
    (("merge", "acme/tiny-gemma", "acme/tiny-lora", "--revision", "v9"), "acme/tiny-gemma@v9: not in the"),
    (("merge", "acme/tiny-gemma", "acme/tiny-lora@v9"), "acme/tiny-lora@v9: not in the"),
])
def test_missing_ids_say_so_in_one_line(offline, tmp_path, argv, message):
    dst = str(tmp_path / "merged")
    cli = run_cli(*argv, dst)
    assert cli.returncode == 3 and message in cli.stderr and "hf download" in cli.stderr, cli.stderr
    assert len(cli.stderr.strip().splitlines()) == 1 and not os.path.exists(dst)
