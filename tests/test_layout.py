import numpy as np
import ml_dtypes
import pytest

from ckptbridge import layout


def test_parse_and_shape():
    assert layout.parse("(k h) d") == (("k", "h"), ("d",))
    assert layout.parse("c k d h") == (("c",), ("k",), ("d",), ("h",))
    assert layout.shape("(k h) d", {"k": 2, "h": 3, "d": 5}) == (6, 5)


@pytest.mark.parametrize("bad", ["(k h", "k h)", "((k) h)", "k k", "()", "k-h"])
def test_parse_rejects_malformed(bad):
    with pytest.raises(ValueError):
        layout.parse(bad)


def test_rearrange_matches_explicit_numpy_and_inverts():
    sizes = {"n": 3, "h": 5, "d": 7}
    w = np.arange(15 * 7, dtype=np.float32).reshape(15, 7)  # HF q_proj (n h) d
    t = layout.rearrange(w, "(n h) d", "n d h", sizes)
    np.testing.assert_array_equal(t, w.reshape(3, 5, 7).transpose(0, 2, 1))
    np.testing.assert_array_equal(layout.rearrange(t, "n d h", "(n h) d", sizes), w)


def test_rearrange_bfloat16_is_bit_exact():
    sizes = {"d": 7, "n": 3, "h": 5}
    w = np.random.default_rng(0).standard_normal((7, 15)).astype(ml_dtypes.bfloat16)  # o_proj d (n h)
    t = layout.rearrange(w, "d (n h)", "n h d", sizes)
    assert t.dtype == w.dtype
    back = layout.rearrange(t, "n h d", "d (n h)", sizes)
    assert back.tobytes() == w.tobytes()


def test_rearrange_rejects_wrong_shape():
    with pytest.raises(ValueError, match="does not match"):
        layout.rearrange(np.zeros((4, 4)), "(n h) d", "n d h", {"n": 3, "h": 5, "d": 4})
