"""Model cards: exported adapters and merged models carry a README.md whose front matter the Hub
reads (huggingface_hub's own parser), naming the base by its Hub id (given, or found from a Hub
cache path or config.json), so `hf upload` needs nothing else."""

import json
import os
import shutil

import pytest
from huggingface_hub import ModelCard

from ckptbridge import convert_orbax_to_peft, convert_peft_to_orbax
from ckptbridge import merge_lora
from ckptbridge.model_card import hub_id, is_repo_id
from ckptbridge.testing import build_peft_adapter

from conftest import run_cli


@pytest.fixture(scope="module")
def made(checkpoints, tmp_path_factory):
    """A base inside a Hub cache layout, a PEFT adapter and the Tunix LoRA checkpoint made from it."""
    root = tmp_path_factory.mktemp("cards")
    snapshot = root / "hub" / "models--acme--tiny-gemma" / "snapshots" / "0123abcd"
    shutil.copytree(checkpoints["kv_text_f32_sharded"], snapshot)
    with open(snapshot / "generation_config.json", "w") as f:
        json.dump({"do_sample": True, "top_k": 64}, f)
    peft_dir = build_peft_adapter(str(snapshot), str(root / "peft"), r=4, lora_alpha=8, seed=2)
    convert_peft_to_orbax(peft_dir, str(root / "tunix"), base=str(snapshot), step=120, progress=False)
    return {"base": str(snapshot), "local": checkpoints["kv_text_f32_sharded"], "peft": peft_dir,
            "tunix": str(root / "tunix")}


def _card(path):
    card = ModelCard.load(os.path.join(path, "README.md"))
    return card.data.to_dict(), card.text


def test_adapter_card_names_the_base_from_the_hub_cache(made, tmp_path):
    dst = str(tmp_path / "adapter")
    convert_orbax_to_peft(made["tunix"], dst, base=made["base"], target="vllm", progress=False)
    data, text = _card(dst)
    assert data["base_model"] == "acme/tiny-gemma" and data["library_name"] == "peft"
    assert {"lora", "base_model:adapter:acme/tiny-gemma", "transformers"} <= set(data["tags"])
    assert data["pipeline_tag"] == "text-generation"
    # rank 8: PEFT k/v (rank 4 each) became one kv_einsum of rank 8, padded to one rank for vLLM
    assert "step 120" in text and "| rank | 8 |" in text and "vLLM" in text and "ckptbridge" in text
    assert json.load(open(os.path.join(dst, "adapter_config.json")))["base_model_name_or_path"] == "acme/tiny-gemma"


def test_adapter_card_for_a_local_base(made, tmp_path):
    """No Hub id to be found: no base_model in the front matter (the Hub would reject a path), the
    local path in the text and the adapter config, or the id given with --base-id."""
    dst = str(tmp_path / "adapter")
    convert_orbax_to_peft(made["tunix"], dst, base=made["local"], progress=False)
    data, text = _card(dst)
    assert "base_model" not in data and data["library_name"] == "peft" and made["local"] in text
    cli = run_cli("convert", "orbax-to-peft", made["tunix"], str(tmp_path / "named"), "--base", made["local"],
                  "--base-id", "google/gemma-4-31b-it", "--quiet")
    assert cli.returncode == 0, cli.stderr
    assert _card(str(tmp_path / "named"))[0]["base_model"] == "google/gemma-4-31b-it"
    bad = run_cli("convert", "orbax-to-peft", made["tunix"], str(tmp_path / "bad"), "--base", made["local"],
                  "--base-id", "not a/valid/id")
    assert bad.returncode != 0 and "base_id" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert not os.path.exists(str(tmp_path / "bad"))


@pytest.mark.parametrize("adapter", ["peft", "tunix"])
def test_merged_card_and_generation_config(made, tmp_path, adapter):
    dst = str(tmp_path / "merged")
    merge_lora(made["base"], made[adapter], dst, progress=False)
    data, text = _card(dst)
    assert data["base_model"] == ["acme/tiny-gemma"] and data["base_model_relation"] == "merge"
    assert data["library_name"] == "transformers" and "merge" in data["tags"]
    assert os.path.abspath(made[adapter]) in text
    assert json.load(open(os.path.join(dst, "generation_config.json"))) == {"do_sample": True, "top_k": 64}


def test_hub_ids():
    assert is_repo_id("google/gemma-4-31b-it") and is_repo_id("gpt2") and not is_repo_id("a/b/c")
    assert not is_repo_id("/abs/path") and not is_repo_id("org/na..me") and not is_repo_id("org/name-")
    assert hub_id("/x/hub/models--Qwen--Qwen3-8B/snapshots/abc/") == "Qwen/Qwen3-8B"
    assert hub_id("/nowhere", "given/id") == "given/id" and hub_id("/nowhere") is None
