"""Untouched tensors are copied file to file when safetensors are written (copy_file_range, or
read + write where the kernel cannot), byte for byte; a truncated source is an error. (Moved from
tests/test_roundtrip.py: it does not depend on a model family.)"""

import os

import numpy as np
import pytest


@pytest.mark.parametrize("in_kernel", [True, False], ids=["copy_file_range", "read-write"])
def test_file_ranges_copy_bytes_exactly(tmp_path, monkeypatch, in_kernel):
    """Untouched tensors are copied file to file (copy_file_range, or read + write where the
    kernel cannot), in steps smaller than the tensor, with writeback started along the way."""
    import ml_dtypes

    from ckptbridge.io import output
    from ckptbridge.io import safetensors as st

    monkeypatch.setattr(output, "COPY_STEP", 1000)
    monkeypatch.setattr(output, "WRITEBACK_EVERY", 4096)
    if not in_kernel:
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((37, 101)).astype(ml_dtypes.bfloat16),
               "b": rng.integers(0, 100, (3, 7, 5)).astype(np.int32), "c": np.zeros((0, 4), np.float32)}
    src, dst = str(tmp_path / "src.safetensors"), str(tmp_path / "dst.safetensors")
    st.write_file(src, [st.PlannedTensor(k, v.dtype, v.shape, lambda v=v: v) for k, v in tensors.items()])
    with st.SafetensorsFile(src) as f:
        planned = [st.PlannedTensor(k, st.numpy_dtype(f.info(k).dtype), f.info(k).shape,
                                    chunks=lambda k=k: [f.byte_range(k)]) for k in f.keys()]
        planned.insert(1, st.PlannedTensor("mid", np.float32, (5,), lambda: np.arange(5, dtype=np.float32)))
        st.write_file(dst, planned)
    with st.SafetensorsFile(dst) as g:
        for k, v in tensors.items():
            assert g.array(k).tobytes() == v.tobytes() and g.array(k).dtype == v.dtype
        assert g.array("mid").tolist() == [0, 1, 2, 3, 4]


def test_file_range_of_a_truncated_source_is_an_error(tmp_path):
    from ckptbridge.errors import CorruptFileError
    from ckptbridge.io import safetensors as st

    src, dst = str(tmp_path / "src.safetensors"), str(tmp_path / "dst.safetensors")
    v = np.ones((64, 64), np.float32)
    st.write_file(src, [st.PlannedTensor("w", v.dtype, v.shape, lambda: v)])
    with st.SafetensorsFile(src) as f:
        os.truncate(src, os.path.getsize(src) - 100)
        with pytest.raises(CorruptFileError, match="'w' ends early"):
            st.write_file(dst, [st.PlannedTensor("w", v.dtype, v.shape, chunks=lambda: [f.byte_range("w")])])


def test_mapped_tensors_equal_read_ones_and_outlive_the_file_object(tmp_path):
    """What the base load hands to the device: tensors over the mapped file, equal to those read,
    read-only, valid after the file is closed (zero-size ones included)."""
    import ml_dtypes

    from ckptbridge.io import safetensors as st

    rng = np.random.default_rng(1)
    tensors = {"a": rng.standard_normal((37, 101)).astype(ml_dtypes.bfloat16),
               "b": rng.integers(0, 100, (3, 7, 5)).astype(np.int32), "c": np.zeros((0, 4), np.float32)}
    path = str(tmp_path / "m.safetensors")
    st.write_file(path, [st.PlannedTensor(k, v.dtype, v.shape, lambda v=v: v) for k, v in tensors.items()])
    with st.SafetensorsFile(path) as f:
        views = {k: f.mapped(k) for k in tensors}
        for k, v in tensors.items():
            assert views[k].dtype == v.dtype and views[k].shape == v.shape
            assert views[k].tobytes() == f.array(k).tobytes() == v.tobytes()
    assert not views["a"].flags.writeable
    with pytest.raises(ValueError):
        views["b"][0, 0, 0] = 1
    assert views["a"].tobytes() == tensors["a"].tobytes()  # after close
