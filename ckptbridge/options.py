"""The verbs' choices and defaults, each defined once: the library's parameters default to
them and the CLI's flags show them. Light: the CLI imports it for ``--help``."""

from __future__ import annotations

from ckptbridge.errors import ConfigError

# Tensors larger than this are converted in row blocks of at most this size (one Orbax chunk each).
DEFAULT_CHUNK_SIZE = "32MiB"
DEFAULT_MAX_SHARD_SIZE = "5GB"  # largest safetensors shard written
# Bytes of pieces (row blocks, tensors, factors) read, computed or being written at once, over all
# workers of a conversion; the default keeps a 31B conversion's peak RSS within 1.5 GB.
DEFAULT_MEMORY_BUDGET = "256MiB"
TARGETS = ("hf", "vllm")  # where an exported or checked adapter runs: transformers/PEFT, or vLLM
KV_MODES = ("exact", "svd")  # PEFT k/v factors with different A's -> one qwix A: stacked, or best shared
# adapter algebra (ckptbridge.adapter): PEFT's add_weighted_adapter methods, the ties sign election,
# the dtypes factors are written in
COMBINE_FACTOR_METHODS = ("linear", "ties", "dare_linear", "dare_ties", "magnitude_prune")
COMBINE_SVD_METHODS = ("svd", "ties_svd", "dare_linear_svd", "dare_ties_svd", "magnitude_prune_svd")
COMBINE_METHODS = ("cat", *COMBINE_FACTOR_METHODS, *COMBINE_SVD_METHODS)
COMBINE_PRUNING = tuple(m for m in COMBINE_METHODS if m.removesuffix("_svd") in ("ties", "dare_linear", "dare_ties",
                                                                                 "magnitude_prune"))
SIGN_METHODS = ("total", "frequency")
ADAPTER_DTYPES = ("float32", "bfloat16", "float16")
QUANT_SCHEMES = ("int8", "fp8")  # weight quantizations written (formats.compressed_tensors.SCHEMES): W8A8, FP8_DYNAMIC
LOGITS_TOLERANCE = 1e-5  # largest relative L2 of transformers vs Tunix logits (float32) that passes
EXACT_TOLERANCE = 1e-4  # transformers+PEFT vs Tunix+qwix, float32
LIVE_TOLERANCE = 1e-6  # below this relative change of the logits, an adapter does nothing
SERVED_TOKENS = 16  # greedy tokens compared by served_parity


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"500MiB"`` -> 524_288_000, ``123`` -> 123 (ValueError otherwise)."""
    if isinstance(text, int):
        if text <= 0:
            raise ValueError(f"size {text!r} must be positive")
        return text
    s = str(text).strip().upper().replace(" ", "")
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
             "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    num, mult = s, 1
    for unit, factor in units.items():
        if s.endswith(unit):
            num, mult = s[: -len(unit)], factor
            break
    try:
        value = int(float(num) * mult)
    except ValueError:
        raise ValueError(f"size {text!r} is not a number with an optional unit (e.g. 5GB, 500MiB)") from None
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return value


def size(name: str, value: str | int) -> int:
    """A size parameter of the library (bytes, or text such as ``"5GB"``) in bytes; a ConfigError
    naming the parameter when it is not one."""
    try:
        return parse_size(value)
    except ValueError as e:
        raise ConfigError(f"{name}: {e}") from None


def workers(name: str, value: int | None) -> int | None:
    """A worker count parameter: None (every usable core) or an integer >= 1."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} {value!r}: give a whole number of threads >= 1 (default: every usable core)")
    return value


def choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``, else a ConfigError naming the parameter."""
    if value not in choices:
        raise ConfigError(f"{name} {value!r}: choose one of {', '.join(choices)}")
    return value

# qwix weight types a QLoRA base may be held in (training's base_quant; merge --as-trained)
QLORA_SCHEMES = ("int8", "int4", "nf4")
