"""The direct (TensorStore) reader of Orbax checkpoints against Orbax itself.

``ckptbridge.io.orbax`` opens the arrays of a checkpoint the way Orbax's handlers do, without
importing Orbax. These tests write checkpoints with Orbax in each storage variant it offers and
fail if the direct reader is not used for them or disagrees with ``PyTreeCheckpointer.restore``
in any leaf, shape, dtype or byte: an Orbax release that changes the on-disk layout shows here.
"""

import json
import os

import ml_dtypes
import numpy as np
import pytest

from ckptbridge.errors import CorruptFileError
from ckptbridge.io.orbax import OrbaxCheckpoint, nest


def tree():
    rng = np.random.default_rng(0)
    return {
        "embedder": {"input_embedding": rng.standard_normal((64, 16)).astype(ml_dtypes.bfloat16)},
        "layers": {str(i): {"attn": {"q_einsum": {"w": rng.standard_normal((4, 16, 8)).astype(np.float32)}},
                            "mlp": {"down_proj": {"kernel": {"value": rng.integers(0, 9, (32, 16)).astype(np.int8)}}}}
                   for i in range(3)},
        "final_norm": {"scale": rng.standard_normal(16).astype(np.float16)},
    }


def flat(t, prefix=()):
    out = {}
    for k, v in t.items():
        out.update(flat(v, prefix + (k,)) if isinstance(v, dict) else {prefix + (k,): v})
    return out


def orbax_restore(path):
    import orbax.checkpoint as ocp

    with ocp.PyTreeCheckpointer() as ckptr:
        return {p: np.asarray(v) for p, v in flat(ckptr.restore(path)).items()}


def save(path, t, **handler_options):
    import orbax.checkpoint as ocp

    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**handler_options)) as ckptr:
        ckptr.save(path, args=ocp.args.PyTreeSave(t), custom_metadata={"ckptbridge": {"kind": "test"}})


@pytest.mark.parametrize("options", [{}, {"use_zarr3": True}, {"use_ocdbt": False}, {"use_ocdbt": False, "use_zarr3": True}],
                         ids=["ocdbt-zarr2", "ocdbt-zarr3", "dirs-zarr2", "dirs-zarr3"])
def test_direct_reader_equals_orbax(tmp_path, options):
    path = str(tmp_path / "ckpt")
    save(path, tree(), **options)
    expect = orbax_restore(path)
    with OrbaxCheckpoint(path) as ck:
        assert ck.reader == "tensorstore"
        assert ck.custom_metadata == {"ckptbridge": {"kind": "test"}}
        assert ck.leaves == {p: (v.shape, v.dtype) for p, v in expect.items()}
        got = ck.read(list(expect))
    for p, v in expect.items():
        assert got[p].dtype == v.dtype and got[p].shape == v.shape and got[p].tobytes() == v.tobytes(), p


SAVE_SHARDED = """
import sys
import jax, ml_dtypes, numpy as np, orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("fsdp", "tp"))
x = np.arange(8 * 12, dtype=np.float32).reshape(8, 12).astype(ml_dtypes.bfloat16)
with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(sys.argv[1], {"w": {"value": jax.device_put(x, NamedSharding(mesh, PartitionSpec("fsdp", "tp")))}})
"""


def test_jax_arrays_sharded_over_devices(tmp_path):
    """Arrays saved from jax (as Tunix saves its state), sharded over 4 CPU devices (one
    zarr chunk per shard)."""
    import subprocess
    import sys

    path = str(tmp_path / "jax")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", SAVE_SHARDED, path], check=True, env=env)
    with OrbaxCheckpoint(path) as ck:
        assert ck.reader == "tensorstore"
        got = ck.read([("w", "value")])[("w", "value")]
    expect = np.arange(8 * 12, dtype=np.float32).reshape(8, 12).astype(ml_dtypes.bfloat16)
    assert got.dtype == expect.dtype and got.tobytes() == expect.tobytes()


def test_other_leaves_go_through_orbax(tmp_path):
    """A tree with a leaf the direct reader does not handle (a Python scalar) is read by Orbax."""
    path = str(tmp_path / "scalar")
    save(path, {"w": np.ones((2, 3), np.float32), "step": 7})
    with OrbaxCheckpoint(path) as ck:
        assert ck.reader == "orbax"
        got = ck.read([("w",), ("step",)])
    assert got[("w",)].tobytes() == np.ones((2, 3), np.float32).tobytes() and int(got[("step",)]) == 7


def test_damaged_data_names_the_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    save(path, tree())
    data = os.path.join(path, "d")
    for name in os.listdir(data):
        with open(os.path.join(data, name), "r+b") as f:
            f.truncate(max(0, os.path.getsize(f.name) // 2))
    with pytest.raises(CorruptFileError, match=f"{path}.*damaged"):
        with OrbaxCheckpoint(path) as ck:
            ck.read(list(ck.leaves))


def test_metadata_not_understood_falls_back_to_orbax(tmp_path):
    """_METADATA that the direct reader does not recognise is handed to Orbax unchanged."""
    path = str(tmp_path / "ckpt")
    save(path, tree())
    meta_path = os.path.join(path, "_METADATA")
    with open(meta_path) as f:
        meta = json.load(f)
    meta["use_ocdbt"] = "maybe"
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    with OrbaxCheckpoint(path) as ck:
        assert ck.reader == "orbax"
        got = ck.read(list(ck.leaves))
    assert flat(nest(got)).keys() == flat(tree()).keys()


def test_key_paths_are_not_followed_out_of_the_checkpoint(tmp_path):
    """A key that would name a path (``..``, ``/``) is never opened directly."""
    from ckptbridge.io.orbax import _TensorstoreLeaves

    path = str(tmp_path / "ckpt")
    save(path, tree(), use_ocdbt=False)
    meta_path = os.path.join(path, "_METADATA")
    with open(meta_path) as f:
        meta = json.load(f)
    entry = next(iter(meta["tree_metadata"].values()))
    assert _TensorstoreLeaves.open(path) is not None
    for bad in ("..", "a/b"):
        entry["key_metadata"][0]["key"] = bad
        with open(meta_path, "w") as f:
            json.dump(meta, f)
        assert _TensorstoreLeaves.open(path) is None
