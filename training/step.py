"""The train step as two programs, compiled once per run before the first step.

* ``train_grad_step(lora, frozen, acc, batch, index) -> (acc + grads, loss, loss tokens)``: one
  micro-batch's loss and LoRA gradients, added to the accumulator (donated: updated in place).
* ``train_apply_step(lora, frozen, opt, acc, n) -> (lora, opt, zeroed acc, grad norm, lr)``: the
  optimizer update from the mean of ``n`` accumulated gradients (LoRA factors, optimizer state and
  accumulator donated).

The model is split once into its LoRA factors (``lora``), everything else (``frozen``: the base
weights, LoRA dropout's random stream) and the optimizer's state. The frozen part is an input of
both programs and an output of neither, so no program holds a second copy of the base weights,
and every input and output has the sharding it was compiled with (``in_shardings`` =
``out_shardings``): a step's outputs are the next step's inputs as they are, so nothing compiles
again. The programs are compiled ahead of time (:func:`compile_programs`) from the shapes alone,
so compilation can run while the weights load, and XLA's memory analysis of each is known
before anything runs. LoRA dropout reseeds from ``index`` (= optimizer step x grad_accum +
micro-batch) inside the step, so a resumed run draws the same masks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass
class StepState:
    """The arrays the programs take and give back, on their compiled shardings."""

    lora: Any
    frozen: Any
    opt: Any
    acc: Any


@dataclasses.dataclass
class Programs:
    """The compiled step programs and what XLA says of their memory."""

    grad: Any
    apply: Any
    memory: dict[str, dict]

    def peak_bytes(self) -> int:
        """The most device memory one of the programs needs (arguments, outputs and temporaries,
        less what outputs reuse of donated arguments)."""
        return max(m["peak_bytes"] for m in self.memory.values())


def optimizer_of(cfg, total_steps: int):
    """``(tx, schedule)``: AdamW with linear warmup then cosine decay to 0 over ``total_steps``
    (global-norm clipping first when ``cfg.max_grad_norm``)."""
    import optax

    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=min(cfg.warmup_steps, total_steps),
        decay_steps=max(total_steps, cfg.warmup_steps + 1), end_value=0.0)
    tx = optax.adamw(schedule, weight_decay=cfg.weight_decay)
    if cfg.max_grad_norm:
        tx = optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), tx)
    return tx, schedule


def for_training(model, cfg, model_cfg):
    """What the training step needs of a LoRA model (concrete or abstract) of ``model_cfg``: its
    decoder layers rematerialised as ``cfg.remat`` says (:mod:`training.remat`), its final hidden
    states kept (the loss in chunks) and LoRA dropout's random stream."""
    from ckptbridge.formats import qwix as qwix_lora
    from ckptbridge.tunix_model import family_of_model, keep_hidden_states, tunix_spec
    from training import remat

    rank = max(int(r["rank"]) for r in cfg.lora_rules(family_of_model(model).lora_targets))
    remat.apply(model, tunix_spec(family_of_model(model)).layers, cfg.remat, max_rank=rank,
                ffn_width=model_cfg.intermediate_size)
    if cfg.loss_chunk:
        keep_hidden_states(model)
    if cfg.dropout > 0:
        qwix_lora.dropout_stream(model, cfg.seed)
    return model


@dataclasses.dataclass
class Planned:
    """The programs' arguments as planned from a model plan, before any weight is loaded."""

    graphdef: Any
    opt_graphdef: Any
    abstract: StepState
    shardings: dict[str, Any]

    def compile(self, cfg, schedule, processes: int = 1) -> Programs:
        """The programs for a micro-batch of ``cfg.micro_batch`` rows from each of ``processes``."""
        return compile_programs(self.graphdef, self.opt_graphdef, self.abstract, self.shardings,
                                micro_batch=cfg.micro_batch * processes, seq_len=cfg.max_length,
                                loss_chunk=cfg.loss_chunk,
                                schedule=schedule, dropout_seed=cfg.seed if cfg.dropout > 0 else None)


def plan_step(plan, cfg, tx, batch_sharding) -> Planned:
    """The step programs' arguments (abstract) and shardings for the model of ``plan`` (a
    :class:`ckptbridge.tunix_model.TunixModelPlan` with the run's LoRA rules and mesh)."""
    from flax import nnx

    abstract = for_training(plan.abstract_model(), cfg, plan.model_config)
    abstract_opt = nnx.eval_shape(lambda m: new_optimizer(m, tx), abstract)
    graphdef, lora, frozen, opt_graphdef, opt = split(abstract, abstract_opt)
    return Planned(graphdef, opt_graphdef, StepState(lora, frozen, opt, lora),
                   shardings_of(lora, frozen, opt, plan.mesh, batch_sharding))


def batch_sharding(mesh, micro_batch: int):
    """Micro-batches split over the mesh's fsdp axis where it divides them, else replicated."""
    from jax.sharding import NamedSharding, PartitionSpec

    axis = "fsdp" if micro_batch % mesh.shape["fsdp"] == 0 else None
    return NamedSharding(mesh, PartitionSpec(axis))


def analyze(model_cfg, cfg, mesh, lora_rules: list[dict], processes: int = 1) -> tuple[Programs, Any]:
    """The step programs of training ``model_cfg`` (a :class:`ckptbridge.config.ModelConfig`) with
    the settings ``cfg`` on ``mesh`` (its devices on ``processes`` hosts, each feeding
    ``cfg.micro_batch`` rows), compiled from shapes alone (no weight is allocated: this runs on a
    CPU for any model size, and on a TPU topology without its chips). Returns the programs and the
    model plan."""
    from ckptbridge.tunix_model import TunixModelPlan
    from training.remat import tunix_remat

    rules = [dict(r, dropout=cfg.dropout) for r in lora_rules]
    plan = TunixModelPlan.of_config(model_cfg, mesh=mesh, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                                    remat=tunix_remat(cfg.remat),
                                    allow_config_mismatch=cfg.allow_config_mismatch, lora_rules=rules, seed=cfg.seed)
    tx, schedule = optimizer_of(cfg, 1000)
    planned = plan_step(plan, cfg, tx, batch_sharding(mesh, cfg.micro_batch * processes))
    return planned.compile(cfg, schedule, processes), plan


def split(model, optimizer) -> tuple[Any, Any, Any, Any, Any]:
    """``(graphdef, lora, frozen, opt_graphdef, opt_state)`` of a LoRA model and its optimizer."""
    from flax import nnx

    graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
    opt_graphdef, opt = nnx.split(optimizer)
    return graphdef, lora, frozen, opt_graphdef, opt


def new_optimizer(model, tx):
    """The optimizer of a LoRA model (AdamW over its LoRA factors), its moments in float32 whatever
    the factors' dtype: the mean gradient is float32 (the accumulated sum over n), so moments that
    started in bfloat16 would turn float32 at the first update, and the next step would see other
    argument types (and compile again). Zeros are zeros in either dtype: the same updates."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
    as32 = jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, lora)
    return nnx.Optimizer(nnx.merge(graphdef, as32, rest), tx, wrt=nnx.LoRAParam)


def shardings_of(lora, frozen, opt, mesh, batch_sharding) -> dict[str, Any]:
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    lora_sh = nnx.get_named_sharding(lora, mesh)
    return {"lora": lora_sh, "frozen": nnx.get_named_sharding(frozen, mesh), "opt": nnx.get_named_sharding(opt, mesh),
            "acc": lora_sh, "batch": batch_sharding, "scalar": NamedSharding(mesh, PartitionSpec())}


def _abstract(tree, shardings):
    import jax

    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _unpacked_4bit(tree) -> bool:
    """Whether ``tree`` (abstract arrays with shardings) has 4-bit arrays (a QLoRA base's int4 or
    nf4 values) on a backend that holds them one to a byte (XLA:CPU). A program compiled ahead of
    time from their shapes asks for them packed and refuses such arrays; ``jax.jit`` called with
    them compiles for what they are."""
    import jax

    from ckptbridge.tunix_model import FOUR_BIT

    four = [x for x in jax.tree.leaves(tree) if str(getattr(x, "dtype", "")) in FOUR_BIT]
    return bool(four) and not _packs_4bit(four[0].sharding)


def _packs_4bit(sharding) -> bool:
    """Whether arrays of 4-bit values on ``sharding``'s devices are packed two to a byte."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    platform = next(iter(sharding.device_set)).platform
    if platform not in _PACKS:
        try:
            device = jax.local_devices(backend=platform)[0]
        except RuntimeError:  # a TPU slice compiled for without its chips: nothing runs here
            return True
        probe = jax.jit(lambda: jnp.zeros((2, 2), jnp.int4), out_shardings=SingleDeviceSharding(device))()
        _PACKS[platform] = probe.format.layout.sub_byte_element_size_in_bits == 4
    return _PACKS[platform]


_PACKS: dict[str, bool] = {}


def step_functions(graphdef, opt_graphdef, *, loss_chunk: int, schedule, dropout_seed: int | None):
    """The two step functions (plain Python, for ``jax.jit``)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from ckptbridge.formats import qwix as qwix_lora
    from training.loss import lm_loss

    def train_grad_step(lora, frozen, acc, batch, index):
        model = nnx.merge(graphdef, lora, frozen)
        if dropout_seed is not None:
            qwix_lora.reseed(qwix_lora.dropout_rngs(model), dropout_seed, index)
        grad_fn = nnx.value_and_grad(lm_loss, argnums=nnx.DiffState(0, nnx.LoRAParam), has_aux=True)
        (loss, count), grads = grad_fn(model, batch, loss_chunk)
        return jax.tree.map(jnp.add, acc, grads), loss, count

    def train_apply_step(lora, frozen, opt, acc, n):
        model = nnx.merge(graphdef, lora, frozen)
        optimizer = nnx.merge(opt_graphdef, opt)
        lr = schedule(optimizer.step[...].astype(jnp.int32))
        grads = jax.tree.map(lambda g: g / n, acc)  # float32, as n: the mean and its norm in float32
        grad_norm = optax.global_norm(grads)
        optimizer.update(model, grads)
        zeros = jax.tree.map(jnp.zeros_like, acc)
        return nnx.state(model, nnx.LoRAParam), nnx.state(optimizer), zeros, grad_norm, lr

    return train_grad_step, train_apply_step


def compile_programs(graphdef, opt_graphdef, abstract: StepState, shardings: dict[str, Any], *, micro_batch: int,
                     seq_len: int, loss_chunk: int, schedule, dropout_seed: int | None) -> Programs:
    """Compile both programs for the shapes and shardings of ``abstract`` (arrays or
    ``jax.ShapeDtypeStruct``: nothing is allocated). Raises what XLA raises (e.g. the chip's memory
    exceeded)."""
    import concurrent.futures

    import jax
    import jax.numpy as jnp

    grad_fn, apply_fn = step_functions(graphdef, opt_graphdef, loss_chunk=loss_chunk, schedule=schedule,
                                       dropout_seed=dropout_seed)
    sh = shardings
    lora, frozen, opt, acc = (_abstract(abstract.lora, sh["lora"]), _abstract(abstract.frozen, sh["frozen"]),
                              _abstract(abstract.opt, sh["opt"]), _abstract(abstract.acc, sh["acc"]))
    batch = {k: jax.ShapeDtypeStruct((micro_batch, seq_len), jnp.int32, sharding=sh["batch"])
             for k in ("tokens", "segment_ids", "positions", "loss_mask")}
    scalar = sh["scalar"]
    grad = jax.jit(grad_fn, in_shardings=(sh["lora"], sh["frozen"], sh["acc"], sh["batch"], scalar),
                   out_shardings=(sh["acc"], scalar, scalar), donate_argnums=(2,))
    apply = jax.jit(apply_fn, in_shardings=(sh["lora"], sh["frozen"], sh["opt"], sh["acc"], scalar),
                    out_shardings=(sh["lora"], sh["opt"], sh["acc"], scalar, scalar), donate_argnums=(0, 2, 3))
    # the two at once: the apply program (a few seconds on a TPU) compiles while the gradient's does
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compile-apply") as side:
        apply_job = side.submit(lambda: apply.lower(
            lora, frozen, opt, acc, jax.ShapeDtypeStruct((), jnp.float32, sharding=scalar)).compile())
        grad_c = grad.lower(lora, frozen, acc, batch, jax.ShapeDtypeStruct((), jnp.int32, sharding=scalar)).compile()
        apply_c = apply_job.result()
    memory = {"train_grad_step": memory_of(grad_c), "train_apply_step": memory_of(apply_c)}
    if _unpacked_4bit(frozen):  # XLA:CPU and a 4-bit base: the jitted functions, compiled at the first step
        return Programs(grad, apply, memory)
    return Programs(grad_c, apply_c, memory)


def flops_of(compiled, tokens: int) -> float | None:
    """FLOPs per token of a compiled program by XLA's cost analysis (None where it gives none)."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # a function compiled at its first call (jit) or a backend without the analysis
        return None
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    flops = (cost or {}).get("flops")
    return None if not flops or flops < 0 else float(flops) / tokens


def memory_of(compiled) -> dict[str, int]:
    """XLA's memory analysis of a compiled program, in bytes (``peak_bytes``: arguments + outputs +
    temporaries - outputs aliasing donated arguments)."""
    m = compiled.memory_analysis()
    if m is None:
        return {}
    out = {k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0)
           for k in ("argument", "output", "temp", "alias", "generated_code")}
    out["peak_bytes"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    return out


def zeros_like(tree, shardings):
    """Zeros of ``tree``'s shapes and dtypes on ``shardings``, from host memory (no program compiled)."""
    import jax

    from ckptbridge.tunix_model import put

    return jax.tree.map(lambda x, s: put(np.zeros(x.shape, x.dtype), s), tree, shardings)


def batch_rows(sharding, shape: tuple[int, ...]) -> tuple[int, int]:
    """The rows ``lo:hi`` of a global micro-batch of ``shape`` that this process's devices hold
    under ``sharding`` (all of them on one process, or where the batch is replicated)."""
    spans = [_rows(i[0], shape[0]) for i in sharding.addressable_devices_indices_map(shape).values()]
    return min(a for a, _ in spans), max(b for _, b in spans)


def _rows(index: slice, n: int) -> tuple[int, int]:
    """The rows ``(start, stop)`` a device's slice of the batch axis (of ``n`` rows) covers."""
    return index.start or 0, n if index.stop is None else index.stop


def global_batch(local: dict, sharding, shape: tuple[int, ...], lo: int) -> dict:
    """The global micro-batch arrays of ``shape`` from this process's rows (``local``, from row
    ``lo`` on): each device gets its slice, and no process sends another anything."""
    import jax

    def array(value):
        value = np.asarray(value, np.int32)
        if sharding.is_fully_addressable:
            return jax.device_put(value, sharding)
        def rows(index):
            start, stop = _rows(index[0], shape[0])
            return value[(slice(start - lo, stop - lo), *index[1:])]

        return jax.make_array_from_callback(shape, sharding, rows)

    return {k: array(v) for k, v in local.items()}


def nbytes(tree) -> int:
    import jax

    return sum(int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
