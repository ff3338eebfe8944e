"""Training settings: one dataclass, named presets, and overrides from a file or the command line.

Presets:

* ``gemma4-31b-v5p8``: the paper's recipe on a TPU v5p-8 (4 chips): LoRA rank 64, alpha 64,
  dropout 0.05; AdamW lr 1e-4, 100 warmup steps, cosine to 0, weight decay 0.001; micro-batch 1
  x accumulation 8; max length 3072; checkpoint every 100 steps, keep 3; mesh fsdp=1 tp=4; bf16;
  remat per decoder layer keeping the projections' outputs (``decoder_dots``, training/remat.py):
  the backward pass recomputes attention and activations only, for 0.43 GB a layer at 3072
  tokens (split over tp), which the v5p's 95 GB per chip hold many times over; one v5e chip
  (16 GB) holds the step of 8 such layers (remat=decoder: more layers, a slower step).
* ``tiny-cpu``: the same code path with small numbers, for a laptop CPU and the tests (rank 8,
  lr 3e-3, micro-batch 1 x accumulation 4, float32, no remat; max length 3072 as in the paper).

Differences from the paper, on purpose: LoRA also on ``k_einsum`` (the paper's regex missed the
global layers' K=V projection) and sequence packing on (``packing=false`` reproduces the paper).

``targets`` are qwix module names; empty (the default) means every LoRA target of the base's
family (its spec's ``lora_targets``), so ``tiny-cpu`` trains any family.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from ckptbridge.errors import ConfigError
from ckptbridge.options import QLORA_SCHEMES
from ckptbridge.specs import FAMILIES
from training.remat import REMAT

# QLoRA base types (qwix weight_qtype): int8, int4, NormalFloat4
BASE_QUANT = ("none", *QLORA_SCHEMES)

# the paper's recipe, plus k_einsum (see above)
PAPER_TARGETS = ("q_einsum", "kv_einsum", "k_einsum", "attn_vec_einsum", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass
class TrainConfig:
    # LoRA
    rank: int = 64
    alpha: float = 64.0
    dropout: float = 0.05
    targets: tuple[str, ...] = ()  # qwix module names; () = every LoRA target of the base's family
    # optimizer (AdamW, linear warmup then cosine to 0)
    learning_rate: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.001
    max_grad_norm: float | None = None  # no clipping in the paper
    # batch
    micro_batch: int = 1
    grad_accum: int = 8
    max_length: int = 3072
    packing: bool = True
    num_packing_bins: int = 64
    # positions whose logits are computed at once in the loss (0: the whole sequence): the float32
    # logits of one 3072-token micro-batch over a 262,144 vocab are 3.2 GB; in chunks of 512, 0.5
    loss_chunk: int = 512
    epochs: int = 1
    max_steps: int | None = None  # optimizer steps; default: the whole data for `epochs`
    seed: int = 0
    # checkpoints and logs
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    log_every: int = 1
    # hardware
    fsdp: int = 1
    tp: int = 4
    remat: str = "decoder"  # what a layer keeps for the backward pass: see training/remat.py
    param_dtype: str = "bfloat16"
    dtype: str = "bfloat16"
    usd_per_hour: float = 16.80  # TPU v5p-8 on-demand rate used by the paper's cost figures
    xla_flags: str = "--xla_llvm_disable_expensive_passes=true"
    # loading the base: threads reading and rearranging its tensors (none: the usable cores) and the
    # host bytes they may hold ahead of the chip
    load_workers: int | None = None
    load_memory_budget: str = "2GiB"
    # JAX's persistent compilation cache: "" = RUN_DIR/compile_cache, a directory (one shared by
    # runs of the same shapes), or "off"; a resumed run loads its programs instead of compiling
    compile_cache: str = ""
    # train even where Tunix's model of the base's family computes another model than transformers
    # (a RoPE theta or scaling it ignores); the run then trains what Tunix computes
    allow_config_mismatch: bool = False
    # QLoRA: the base's LoRA-target weights stored quantized (qwix's own LoraRule weight_qtype, absmax
    # per output channel), quantized tensor by tensor as they load; base_quant_tile: sub-channel tiles
    # of that many inputs (none: one scale per output channel)
    base_quant: str = "none"
    base_quant_tile: int | None = None

    def lora_rules(self, family_targets: tuple[str, ...] = ()) -> list[dict]:
        """The qwix rules of this recipe on a base whose family has the LoRA targets ``family_targets``."""
        targets = self.targets or family_targets
        unknown = [t for t in targets if t not in family_targets] if family_targets else []
        if unknown or not targets:
            raise ConfigError(f"invalid setting: targets {', '.join(unknown) or '(none)'}: the base's family has "
                              f"the LoRA targets {', '.join(family_targets) or '(none given)'}")
        rule: dict[str, Any] = {"module_path": f".*({'|'.join(targets)})", "rank": self.rank, "alpha": self.alpha}
        if self.base_quant != "none":
            rule["weight_qtype"] = self.base_quant
            if self.base_quant_tile:
                rule["tile_size"] = self.base_quant_tile
        return [rule]

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["targets"] = list(self.targets)
        return d


PRESETS: dict[str, dict[str, Any]] = {
    "gemma4-31b-v5p8": dict(targets=PAPER_TARGETS, remat="decoder_dots"),
    # QLoRA: the same recipe on a base held in 4 bits on one v6e chip, or in int8 on a v5e-4
    # (on-demand list prices per hour of the slice). int4, not nf4: qwix dequantizes nf4 with a
    # table lookup that XLA keeps as a full-size copy of each weight (0.83 GB more a 31B layer on
    # a v6e, docs/benchmarks.md), so that an nf4 31B does not fit one chip
    "gemma4-31b-v6e1-qlora": dict(targets=PAPER_TARGETS, remat="decoder", base_quant="int4", fsdp=1, tp=1,
                                  usd_per_hour=2.70),
    "gemma4-31b-v5e4-qlora": dict(targets=PAPER_TARGETS, remat="decoder", base_quant="int8", fsdp=1, tp=4,
                                  usd_per_hour=4.80),
    "tiny-cpu": dict(
        rank=8, alpha=16.0, dropout=0.0, learning_rate=3e-3, warmup_steps=2, micro_batch=1, grad_accum=4,
        checkpoint_every=10, keep_checkpoints=3, fsdp=1, tp=1,
        remat="none", param_dtype="float32", dtype="float32", usd_per_hour=0.0, xla_flags="",
    ),
}


def _coerce(name: str, value: Any, current: Any, field: dataclasses.Field) -> Any:
    """Turn a string (from the command line) or a JSON value into the field's type."""
    kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in ("none", "null") and "None" in kind:
            return None
        if "tuple" in kind:
            return tuple(t for t in text.replace(",", " ").split() if t)
        if kind.startswith("bool"):
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{name}={value!r}: expected true or false")
        if kind.startswith("int"):
            try:
                return int(text)
            except ValueError:
                raise ConfigError(f"{name}={value!r}: expected an integer") from None
        if kind.startswith("float"):
            try:
                return float(text)
            except ValueError:
                raise ConfigError(f"{name}={value!r}: expected a number") from None
        return text
    if "tuple" in kind and isinstance(value, list):
        return tuple(value)
    return value


def build_config(preset: str, config_file: str | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Preset, then a YAML/JSON file, then ``key=value`` overrides, each over the previous."""
    if preset not in PRESETS:
        raise ConfigError(f"--preset {preset!r}: choose one of {', '.join(PRESETS)}")
    values: dict[str, Any] = dict(PRESETS[preset])
    if config_file:
        values.update(_read_file(config_file))
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: write it as key=value (e.g. rank=16)")
        key, value = item.split("=", 1)
        values[key.strip().replace("-", "_")] = value
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig()
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(f"unknown setting {key!r}; settings: {', '.join(sorted(fields))}")
        setattr(cfg, key, _coerce(key, value, getattr(cfg, key), fields[key]))
    validate(cfg)
    return cfg


def _read_file(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: no such file")
    with open(path) as f:
        text = f.read()
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # yaml and json raise different types
        raise ConfigError(f"--config {path}: cannot parse ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of settings")
    return data


def known_targets() -> set[str]:
    return {t for spec in FAMILIES.values() for t in spec.lora_targets}


def _size_ok(text: str) -> bool:
    from ckptbridge import options

    try:
        return options.parse_size(text) > 0
    except Exception:  # any unparsable size
        return False


def validate(cfg: TrainConfig) -> None:
    checks = [
        (cfg.rank >= 1, "rank must be >= 1"),
        (cfg.alpha > 0, "alpha must be > 0"),
        (0 <= cfg.dropout < 1, "dropout must be in [0, 1)"),
        (cfg.micro_batch >= 1 and cfg.grad_accum >= 1, "micro_batch and grad_accum must be >= 1"),
        (cfg.max_length >= 8, "max_length must be >= 8"),
        (cfg.loss_chunk >= 0, "loss_chunk must be >= 0 (0: the whole sequence at once)"),
        (cfg.fsdp >= 1 and cfg.tp >= 1, "fsdp and tp must be >= 1"),
        (cfg.remat in REMAT, f"remat must be one of {', '.join(REMAT)}"),
        (cfg.checkpoint_every >= 1 and cfg.keep_checkpoints >= 1, "checkpoint_every and keep_checkpoints must be >= 1"),
        (cfg.max_steps is None or cfg.max_steps >= 1, "max_steps must be >= 1"),
        (set(cfg.targets) <= known_targets(), "targets must be qwix LoRA targets of a family: "
         f"{', '.join(sorted(known_targets()))} (empty: all of the base's family)"),
        (cfg.load_workers is None or cfg.load_workers >= 1, "load_workers must be >= 1 (none: the usable cores)"),
        (_size_ok(cfg.load_memory_budget), f"load_memory_budget {cfg.load_memory_budget!r}: a size such as 2GiB"),
        (cfg.param_dtype in ("float32", "bfloat16") and cfg.dtype in ("float32", "bfloat16"),
         "param_dtype and dtype must be float32 or bfloat16"),
        (cfg.base_quant in BASE_QUANT, f"base_quant {cfg.base_quant!r}: one of {', '.join(BASE_QUANT)} (qwix's "
         "weight types for a QLoRA base)"),
        (cfg.base_quant_tile is None or cfg.base_quant_tile >= 1, "base_quant_tile must be >= 1 (none: one scale "
         "per output channel)"),
        (cfg.base_quant_tile is None or cfg.base_quant != "none", "base_quant_tile needs base_quant"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(f"invalid setting: {message}")
