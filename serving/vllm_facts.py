"""What vLLM will make of a model directory, worked out before it starts, and why it stopped.

vLLM derives the longest sequence a model takes from its ``config.json`` and refuses a larger
``--max-model-len`` only after its imports (seconds to minutes); with ``--dtype auto`` it serves
float32 checkpoints in bfloat16. Both rules are mirrored here from vLLM 0.32
(``vllm/config/model.py``: ``_get_and_verify_max_len``, ``_resolve_auto_dtype``), so that
``python -m serving serve`` can pick a length that fits and say which precision the model will
run in. ``tests/test_serving_facts.py`` checks both against vLLM's own ``ModelConfig`` and fails
if vLLM changes them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

# vLLM's keys for the model's longest sequence, read from the text config; the smallest wins
MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
# RoPE types whose max_position_embeddings is already scaled (vLLM does not apply `factor` again)
_PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")
DTYPE_NAMES = {"half": "float16", "float16": "float16", "float": "float32", "float32": "float32",
               "bfloat16": "bfloat16"}
# precision of a float dtype, in mantissa bits: serving in fewer bits than the checkpoint loses precision
MANTISSA_BITS = {"float32": 23, "float16": 10, "bfloat16": 7}
_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


@dataclasses.dataclass(frozen=True)
class ModelLimits:
    max_len: int | None  # None: config.json has none of vLLM's keys (vLLM assumes 2048)
    max_len_from: str | None  # where the limit comes from: "max_position_embeddings in DIR/config.json"
    config_dtype: str | None  # dtype in config.json (or its text_config)
    weights_dtype: str | None  # the floating dtype most of the weights are stored in


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _text_config(cfg: dict) -> dict:
    text = cfg.get("text_config")
    return text if isinstance(text, dict) else cfg


def _rope_factor(cfg: dict) -> float:
    """vLLM's RoPE scaling factor of the maximum length (1 unless a scaling type defines one)."""
    text = _text_config(cfg)
    params = text.get("rope_parameters") or text.get("rope_scaling")
    if not isinstance(params, dict):
        return 1.0
    per_type = params.values() if all(isinstance(v, dict) for v in params.values()) and params else [params]
    factor = 1.0
    for p in per_type:
        rope_type = p.get("rope_type") or p.get("type") or "default"
        if rope_type not in _PRESCALED_ROPE:
            factor = p.get("factor", factor)
    return 1.0 if factor is None else float(factor)


def _weights_dtype(model_dir: str) -> str | None:
    from ckptbridge.io.safetensors import SafetensorsFile

    counts: dict[str, int] = {}
    try:
        for name in sorted(os.listdir(model_dir)):
            if name.endswith(".safetensors"):
                with SafetensorsFile(os.path.join(model_dir, name)) as f:
                    for key in f.keys():
                        info = f.info(key)
                        dtype = _SAFETENSORS_DTYPES.get(info.dtype)
                        if dtype:
                            counts[dtype] = counts.get(dtype, 0) + info.nbytes
    except Exception:  # noqa: BLE001 - vLLM reports unreadable weights itself
        return None
    return max(counts, key=counts.get) if counts else None


def weights_memory(model_dir: str) -> dict:
    """What the weights of ``model_dir`` take (the memory vLLM loads them into: bytes as stored, by
    dtype) and how they are quantized: ``{"bytes", "dtypes", "quantization"}``."""
    from ckptbridge.io.hf import HFModelDir
    from ckptbridge.formats.compressed_tensors import describe, scheme_of

    with HFModelDir(model_dir) as model:
        dtypes: dict[str, int] = {}
        for key in model.keys():
            info = model.info(key)
            dtypes[info.dtype] = dtypes.get(info.dtype, 0) + info.nbytes
        scheme = scheme_of(model.config)
        what = describe(model.config)
    quantization = f"{scheme.name} ({scheme.preset}, {what})" if scheme else what
    return {"bytes": sum(dtypes.values()), "dtypes": dtypes, "quantization": quantization}


def _hf_config(model_dir: str) -> dict:
    """config.json with transformers' defaults filled in (vLLM reads the config through
    transformers, so a key the file leaves out has the class default); the raw file where
    transformers cannot read it."""
    raw = _read_json(os.path.join(model_dir, "config.json"))
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model_dir).to_dict()
    except Exception:  # noqa: BLE001 - unknown to this transformers: the file is what we have
        return raw
    return cfg if isinstance(cfg, dict) else raw


def _dtype_name(value) -> str | None:
    if value is None:
        return None
    return DTYPE_NAMES.get(str(value).removeprefix("torch."))


def model_limits(model_dir: str) -> ModelLimits:
    """The maximum length vLLM derives for ``model_dir`` and the dtypes it starts from."""
    cfg = _hf_config(model_dir)
    text = _text_config(cfg)
    derived, key = None, None
    for k in MAX_LEN_KEYS:
        v = text.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and (derived is None or v < derived):
            derived, key = v, k
    if isinstance(text.get("model_max_length"), (int, float)) and text["model_max_length"]:
        derived, key = text["model_max_length"], "model_max_length"
    # (vLLM 0.32 leaves tokenizer_config.json's model_max_length out of this: measured)
    if derived is not None and "gemma3" not in str(cfg.get("model_type", "")):
        derived *= _rope_factor(cfg)
    config_dtype = (_dtype_name(cfg.get("dtype")) or _dtype_name(cfg.get("torch_dtype"))
                    or _dtype_name(text.get("dtype")) or _dtype_name(text.get("torch_dtype")))
    where = f"{key} in {os.path.join(model_dir, 'config.json')}" if key else None
    return ModelLimits(int(derived) if derived is not None else None, where, config_dtype, _weights_dtype(model_dir))


def compute_dtype(requested: str, limits: ModelLimits, supported: tuple[str, ...] = ("bfloat16", "float16",
                                                                                       "float32")) -> str:
    """The dtype vLLM computes in for ``--dtype requested`` (``supported``: the platform's
    dtypes, preferred first: bfloat16 on CPUs, GPUs and TPUs)."""
    requested = requested.lower()
    if requested != "auto":
        if requested not in DTYPE_NAMES:
            from ckptbridge.errors import ConfigError

            raise ConfigError(f"--dtype {requested!r}: choose auto, float32, bfloat16 or float16")
        return DTYPE_NAMES[requested]
    # vLLM reads the config's dtype, else the weights', and downcasts float32 to its preferred dtype
    start = limits.config_dtype or limits.weights_dtype or "float32"
    if start == "float32":
        return supported[0]
    return start if start in supported else supported[0]


# ---------------------------------------------------------------------------------- start-up failure

_PREFIX = re.compile(r"^\((?:APIServer|EngineCore\w*|Worker\w*|[\w-]+) pid=\d+\)\s?")
_LOG = re.compile(r"^(?P<level>ERROR|CRITICAL)\s+\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?\s+\[[^\]]*\]\s*(?P<msg>.*)$")
_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?(?P<name>[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt))"
                        r"(?::\s*(?P<msg>.*))?$")
# messages that only point elsewhere: the reason is an earlier line
_GENERIC = ("see root cause above", "engine core initialization failed", "enginecore failed to start",
            "exception in worker", "worker proc", "shutting down", "api server process")


def startup_reason(lines: list[str]) -> str | None:
    """vLLM's own reason for stopping, from the last lines of its output: the last exception (with
    pydantic's detail line) or ERROR line that is not just a pointer to another one."""
    found: list[str] = []
    lines = [_PREFIX.sub("", line.rstrip("\n")) for line in lines]
    for i, line in enumerate(lines):
        log = _LOG.match(line)
        if log:
            found.append(log.group("msg").strip())
            continue
        exc = _EXCEPTION.match(line)
        if not exc or line[:1].isspace():
            continue
        msg = (exc.group("msg") or "").strip()
        if exc.group("name") == "ValidationError":  # pydantic: the detail is on the next indented line
            detail = next((x.strip() for x in lines[i + 1:i + 4] if x[:1].isspace() and x.strip()
                           and not x.strip().startswith("For further information")), "")
            msg = re.sub(r"^Value error,\s*", "", detail) or msg
            msg = re.sub(r"\s*\[type=[^\]]*\]\s*$", "", msg)
            found.append(msg)
        else:
            found.append(f"{exc.group('name')}: {msg}" if msg else exc.group("name"))
    specific = [m for m in found if m and not any(g in m.lower() for g in _GENERIC)]
    reason = (specific or found or [None])[-1]
    if reason and len(reason) > 400:
        reason = reason[:400].rsplit(" ", 1)[0] + " ..."
    return reason
