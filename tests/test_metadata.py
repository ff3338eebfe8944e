"""The record stored with every output: one typed dataclass, read back as written."""

from ckptbridge.metadata import FORMAT_VERSION, LoraRules, Metadata


def test_round_trip():
    m = Metadata(kind="lora", family="qwen3", lora=LoraRules([{"module_path": ".*q_proj", "rank": 4, "alpha": 8}], 0.05),
                 base="/b", key_prefix="model.", step=3, tokens_seen=120, data_state={"pos": [1, 2]})
    stored = m.to_json()
    assert stored["format_version"] == FORMAT_VERSION and "hf_config" not in stored  # None fields left out
    assert Metadata.from_json(stored) == m
    assert Metadata.from_json(__import__("json").dumps(stored)) == m  # the PEFT header stores it as a string


def test_tolerant_reading():
    m = Metadata.from_json({"kind": 3, "family": "gemma4", "lora": {"rules": "x"}, "step": True, "future": 1})
    assert (m.kind, m.family, m.lora, m.step) == (None, "gemma4", None, None)  # wrong types read as absent
    assert m.other == {"future": 1} and m.to_json()["future"] == 1  # unknown fields kept
    assert Metadata.from_json(None).to_json() == {} and Metadata.from_json("not json").to_json() == {}


def test_orbax_outputs_record_the_tunix_version(tmp_path):
    """Layouts and computations differ between Tunix versions: an Orbax checkpoint says which one
    was installed where it was written."""
    from importlib.metadata import version

    from ckptbridge import convert_safetensors_to_orbax
    from ckptbridge.io.orbax import OrbaxCheckpoint
    from ckptbridge.testing import build_checkpoint

    src = build_checkpoint(str(tmp_path / "hf"), family="qwen3", tokenizer=False)
    convert_safetensors_to_orbax(src, str(tmp_path / "orbax"), progress=False)
    with OrbaxCheckpoint(str(tmp_path / "orbax")) as ckpt:
        assert ckpt.metadata.tunix_version == version("google-tunix")
