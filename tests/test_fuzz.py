"""Property tests: every file reader turns arbitrary bytes into our error type (or a valid
result), never another exception, a hang or a huge allocation."""

import json
import os
import struct
import tempfile

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptbridge.errors import CkptBridgeError

FAST = settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.too_slow])


def write(data: bytes, name: str) -> str:
    d = tempfile.mkdtemp(prefix="fuzz-")
    path = os.path.join(d, name)
    with open(path, "wb") as f:
        f.write(data)
    return path


def safetensors_bytes(header: object, data: bytes, length_delta: int = 0) -> bytes:
    hb = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", max(0, len(hb) + length_delta)) + hb + data


def read_all_safetensors(path: str) -> None:
    from ckptbridge.io.safetensors import SafetensorsFile

    with SafetensorsFile(path) as f:
        for key in f.keys():
            arr = np.asarray(f.array(key))
            assert arr.nbytes <= os.path.getsize(path)


def expect_ours(fn, *args) -> None:
    try:
        fn(*args)
    except CkptBridgeError:
        pass


@FAST
@given(st.binary(max_size=512))
def test_safetensors_reader_on_random_bytes(data):
    expect_ours(read_all_safetensors, write(data, "x.safetensors"))


dtypes = st.sampled_from(["F32", "F16", "BF16", "I64", "I32", "U8", "BOOL", "F64", "Q7", "", 3])
entry = st.fixed_dictionaries({
    "dtype": dtypes,
    "shape": st.one_of(st.lists(st.integers(-3, 2**40), max_size=4), st.just("x"), st.none()),
    "data_offsets": st.one_of(st.lists(st.integers(-5, 2**62), min_size=0, max_size=3), st.just({})),
})


@FAST
@given(st.dictionaries(st.text(max_size=8), st.one_of(entry, st.integers(), st.text(max_size=5)), max_size=4),
       st.binary(max_size=256), st.integers(-4, 4096))
def test_safetensors_reader_on_structured_headers(header, data, delta):
    """Headers that look right but lie: huge shapes, offsets past the end, negative numbers,
    header lengths that overrun; never an allocation beyond the file or a foreign exception."""
    expect_ours(read_all_safetensors, write(safetensors_bytes(header, data, delta), "x.safetensors"))


@FAST
@given(st.binary(max_size=400))
def test_config_reader(data):
    from ckptbridge.config import read_config_file
    from ckptbridge.specs import parse_config

    def go(path):
        parse_config(read_config_file(path))

    expect_ours(go, write(data, "config.json"))


json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                                     st.text(max_size=10)),
                           lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12),
                                                                                              children, max_size=4),
                           max_leaves=20)


@FAST
@given(st.dictionaries(st.sampled_from(["model_type", "text_config", "hidden_size", "num_hidden_layers",
                                        "layer_types", "head_dim", "vocab_size", "num_attention_heads",
                                        "num_key_value_heads", "attention_k_eq_v", "sliding_window",
                                        "global_head_dim", "intermediate_size"]), json_values, max_size=10))
def test_config_parser_on_json_shaped_garbage(cfg):
    from ckptbridge.specs import parse_config

    expect_ours(parse_config, cfg)


@FAST
@given(st.binary(max_size=400))
def test_adapter_config_reader(data):
    from ckptbridge.formats.peft import AdapterConfig

    path = write(data, "adapter_config.json")
    expect_ours(AdapterConfig.read, os.path.dirname(path))


@FAST
@given(st.binary(max_size=400))
def test_index_reader(data):
    from ckptbridge.io.hf import HFModelDir

    path = write(data, "model.safetensors.index.json")
    d = os.path.dirname(path)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"model_type": "gemma4_text"}, f)
    expect_ours(lambda: HFModelDir(d).close())


@FAST
@given(st.binary(max_size=300))
def test_orbax_metadata_reader(data):
    from ckptbridge.io.orbax import OrbaxCheckpoint

    path = write(data, "_METADATA")
    with open(os.path.join(os.path.dirname(path), "_CHECKPOINT_METADATA"), "wb") as f:
        f.write(data[::-1])
    expect_ours(lambda: list(OrbaxCheckpoint(os.path.dirname(path)).leaves))


@FAST
@given(st.binary(max_size=400))
def test_eval_samples_and_training_rows_readers(data):
    from serving.evaluate import read_samples
    from training.data import read_rows

    expect_ours(read_samples, write(data, "samples.jsonl"))
    expect_ours(read_rows, write(data, "rows.jsonl"))
