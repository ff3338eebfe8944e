"""Build a family's Tunix model from an HF directory or a ckptbridge Orbax checkpoint.

This is the one module that builds Tunix models, for any family whose spec says how
(:class:`ckptbridge.specs.base.TunixModel`: module, model class, config translation). The
weights go through the same spec table as the file conversions (never through Tunix's own
safetensors loader), and are placed on a mesh, if one is given, with the sharding annotations
of Tunix's parameters.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from typing import Any

import numpy as np

from ckptbridge import layout, mapping, qlora_base
from ckptbridge.config import ModelConfig
from ckptbridge.errors import ConfigError, UnsupportedError
from ckptbridge.formats import qwix as qwix_lora
from ckptbridge.specs import FAMILIES, FamilySpec, get_family
from ckptbridge.specs.base import TunixModel

log = logging.getLogger(__name__)


def tunix_spec(spec: FamilySpec) -> TunixModel:
    if spec.tunix is None:
        raise UnsupportedError(f"family {spec.name}: ckptbridge builds no Tunix model for it (conversion only)")
    return spec.tunix


def tunix_model_class(spec: FamilySpec):
    t = tunix_spec(spec)
    return getattr(importlib.import_module(t.module), t.model_class)


def mismatch_line(cfg: ModelConfig) -> str | None:
    """One line saying what the Tunix model of ``cfg``'s family computes differently, or None."""
    return get_family(cfg.family).mismatch_line(cfg)


def check_config(cfg: ModelConfig, allow_config_mismatch: bool, *, warn: bool = True) -> None:
    """Before building a Tunix model: raise UnsupportedError if it would compute another model than
    transformers, unless ``allow_config_mismatch`` (then log it, if ``warn``)."""
    line = mismatch_line(cfg)
    if line is None:
        return
    if not allow_config_mismatch:
        raise UnsupportedError(f"{line}; pass allow_config_mismatch=True (--allow-config-mismatch) to build it anyway")
    if warn:
        log.warning("%s; built anyway (allow_config_mismatch)", line)


def tunix_model_config(cfg: ModelConfig, *, dtype: Any = None, param_dtype: Any = None,
                       remat: str | None = None, sharding: Any = None, allow_config_mismatch: bool = False,
                       towers: bool = False):
    """The Tunix ``ModelConfig`` of the family of ``cfg``, equivalent to the HF config. Where Tunix
    computes something else (:func:`config_mismatches`), raise UnsupportedError, or with
    ``allow_config_mismatch`` log the difference and build the closest Tunix model. With
    ``towers``, the towers ``cfg`` configures too, where the family's Tunix model holds them."""
    check_config(cfg, allow_config_mismatch)
    spec = get_family(cfg.family)
    extra = {}
    if towers and cfg.towers:
        held = [t.name for t in spec.towers if t.tunix]
        missing = [t for t in cfg.towers if t not in held]
        if missing:
            raise UnsupportedError(f"config.json: Tunix's {spec.name} has no {' or '.join(missing)} tower; its "
                                   "checkpoint keeps the tower's tensors beside the model (towers/), unused by Tunix")
        extra["towers"] = True
    return tunix_spec(spec).config(cfg, dtype=dtype, param_dtype=param_dtype, remat=remat, sharding=sharding, **extra)


def family_of_model(model) -> FamilySpec:
    """The family spec whose Tunix model class ``model`` is an instance of (qwix wraps models in a
    subclass of their own class)."""
    classes = {(c.__module__, c.__name__) for c in type(model).__mro__}
    for spec in FAMILIES.values():
        if spec.tunix is not None and (spec.tunix.module, spec.tunix.model_class) in classes:
            return spec
    raise UnsupportedError(f"{type(model).__module__}.{type(model).__name__}: not the Tunix model of any family")


def forward(model, tokens, positions, mask):
    """Logits of a Tunix model of any family (full forward, no cache)."""
    custom = tunix_spec(family_of_model(model)).forward
    if custom is not None:
        return custom(model, tokens, positions, mask)
    logits, _ = model(tokens, positions, None, mask)
    return logits


@functools.cache
def _keep_output_class():
    """The wrapper module class (defined on first use: flax is imported only by callers that build models)."""
    from flax import nnx

    class KeepOutput(nnx.Module):
        """A module that calls another and keeps what it returns (an ``nnx.Intermediate``)."""

        def __init__(self, inner):
            self.inner = inner

        def __call__(self, *args, **kwargs):
            out = self.inner(*args, **kwargs)
            self.sow(nnx.Intermediate, "output", out)
            return out

    return KeepOutput


def keep_hidden_states(model):
    """Let :func:`hidden_states` read ``model``'s final-normed hidden states: its last norm (the
    spec's ``final_norm``) is wrapped in a module that keeps its output. The model computes the
    same logits as before; its parameters move under ``<final_norm>.inner``. Returns ``model``."""
    t = tunix_spec(family_of_model(model))
    if t.head is None:
        raise UnsupportedError(f"family {family_of_model(model).name}: its spec names no output head")
    keep_output = _keep_output_class()
    norm = getattr(model, t.final_norm)
    if not isinstance(norm, keep_output):
        setattr(model, t.final_norm, keep_output(norm))
    return model


def hidden_states(model, tokens, positions, mask):
    """The final-normed hidden states (B, T, D) of a model prepared by :func:`keep_hidden_states`.
    Its forward's logits are not used: under ``jit`` XLA leaves the output head out, and
    :func:`head` computes logits from any part of the states."""
    from flax import nnx

    name = tunix_spec(family_of_model(model)).final_norm
    kept = getattr(model, name)
    if not isinstance(kept, _keep_output_class()):
        raise UnsupportedError("hidden_states: call keep_hidden_states(model) once after building the model")
    model(tokens, positions, None, mask)
    kept_state: Any = nnx.pop(kept, nnx.Intermediate)
    outputs = kept_state["output"].get_value()
    if len(outputs) != 1:
        raise UnsupportedError(f"{type(model).__name__}.{name} ran {len(outputs)} times in one forward; expected once")
    return outputs[0]


def head(model, h):
    """Logits of ``model``'s output head on final-normed hidden states ``h`` (..., D)."""
    spec = family_of_model(model)
    fn = tunix_spec(spec).head
    if fn is None:
        raise UnsupportedError(f"family {spec.name}: its spec names no output head")
    return fn(model, h)


def _check_divisible(name: str, shape: tuple[int, ...], sharding) -> None:
    """A clear error where Tunix's annotation splits a dimension the mesh axis does not divide."""
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    if spec is None or mesh is None:
        return
    for dim, (size, axes) in enumerate(zip(shape, spec)):
        if axes is None:
            continue
        names = axes if isinstance(axes, tuple) else (axes,)
        parts = 1
        for a in names:
            parts *= mesh.shape[a]
        if size % parts:
            raise UnsupportedError(
                f"{name}: dimension {dim} of size {size} cannot be split over mesh axis "
                f"{'x'.join(names)} of size {parts}; choose a mesh whose {'x'.join(names)} divides it"
            )


def _key(node: dict, k: str):
    """Pure-dict key of a path part: nnx keeps list indices (layers) as ints."""
    return int(k) if (k.isdigit() and int(k) in node) else k


def _lookup(tree: dict, path: tuple[str, ...]):
    node = tree
    for k in path:
        node = node[_key(node, k)]
    return node


def _assign(tree: dict, path: tuple[str, ...], value) -> None:
    parent = _lookup(tree, path[:-1])
    parent[_key(parent, path[-1])] = value


# host bytes of weights read ahead of the chip (read, rearranged, cast, not yet placed) when loading
LOAD_MEMORY_BUDGET = "2GiB"


def _base_and_lora(cls, tcfg, lora_rules: list[dict] | None, seed: int):
    """A function building the Tunix model (and qwix LoRA following ``lora_rules``) from scratch:
    traced abstractly for the structure, jitted for the LoRA factors' initial values."""
    from flax import nnx

    def build():
        model = cls(tcfg, rngs=nnx.Rngs(params=0))
        if quantizes(lora_rules):
            # QLoRA: qwix (0.1.8) finds the weight a LoRA belongs to by walking back from the traced
            # value through one-input operations and then matching shapes; from a traced initializer
            # the walk ends on a scalar and nnx.Linear gets no LoRA. A weight that is the sum of two
            # arrays (zeros: the files fill it) ends the walk at its own shape.
            import jax
            import jax.numpy as jnp

            params = nnx.state(model, nnx.Param)
            nnx.update(model, jax.tree.map(
                lambda x: jnp.add(jnp.zeros(x.shape, x.dtype), jnp.zeros(x.shape, x.dtype)), params))
        return apply_lora_rules(model, lora_rules, seed=seed) if lora_rules else model

    return build


def _not_base(path, var) -> bool:
    """What the files do not hold: LoRA factors and anything else that is no base parameter."""
    from flax import nnx

    return isinstance(var, nnx.LoRAParam) or not isinstance(var, nnx.Param)


class TunixModelPlan:
    """A family's Tunix model of a checkpoint, planned before any weight is read: its config, and
    its abstract model (shapes, dtypes, sharding annotations; qwix LoRA included when rules are
    given), from which programs can be compiled while :meth:`load` streams the weights in.

    Use :func:`open_tunix_model`, as a context manager (it holds the checkpoint's files open)."""

    def __init__(self, src: str, cfg: ModelConfig, spec: FamilySpec, tcfg, pdtype: np.dtype, mesh,
                 lora_rules: list[dict] | None, seed: int, source=None):
        from flax import nnx

        self.src = src
        self.source = source
        self.model_config = cfg
        self.spec = spec
        self.config = tcfg
        self.mesh = mesh
        self.param_dtype = pdtype
        self.lora_rules = lora_rules
        cls = tunix_model_class(spec)
        self._build = _base_and_lora(cls, tcfg, lora_rules, seed)
        try:
            abstract = nnx.eval_shape(self._build)
        except ValueError as e:  # qwix: a quantization tile that does not divide a weight's inputs
            if "cannot be tiled" not in str(e):
                raise
            tiles = sorted({int(r["tile_size"]) for r in lora_rules or [] if r.get("tile_size")})
            raise ConfigError(f"base_quant_tile {', '.join(map(str, tiles))}: does not divide the inputs of every "
                              f"LoRA module ({str(e).splitlines()[0][:120]}); choose a tile that divides the hidden "
                              "size, the MLP width and the head dim") from None
        self.lora_annotations = qwix_lora.fit_lora_annotations(abstract, mesh) if (mesh is not None and lora_rules) \
            else (0, 0)
        self.graphdef, self.abstract_state = nnx.split(abstract)

    def abstract_model(self):
        """A new abstract model (``jax.ShapeDtypeStruct`` values) of what :meth:`load` returns."""
        from flax import nnx

        return nnx.merge(self.graphdef, self.abstract_state)

    @classmethod
    def of_config(cls, cfg: ModelConfig, *, mesh=None, dtype: Any = None, param_dtype: Any = "float32",
                  remat: str | None = None, allow_config_mismatch: bool = False, lora_rules: list[dict] | None = None,
                  seed: int = 0) -> TunixModelPlan:
        """The plan of a model of config ``cfg`` with no checkpoint behind it: for its shapes, its
        programs and their memory (nothing to :meth:`load`)."""
        pdtype = np.dtype(param_dtype)
        tcfg = tunix_model_config(cfg, dtype=dtype, param_dtype=pdtype, remat=remat,
                                  allow_config_mismatch=allow_config_mismatch)
        return cls("(config)", cfg, get_family(cfg.family), tcfg, pdtype, mesh, lora_rules, seed)

    def weights_bytes(self) -> int:
        """Bytes of the base parameters on the device(s): the files' parameters in the parameter
        dtype, or, quantized (QLoRA), their quantized values (4-bit ones at half a byte) and scales."""
        if self.quantized():
            import jax
            from flax import nnx

            base = nnx.state(self.abstract_model(), lambda path, var: not _not_base(path, var))
            return sum(int(np.prod(x.shape, dtype=np.int64)) * _bits(x.dtype) // 8 for x in jax.tree.leaves(base))
        entries = self.source.entries if self.source is not None else mapping.entries(self.model_config, self.spec, "")
        return sum(int(np.prod(e.tunix_shape, dtype=np.int64)) * self.param_dtype.itemsize for e in entries)

    def _shardings(self, state) -> dict | None:
        from flax import nnx

        if self.mesh is None:
            return None
        return nnx.get_named_sharding(state, self.mesh).to_pure_dict()

    def load(self, *, workers: int | None = None, memory_budget: int | str | None = None,
             progress: bool | None = False):
        """The model with the checkpoint's weights. Each tensor is read, rearranged, cast and placed
        straight onto its sharding by one of ``workers`` threads (default: the usable cores), at
        most ``memory_budget`` host bytes in flight (default :data:`LOAD_MEMORY_BUDGET`; a tensor
        larger than that goes alone), so that reads from disk, host copies and transfers to the
        chips overlap. LoRA factors (and other state the files do not hold) get their initial
        values from one compiled program, made while the weights load, not from running the model
        op by op."""
        import concurrent.futures

        import jax

        from ckptbridge import options, stream
        from ckptbridge.progress import Progress

        if self.source is None:
            raise UnsupportedError("this model plan was made from a config: it has no weights to load")
        budget = options.parse_size(memory_budget if memory_budget is not None else LOAD_MEMORY_BUDGET)
        pure = self.abstract_state.to_pure_dict()
        shardings = self._shardings(self.abstract_state)
        source, pdtype = self.source, self.param_dtype
        default_device = jax.devices()[0]
        quantize = qlora_base.Quantizer(self.abstract_model()) if self.quantized() else None
        stored_parts = getattr(source, "quantized_parts", None)  # a QLoRA base stored quantized

        def place(e: mapping.Entry):
            target = _lookup(pure, e.tunix_path)
            parts = isinstance(target, dict)  # a QLoRA base weight: qwix's QArray (qvalue, scale)
            held = stored_parts(e) if stored_parts is not None else None
            if held is not None:
                if not parts:
                    raise ConfigError(f"{self.src}: {e.tunix_name} is stored quantized, but this run's LoRA rules "
                                      "hold it as it is: train with targets that cover every quantized module "
                                      f"({', '.join(getattr(source, 'base_quant', {}).get('targets') or [])})")
                assert quantize is not None
                want = quantize.produces(_real_path(pure, e.tunix_path), target["array"]["qvalue"].shape, pdtype)
                return _place_parts(e, want, held, _lookup(shardings, e.tunix_path) if shardings is not None
                                    else default_device)
            if parts:
                target = target["array"]["qvalue"]
            device = _lookup(shardings, e.tunix_path) if shardings is not None else default_device
            one = _one_device(device) if not parts and source.format == "hf" and e.hf_keys and e.rule.stack is None \
                else None
            if one is not None:  # the HF tensors as the files hold them, rearranged and cast by the device
                dst = mapping.layout_with_shape(e, tuple(target.shape)) or e.tunix_layout
                placed = _put_rearranged(e, source.arrays(e, mapped=True), dst, device, one, pdtype)
                if tuple(placed.shape) != tuple(target.shape):
                    raise UnsupportedError(
                        f"{e.tunix_name}: Tunix expects {tuple(target.shape)}, the map gives {placed.shape}")
                placed.block_until_ready()
                return placed
            # over the mapped files: a tensor whose layout stays goes from the page cache to the
            # device with no host copy (on a TPU VM, 3.6x faster than reading into fresh memory)
            value = np.asarray(source.tunix_value(e, mapped=True))
            lay = mapping.layout_with_shape(e, tuple(target.shape))
            if lay is not None and lay != e.tunix_layout:  # the installed Tunix lays this out otherwise
                value = layout.rearrange(value, e.tunix_layout, lay, e.sizes)
            if tuple(value.shape) != tuple(target.shape):
                raise UnsupportedError(
                    f"{e.tunix_name}: Tunix expects {tuple(target.shape)}, the map gives {value.shape}")
            if parts:  # quantized on the host's cores, then each part placed on its sharding
                assert quantize is not None
                q = quantize(e.tunix_path, _real_path(pure, e.tunix_path), value.astype(pdtype, copy=False))
                placed_parts = jax.tree.map(_put_packed, q, device) if isinstance(device, dict) else \
                    jax.tree.map(lambda x: _put_packed(x, device), q)
                jax.block_until_ready(placed_parts)
                return placed_parts
            if shardings is not None:
                _check_divisible(e.tunix_name, value.shape, device)
            placed = put(value, device, pdtype)
            placed.block_until_ready()  # the host bytes are free once the job ends
            return placed

        entries = source.entries
        sizes = [int(np.prod(e.tunix_shape, dtype=np.int64)) * pdtype.itemsize for e in entries]
        bar = Progress(sum(sizes), "load base", enabled=progress)
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lora-init") as init:
            rest = init.submit(self._init_not_base)
            try:
                # the allocator left as it is: a training process's own (XLA's) large buffers would
                # otherwise be mapped afresh at every step
                with stream.Engine(workers, budget, name="load", reuse_freed_memory=False) as engine:
                    for e, size, placed in zip(entries, sizes, engine.stream(
                            [(size, functools.partial(place, e)) for e, size in zip(entries, sizes)])):
                        _assign(pure, e.tunix_path, placed)
                        bar.update(size)
            finally:
                bar.close()
            _fill(pure, rest.result())
        missing = [".".join(map(str, p)) for p, v in _flat(pure) if isinstance(v, jax.ShapeDtypeStruct)]
        if missing:
            raise UnsupportedError(f"{self.src}: {len(missing)} Tunix parameters have no value ({missing[0]}, ...); "
                                   "the spec is incomplete")
        from flax import nnx

        return nnx.merge(self.graphdef, pure)

    def quantized(self) -> bool:
        """Whether the plan's LoRA rules store the base weights they match quantized (QLoRA)."""
        return quantizes(self.lora_rules)

    def _init_not_base(self) -> dict:
        """Initial values of what the files do not hold (LoRA factors), as a pure dict: one compiled
        program whose outputs are those alone (the base model it traces is left out by XLA)."""
        import jax
        from flax import nnx

        rest = nnx.state(self.abstract_model(), _not_base)
        if not len(nnx.to_flat_state(rest)):
            return {}
        build = self._build

        def init_lora_factors():
            return nnx.state(build(), _not_base).to_pure_dict()

        return jax.jit(init_lora_factors, out_shardings=self._shardings(rest))()

    def close(self) -> None:
        if self.source is not None:
            self.source.close()

    def __enter__(self) -> TunixModelPlan:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _one_device(where):
    """The device of a placement on one device (a device, or a sharding over one of this
    process's), else None."""
    import jax

    if isinstance(where, jax.Device):
        return where
    devices = getattr(where, "device_set", None)
    if devices is not None and len(devices) == 1 and getattr(where, "is_fully_addressable", True):
        return next(iter(devices))
    return None


@functools.cache
def _rearranging(view: tuple, order: tuple, out_shape: tuple, dtype: str, stacked: bool, sharding):
    """The compiled rearrangement of HF tensors into a Tunix parameter (``layout.steps``), cast to
    ``dtype``, onto ``sharding``: one program per shape, shared by the weights that have it."""
    import jax
    import jax.numpy as jnp

    def rearrange(*xs):
        x = jnp.stack(xs) if stacked else xs[0]
        return jnp.transpose(x.reshape(view), order).reshape(out_shape).astype(dtype)

    return jax.jit(rearrange, out_shardings=sharding)


def _put_rearranged(e: mapping.Entry, arrays: list[np.ndarray], lay: str, where, device, pdtype):
    """``e``'s parameter placed on ``where`` (on the one ``device``) from its HF tensors as stored
    (views of the mapped files): they go to the device as they are, and the device rearranges and
    casts them (the host copies nothing; on a TPU its transposes cost next to nothing)."""
    import jax

    single = jax.sharding.SingleDeviceSharding(device)
    view, order, out_shape = layout.steps(e.hf_stacked_layout, lay, e.sizes)
    xs = [jax.device_put(a, single) for a in arrays]
    sharding = single if isinstance(where, jax.Device) else where
    return _rearranging(view, order, out_shape, np.dtype(pdtype).name, bool(e.rule.stack_axis), sharding)(*xs)


def _place_parts(e: mapping.Entry, target: dict, held: tuple[np.ndarray, np.ndarray], device):
    """A weight of a QLoRA base stored quantized, placed as the QLoRA model holds it: its values
    and scales as stored (nothing computed on the host), each on its sharding. ``target``: the
    parts' shapes and dtypes that quantizing the weight in this run would give."""
    import jax

    qvalue, scale = held
    want = target["array"]
    for name, value in (("qvalue", qvalue), ("scale", scale)):
        if tuple(value.shape) != tuple(want[name].shape) or str(value.dtype) != str(want[name].dtype):
            raise ConfigError(f"{e.tunix_name}: stored {name} {value.dtype} {tuple(value.shape)}, this run's QLoRA "
                              f"model holds {want[name].dtype} {tuple(want[name].shape)}: the base was quantized "
                              "with other settings or another Tunix version; quantize it again")
    q = {"array": {"qvalue": qvalue, "scale": scale}}
    placed = jax.tree.map(_put_packed, q, device) if isinstance(device, dict) else \
        jax.tree.map(lambda x: _put_packed(x, device), q)
    jax.block_until_ready(placed)
    return placed


def quantizes(lora_rules: list[dict] | None) -> bool:
    """Whether qwix LoRA ``lora_rules`` hold the base weights they match quantized (QLoRA)."""
    return any(r.get("weight_qtype") for r in lora_rules or [])


# dtypes of 4-bit values (int4; nf4's bucket indices, uint4)
FOUR_BIT = ("int4", "uint4")


def _bits(dtype) -> int:
    return 4 if str(dtype) in FOUR_BIT else np.dtype(dtype).itemsize * 8


def _put_packed(value: np.ndarray, where):
    """:func:`put`, with 4-bit values (int4; nf4's uint4) packed two to a byte as the compiled
    programs take them: placed as 8-bit values, then narrowed on the device by a compiled cast
    (a host array of 4-bit values would arrive one to a byte)."""
    if str(value.dtype) not in FOUR_BIT:
        return put(value, where)
    wide = put(value.astype(np.int8 if str(value.dtype) == "int4" else np.uint8), where)
    return _narrowing(str(value.dtype), wide.sharding)(wide)


@functools.cache
def _narrowing(dtype: str, sharding):
    """The compiled cast to ``dtype`` on ``sharding``: one function for every weight placed so, so
    that weights of one shape share its program (a new function per weight compiled each anew)."""
    import jax

    return jax.jit(lambda v: v.astype(dtype), out_shardings=sharding)


def _real_path(tree: dict, path: tuple[str, ...]) -> tuple:
    """``path`` with the keys as the pure dict ``tree`` has them (list indices as ints)."""
    out, node = [], tree
    for k in path:
        key = _key(node, k)
        out.append(key)
        node = node[key]
    return tuple(out)


def put(value: np.ndarray, where, dtype: np.dtype | None = None):
    """``value`` (host memory, e.g. a mapped file's tensor) on a device or sharding, cast to ``dtype``.
    A sharding that spans other processes' devices (a run of several hosts) gets from this process
    only the slices of its own devices: only those are read and cast (from a mapped file, only
    their pages), and no process waits on another."""
    import jax

    if getattr(where, "is_fully_addressable", True):  # a device, or a sharding over this process's devices
        return jax.device_put(value.astype(dtype, copy=False) if dtype is not None else value, where)
    dtype = np.dtype(dtype if dtype is not None else value.dtype)
    return jax.make_array_from_callback(tuple(value.shape), where,
                                        lambda index: np.asarray(value[index]).astype(dtype, copy=False))


def _flat(tree: dict, prefix: tuple = ()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flat(v, (*prefix, k))
        else:
            yield (*prefix, k), v


def _fill(tree: dict, values: dict) -> None:
    """Put the leaves of ``values`` (a pure dict of part of ``tree``'s paths) into ``tree``."""
    for path, value in _flat(values):
        parent = tree
        for k in path[:-1]:
            parent = parent[k]
        parent[path[-1]] = value


def open_tunix_model(src: str, *, mesh=None, dtype: Any = None, param_dtype: Any = None, step: int | None = None,
                     skip_multimodal: bool = False, remat: str | None = None, allow_config_mismatch: bool = False,
                     lora_rules: list[dict] | None = None, seed: int = 0) -> TunixModelPlan:
    """Plan the family's Tunix model of ``src`` (HF directory or ckptbridge Orbax checkpoint): the
    checkpoint is opened and validated, nothing is read yet. ``lora_rules``
    ([{module_path, rank, alpha[, dropout]}, ...]) add qwix LoRA (initialised from ``seed``, as
    :func:`apply_lora_rules` does). See :func:`load_tunix_model` for the other parameters."""
    from ckptbridge.formats.hf import is_hf_directory, open_hf_source
    from ckptbridge.formats.tunix import open_orbax_source

    source = open_hf_source(src, skip_multimodal=skip_multimodal) if is_hf_directory(src) \
        else open_orbax_source(src, step=step)
    try:
        pdtype = np.dtype(param_dtype) if param_dtype is not None else source.dtype(source.entries[0])
        tcfg = tunix_model_config(source.cfg, dtype=dtype, param_dtype=pdtype, remat=remat,
                                  allow_config_mismatch=allow_config_mismatch)
        return TunixModelPlan(src, source.cfg, source.spec, tcfg, pdtype, mesh, lora_rules, seed, source=source)
    except BaseException:
        source.close()
        raise


def load_tunix_model(src: str, *, mesh=None, dtype: Any = None, param_dtype: Any = None,
                     step: int | None = None, skip_multimodal: bool = False, remat: str | None = None,
                     allow_config_mismatch: bool = False, workers: int | None = None, progress: bool | None = False):
    """The family's Tunix model with the weights of ``src`` (HF directory or ckptbridge Orbax checkpoint).

    Parameters keep the source dtype unless ``param_dtype`` is given; ``dtype`` is the compute
    dtype (default float32). With ``mesh``, each parameter is placed with Tunix's own sharding
    annotation as it is loaded. Returns ``(model, model_config)``.
    """
    with open_tunix_model(src, mesh=mesh, dtype=dtype, param_dtype=param_dtype, step=step,
                          skip_multimodal=skip_multimodal, remat=remat,
                          allow_config_mismatch=allow_config_mismatch) as plan:
        return plan.load(workers=workers, progress=progress), plan.config


def apply_lora_rules(model, rules: list[dict], *, seed: int = 0):
    """Wrap a Tunix model with qwix LoRA following ``rules`` ([{module_path, rank, alpha[, dropout]}, ...]).
    A rule with dropout > 0 drops LoRA inputs on every call (training only); its random stream is
    the model's ``qwix_rngs`` attribute (see :func:`ckptbridge.formats.qwix.dropout_stream`). qwix
    traces one forward of a few tokens to find the modules: to build a model with LoRA without
    running it op by op, give the rules to :func:`open_tunix_model` instead."""
    import jax.numpy as jnp

    t = tunix_spec(family_of_model(model)).trace_tokens
    inputs = (jnp.ones((1, t), jnp.int32), jnp.arange(t)[None], None, jnp.tril(jnp.ones((1, t, t), bool)))
    return qwix_lora.apply_lora(model, rules, inputs, seed=seed)


def load_tunix_lora_model(base: str, lora_root: str, *, step: int | None = None, mesh=None,
                          param_dtype: Any = None, rules: list[dict] | None = None,
                          allow_config_mismatch: bool = False):
    """The Tunix base model with qwix LoRA rebuilt from the rules recorded in a LoRA checkpoint root
    (as ``peft-to-orbax`` or the training package write them) and its factors restored with Tunix's
    own ``CheckpointManager.maybe_restore``. Returns ``(model, step, rules)``."""
    from tunix.sft.checkpoint_manager import CheckpointManager

    from ckptbridge.io.orbax import resolve_checkpoint, step_custom_metadata
    from ckptbridge.metadata import KEY, Metadata

    item = resolve_checkpoint(lora_root, step)
    meta = Metadata.from_json(step_custom_metadata(os.path.dirname(item)).get(KEY))
    rules = rules or (meta.lora.rules if meta.lora else None)
    if not rules:
        raise ConfigError(f"{lora_root}: no LoRA rules recorded; pass rules=[{{module_path, rank, alpha}}]")
    model, _ = load_tunix_model(base, mesh=mesh, param_dtype=param_dtype, skip_multimodal=True,
                                allow_config_mismatch=allow_config_mismatch)
    model = apply_lora_rules(model, rules)
    root = os.path.dirname(os.path.dirname(item))
    manager = CheckpointManager(os.path.abspath(root))
    try:
        restored, _ = manager.maybe_restore(model, step=int(os.path.basename(os.path.dirname(item))),
                                            restore_only_lora_params=True)
    finally:
        manager.close()
    return model, restored, rules


def load_tunix_adapter(base: str, src: str, *, step: int | None = None, alpha: float | None = None,
                       dtype: Any = np.float32, allow_config_mismatch: bool = False):
    """The Tunix base model with qwix LoRA for a LoRA checkpoint in any form ``orbax-to-peft``
    accepts (checkpoint-manager root, step, ``model_params``; rules recorded or ``alpha`` given):
    the qwix rules come from the checkpoint's validated ranks and alphas, the factors are read
    with ckptbridge's Orbax reader. For inference checks (float32 by default)."""
    import jax.numpy as jnp
    from flax import nnx

    from ckptbridge.formats.tunix_lora import open_orbax_lora
    from ckptbridge.lora.base import open_base
    from ckptbridge.lora.rules import rules_for

    b = open_base(base)
    with open_orbax_lora(src, b, step=step, alpha=alpha) as ad:
        rules = rules_for(ad.scaling, b.modules)
        model, _ = load_tunix_model(base, param_dtype=dtype, dtype=dtype, skip_multimodal=True,
                                    allow_config_mismatch=allow_config_mismatch)
        model = apply_lora_rules(model, rules)
        state = nnx.state(model, nnx.LoRAParam)
        pure = state.to_pure_dict()
        filled = 0
        for mod, factors in ad.module_factors():
            for leaf, value in zip(mod.leaves, factors):
                target = _lookup(pure, leaf)
                if tuple(target.shape) != tuple(value.shape):
                    raise UnsupportedError(f"{'/'.join(leaf)}: qwix made {tuple(target.shape)}, the checkpoint has "
                                           f"{value.shape}")
                _assign(pure, leaf, jnp.asarray(np.asarray(value, np.float32).astype(dtype)))
                filled += 1
    import jax

    leaves = len(jax.tree_util.tree_leaves(pure))
    if filled != leaves:
        raise UnsupportedError(f"{src}: filled {filled} of the {leaves} LoRA parameters qwix created")
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(model, state)
    return model
