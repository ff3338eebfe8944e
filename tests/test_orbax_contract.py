"""The one private Orbax API ckptbridge uses, pinned by a contract, and the public fallback.

The streaming writer (``ckptbridge.io.orbax``) overrides two private steps of Orbax's
``NumpyHandler``. These tests fail when the installed orbax-checkpoint changes them (the
contract), prove that a changed Orbax is detected and written through the public interface
instead, and that both writers store the same arrays. They run in every test environment
(the pinned one, the floor one: orbax-checkpoint 0.12.8 and 0.12.0).
"""

import copy
import os

import ml_dtypes
import numpy as np
import pytest

from ckptbridge import deps
from ckptbridge.io import orbax as orbax_io
from ckptbridge.io.orbax import LazyArray, OrbaxCheckpoint, nest, save_tree
from ckptbridge.verify import compare_tensors

from conftest import run_cli

ORBAX = deps.installed_version("orbax-checkpoint")


def _tree():
    rng = np.random.default_rng(0)
    big = rng.standard_normal((24, 6, 5)).astype(ml_dtypes.bfloat16)
    whole = rng.standard_normal((7, 3)).astype(np.float32)
    plain = rng.integers(0, 100, (4, 4)).astype(np.int32)

    pieces = [((slice(start, start + 8), slice(0, 6), slice(0, 5)), lambda s=start: big[s:s + 8])
              for start in range(0, 24, 8)]
    tree = {
        "big": {"w": LazyArray(big.shape, big.dtype, chunks=(8, 6, 5), pieces=pieces)},
        "whole": LazyArray(whole.shape, whole.dtype, produce=lambda: whole.copy()),
        "plain": plain,
    }
    expect = {("big", "w"): big, ("whole",): whole, ("plain",): plain}
    return tree, expect


def test_private_contract_holds_on_the_installed_orbax():
    import orbax.checkpoint as ocp

    assert orbax_io.private_contract_holds(ocp.type_handlers.NumpyHandler), (
        f"orbax-checkpoint {ORBAX} changed NumpyHandler's private steps: review LazyArrayHandler "
        "(the public writer takes over meanwhile)")
    assert orbax_io.orbax_writer() == "streaming"


class _Renamed:
    async def _background_serialize(self, values, infos, args):
        pass

    async def _open_and_write(self, value, spec, context):  # a parameter renamed
        pass


class _Sync:
    def _background_serialize(self, values, infos, args):  # no longer a coroutine
        pass

    async def _open_and_write(self, value, tspec, ts_context):
        pass


@pytest.mark.parametrize("cls", [object, _Renamed, _Sync], ids=["gone", "renamed", "sync"])
def test_a_changed_private_api_is_detected(cls):
    assert not orbax_io.private_contract_holds(cls)


def test_lazy_leaves_are_not_copied():
    """orbax-checkpoint before 0.12.5 deep-copies every value it is given."""
    leaf = LazyArray((2, 2), np.float32, produce=lambda: np.zeros((2, 2), np.float32))
    assert copy.deepcopy(leaf) is leaf


@pytest.mark.parametrize("writer", orbax_io.WRITERS)
def test_both_writers_store_the_same_arrays(tmp_path, monkeypatch, writer):
    monkeypatch.setenv("CKPTBRIDGE_ORBAX_WRITER", writer)
    tree, expect = _tree()
    path = str(tmp_path / "ckpt")
    assert save_tree(path, tree, {"ckptbridge": {"kind": "test"}}) == writer
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no scratch left
    import orbax.checkpoint as ocp

    restored = ocp.StandardCheckpointer().restore(os.path.abspath(path))
    with OrbaxCheckpoint(path) as ck:
        assert ck.custom_metadata == {"ckptbridge": {"kind": "test"}}
        got = ck.read(list(expect))
        chunks = ck.chunks(("big", "w"))
    for p, want in expect.items():
        node = restored
        for k in p:
            node = node[k]
        for arr in (np.asarray(node), got[p]):
            assert arr.dtype == want.dtype and arr.shape == want.shape and arr.tobytes() == want.tobytes(), p
    if writer == "streaming":
        assert chunks == (8, 6, 5)  # each row block is one stored chunk
    else:
        assert np.prod(chunks) <= 8 * 6 * 5  # Orbax's own chunks, at most a block (SaveArgs.chunk_byte_size)


def test_a_changed_orbax_converts_through_the_public_interface(checkpoints, tmp_path, monkeypatch):
    """With NumpyHandler's private step changed, the conversion goes on, through the public
    writer, and gives the same checkpoint."""
    import orbax.checkpoint as ocp

    from ckptbridge import convert_orbax_to_safetensors, convert_safetensors_to_orbax

    src = checkpoints["kv_lm_bf16_sharded"]
    streaming = convert_safetensors_to_orbax(src, str(tmp_path / "streaming"), chunk_size="4KiB", progress=False)
    assert streaming.orbax_writer == "streaming"

    original = ocp.type_handlers.NumpyHandler._open_and_write

    async def changed(self, value, spec, context):  # an Orbax release that renamed the parameters
        return await original(self, value, spec, context)

    monkeypatch.setattr(ocp.type_handlers.NumpyHandler, "_open_and_write", changed)
    assert orbax_io.orbax_writer() == "public"
    public = convert_safetensors_to_orbax(src, str(tmp_path / "public"), chunk_size="4KiB", progress=False)
    assert public.orbax_writer == "public"
    monkeypatch.undo()
    with OrbaxCheckpoint(str(tmp_path / "streaming")) as a, OrbaxCheckpoint(str(tmp_path / "public")) as b:
        assert a.leaves == b.leaves
        assert a.ckptbridge_metadata == b.ckptbridge_metadata
        ga, gb = a.read(list(a.leaves)), b.read(list(b.leaves))
    assert all(ga[p].tobytes() == gb[p].tobytes() for p in ga)
    convert_orbax_to_safetensors(str(tmp_path / "public"), str(tmp_path / "back"), progress=False)
    assert compare_tensors(src, str(tmp_path / "back")).identical


def test_cli_public_writer_and_a_bad_choice(checkpoints, tmp_path):
    src = checkpoints["keqv_text_bf16_single"]
    out = run_cli("convert", "safetensors-to-orbax", src, str(tmp_path / "o"), "--json", "--quiet",
                  env={"CKPTBRIDGE_ORBAX_WRITER": "public"})
    assert out.returncode == 0, out.stderr
    assert '"orbax_writer": "public"' in out.stdout
    back = run_cli("convert", "orbax-to-safetensors", str(tmp_path / "o"), str(tmp_path / "b"), "--quiet")
    assert back.returncode == 0 and compare_tensors(src, str(tmp_path / "b")).identical, back.stderr
    bad = run_cli("convert", "safetensors-to-orbax", src, str(tmp_path / "x"), env={"CKPTBRIDGE_ORBAX_WRITER": "fast"})
    assert bad.returncode == 8 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "CKPTBRIDGE_ORBAX_WRITER" in bad.stderr and not os.path.exists(tmp_path / "x")


def test_unknown_write_specs_keep_their_chunks():
    spec = {"driver": "n5", "metadata": {"blockSize": [4]}}
    assert orbax_io._with_chunks(spec, (2,)) is spec
    assert orbax_io._with_chunks({"driver": "zarr"}, (2,)) == {"driver": "zarr"}
    assert orbax_io._with_chunks({"driver": "zarr", "metadata": {"chunks": [4]}}, (2,))["metadata"]["chunks"] == [2]


def test_nest_round_trips():
    _, expect = _tree()
    assert set(orbax_io._flatten(nest(expect))) == set(expect)
