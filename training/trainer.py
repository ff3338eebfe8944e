"""The LoRA SFT loop: the base family's Tunix model (loaded through ckptbridge) + qwix LoRA + optax AdamW, on a mesh.

Loss: next-token cross-entropy averaged over the loss tokens of a micro-batch; an optimizer
step averages the gradients of ``grad_accum`` micro-batches (so the reported step loss is the
mean of the micro-batch means, as in Tunix's PeftTrainer). Packed examples never see each
other: attention is block-diagonal by segment and positions restart per segment.

Checkpoints go through Tunix's own ``CheckpointManager`` (LoRA parameters + optimizer state), with
ckptbridge metadata (LoRA rules, base, family, step, tokens seen) and the data iterator's state
in the step's custom metadata, so a re-run resumes exactly where the last checkpoint was taken
and ``ckptbridge convert orbax-to-peft RUN_DIR/checkpoints ...`` needs no flags.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time

import numpy as np

from ckptbridge.metadata import KEY, LoraRules, Metadata, installed_tunix_version
from training import data as data_lib
from training.config import TrainConfig

log = logging.getLogger("training")


def lm_loss(model, batch: dict, loss_chunk: int = 0):
    """Mean next-token NLL over the loss tokens of ``batch`` (and their count).

    ``loss_chunk`` = 0: from the forward's logits (batch x sequence x vocab in float32 at once).
    ``loss_chunk`` = C > 0: the model (prepared by ``keep_hidden_states``) gives its final hidden
    states, and the output head, log-softmax and NLL run on C positions at a time, each chunk
    rematerialised in the backward pass: at most batch x C x vocab logits are alive, whatever the
    sequence. The same loss and gradients up to float32 summation order.
    """
    import jax.numpy as jnp

    from ckptbridge.tunix_model import forward, hidden_states

    tokens, seg, pos, lm = batch["tokens"], batch["segment_ids"], batch["positions"], batch["loss_mask"]
    mask = data_lib.attention_mask(seg, jnp)
    valid = (lm[:, 1:] > 0) & (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    count = valid.sum()
    targets = tokens[:, 1:]
    if loss_chunk:
        total = chunked_nll(model, hidden_states(model, tokens, pos, mask)[:, :-1], targets, valid, loss_chunk)
    else:
        logits = forward(model, tokens, pos, mask)
        total = jnp.where(valid, _nll(logits[:, :-1], targets), 0.0).sum()
    return total / jnp.maximum(count, 1), count


def _nll(logits, targets):
    import jax
    import jax.numpy as jnp

    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def chunked_nll(model, h, targets, valid, chunk: int):
    """Sum of the NLL of ``targets`` (B, T) where ``valid``, from final hidden states ``h`` (B, T, D)
    through ``model``'s output head, ``chunk`` positions at a time (a scan of rematerialised steps)."""
    import jax
    import jax.numpy as jnp

    from ckptbridge.tunix_model import head

    b, t, d = h.shape
    n = -(-t // chunk)
    pad = n * chunk - t
    if pad:
        h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
        valid = jnp.pad(valid, ((0, 0), (0, pad)))
    parts = (h.reshape(b, n, chunk, d).swapaxes(0, 1), targets.reshape(b, n, chunk).swapaxes(0, 1),
             valid.reshape(b, n, chunk).swapaxes(0, 1))

    @jax.checkpoint
    def one(h_c, t_c, v_c):
        return jnp.where(v_c, _nll(head(model, h_c), t_c), 0.0).sum()

    def step(total, part):
        return total + one(*part), None

    total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), parts)
    return total


@dataclasses.dataclass
class Run:
    """Paths of a run directory."""

    root: str

    @property
    def checkpoints(self) -> str:
        return os.path.join(self.root, "checkpoints")

    @property
    def config(self) -> str:
        return os.path.join(self.root, "config.json")

    @property
    def metrics(self) -> str:
        return os.path.join(self.root, "metrics.jsonl")

    @property
    def summary(self) -> str:
        return os.path.join(self.root, "run.json")

    @property
    def plot(self) -> str:
        return os.path.join(self.root, "loss.png")

    @property
    def compile_cache(self) -> str:
        return os.path.join(self.root, "compile_cache")


def train(cfg: TrainConfig, *, base: str, data_path: str, out: str, progress: bool | None = None) -> dict:
    """Train (or resume) a LoRA run. Returns the summary written to ``out/run.json``."""
    import jax
    import optax
    from flax import nnx
    from transformers import AutoTokenizer
    from tunix.sft.checkpoint_manager import CheckpointManager

    import orbax.checkpoint as ocp
    from ckptbridge import qwix_lora
    from ckptbridge.lora import open_base
    from ckptbridge.tunix_model import apply_lora_rules, check_config, keep_hidden_states, load_tunix_model
    from training import compiles, throughput
    from training.mesh import make_mesh

    t_start = time.perf_counter()
    compiles.watch()
    run = Run(out)
    base_info = open_base(base)
    check_config(base_info.cfg, cfg.allow_config_mismatch, warn=False)  # before anything is written
    lora_rules = cfg.lora_rules(base_info.spec.lora_targets)
    os.makedirs(run.root, exist_ok=True)
    settings = {**cfg.to_dict(), "base": os.path.abspath(base), "data": os.path.abspath(data_path)}
    _check_same_run(run, settings)
    with open(run.config, "w") as f:
        json.dump(settings, f, indent=2)
    if cfg.compile_cache != "off":  # before the first compilation
        cache = compiles.use_cache(cfg.compile_cache or run.compile_cache)
        log.info("compilation cache %s", cache)
    for key, value in settings.items():
        log.info("setting %s = %s", key, value)

    # data
    tokenizer = AutoTokenizer.from_pretrained(base)
    rows = data_lib.read_rows(data_path)
    encoded = data_lib.encode_rows(tokenizer, rows, cfg.max_length)
    if not encoded.examples:
        from ckptbridge.errors import ConfigError

        raise ConfigError(f"{data_path}: no row fits max_length={cfg.max_length} ({encoded.dropped_too_long} too long)")
    pipe_args = dict(seq_len=cfg.max_length, batch=cfg.micro_batch, packing=cfg.packing, seed=cfg.seed,
                     epochs=cfg.epochs, num_packing_bins=cfg.num_packing_bins)
    micro_batches, real_tokens = data_lib.count_batches(encoded.examples, **pipe_args)
    total_steps = max(1, micro_batches // cfg.grad_accum)
    if cfg.max_steps:
        total_steps = min(total_steps, cfg.max_steps)
    log.info("data: %d rows, %d encoded (%d dropped over %d tokens, %d empty), %d tokens; %d micro-batches -> "
             "%d optimizer steps; real-token fraction %.3f", encoded.rows, len(encoded.examples),
             encoded.dropped_too_long, cfg.max_length, encoded.dropped_empty, encoded.tokens, micro_batches,
             total_steps, real_tokens / max(1, micro_batches * cfg.micro_batch * cfg.max_length))

    # model
    mesh = make_mesh(cfg.fsdp, cfg.tp, base_info.cfg)
    if base_info.cfg.towers:
        log.info("base has %s towers: training the text model (Tunix builds it alone)", ", ".join(base_info.cfg.towers))
    model, _ = load_tunix_model(base, mesh=mesh, param_dtype=cfg.param_dtype, dtype=cfg.dtype,
                                remat=None if cfg.remat == "none" else cfg.remat, skip_multimodal=True,
                                allow_config_mismatch=cfg.allow_config_mismatch)
    rules = [dict(r, dropout=cfg.dropout) for r in lora_rules]
    model = apply_lora_rules(model, rules, seed=cfg.seed)
    if cfg.loss_chunk:
        keep_hidden_states(model)
    replaced, total = qwix_lora.fix_lora_shardings(model, mesh)
    dropout_rngs = qwix_lora.dropout_stream(model, cfg.seed) if cfg.dropout > 0 else None
    log.info("mesh %s; LoRA factors: %d of %d sharded over it, %d replicated (their base annotation does not "
             "fit them)", dict(mesh.shape), total - replaced, total, replaced)
    lora_params = sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
    flops = throughput.lora_step_flops(base_info.cfg, base_info.spec, cfg.max_length, lora_params)
    chip = jax.devices()[0].device_kind
    peak = throughput.chip_peak_tflops(chip)
    log.info("model FLOPs per token %.3g (matmul weights %.3g, attention %.3g, LoRA %.3g); %d x %s%s",
             flops.total, flops.weights, flops.attention, flops.lora, mesh.devices.size, chip,
             f" at {peak:g} TFLOP/s bf16 each" if peak else " (no peak known: no MFU)")
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=min(cfg.warmup_steps, total_steps),
        decay_steps=max(total_steps, cfg.warmup_steps + 1), end_value=0.0)
    tx = optax.adamw(schedule, weight_decay=cfg.weight_decay)
    if cfg.max_grad_norm:
        tx = optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), tx)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)

    manager = CheckpointManager(os.path.abspath(run.checkpoints), options=ocp.CheckpointManagerOptions(
        max_to_keep=cfg.keep_checkpoints, create=True, enable_async_checkpointing=False))
    step, meta = manager.maybe_restore(model, optimizer, restore_only_lora_params=True)
    state = Metadata.from_json((meta or {}).get(KEY))
    tokens_seen = state.tokens_seen or 0
    if step:
        log.info("resumed from step %d (%d tokens seen)", step, tokens_seen)
        _truncate_metrics(run.metrics, step)
    iterator = data_lib.iterate(data_lib.pipeline(encoded.examples, **pipe_args), state.data_state)
    # Every variable on its annotated sharding before the first step, where apply_step leaves them
    # after each: a freshly built or restored optimizer holds its scalars (step and Adam counts)
    # unplaced, and the second step would otherwise see other input shardings and compile again.
    placed = nnx.state((model, optimizer))
    nnx.update((model, optimizer), jax.device_put(placed, nnx.get_named_sharding(placed, mesh)))
    del placed

    @nnx.jit
    def grad_step(model, batch):
        grad_fn = nnx.value_and_grad(lm_loss, argnums=nnx.DiffState(0, nnx.LoRAParam), has_aux=True)
        (loss, count), grads = grad_fn(model, batch, cfg.loss_chunk)
        return loss, count, grads

    @nnx.jit
    def apply_step(model, optimizer, acc, n):
        # one program per step: eager op-by-op work on sharded arrays (e.g. a global norm)
        # dispatches many small programs with collectives, which can deadlock CPU device threads
        grads = jax.tree.map(lambda g: g / n, acc)
        grad_norm = optax.global_norm(grads)
        optimizer.update(model, grads)
        # keep every variable on its annotated sharding, so that the next step's programs see the
        # same layouts (no recompilation, no drift of the base weights' placement)
        state = nnx.state((model, optimizer))
        nnx.update((model, optimizer), jax.lax.with_sharding_constraint(state, nnx.get_named_sharding(state, mesh)))
        return grad_norm

    add = jax.jit(lambda a, b: jax.tree.map(lambda x, y: x + y, a, b))
    batch_sharding = _batch_sharding(mesh, cfg.micro_batch)

    def metadata(step: int) -> dict:
        return {KEY: Metadata(
            kind="lora", family=base_info.spec.name, lora=LoraRules(lora_rules, cfg.dropout),
            base=os.path.abspath(base), key_prefix=base_info.prefix, step=step, tokens_seen=tokens_seen,
            data_state=iterator.get_state(), tunix_version=installed_tunix_version(),
        ).to_json()}

    bar = _progress(total_steps, step, progress)
    seq_tokens = cfg.micro_batch * cfg.max_length
    first_step_seconds = None  # from the start of this session to the end of its first step
    with open(run.metrics, "a") as metrics_file:
        while step < total_steps:
            t0 = time.perf_counter()
            compiled_before = compiles.totals()
            acc, losses, real, loss_tokens = None, [], 0, 0
            for micro in range(cfg.grad_accum):
                try:
                    host = next(iterator)
                except StopIteration:
                    break
                if dropout_rngs is not None:
                    qwix_lora.reseed(dropout_rngs, cfg.seed, step * cfg.grad_accum + micro)
                real += int((host["segment_ids"] > 0).sum())
                batch = jax.device_put({k: np.asarray(v, np.int32) for k, v in host.items()}, batch_sharding)
                loss, count, grads = grad_step(model, batch)
                acc = grads if acc is None else add(acc, grads)
                losses.append(float(loss))
                loss_tokens += int(count)
            if acc is None:
                break
            lr = float(schedule(step))
            grad_norm = float(apply_step(model, optimizer, acc, np.float32(len(losses))))
            # finish this step before the next is dispatched: step times are then real, and
            # programs with collectives never overlap (which can deadlock CPU device threads)
            jax.block_until_ready(nnx.state(model, nnx.LoRAParam))
            step += 1
            tokens_seen += real
            dt = time.perf_counter() - t0
            compiled = compiles.totals().since(compiled_before)
            record = {"step": step, "loss": float(np.mean(losses)), "grad_norm": grad_norm, "lr": lr,
                      "tokens": real, "loss_tokens": loss_tokens, "tokens_per_s": real / dt,
                      "real_token_fraction": real / (seq_tokens * len(losses)), "seconds": dt,
                      "tokens_seen": tokens_seen, "compiles": compiled.compiles,
                      "compile_seconds": round(compiled.seconds, 3), "compile_cache_hits": compiled.cache_hits,
                      "since_start_seconds": round(time.perf_counter() - t_start, 3),
                      "mfu": throughput.mfu(flops.total, real / dt, mesh.devices.size, peak)}
            if first_step_seconds is None:
                first_step_seconds = record["since_start_seconds"]
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
            _report(bar, record, cfg.log_every, total_steps)
            if step % cfg.checkpoint_every == 0 or step == total_steps:
                manager.save(step, model, optimizer, save_only_lora_params=True, force=True,
                             custom_metadata=metadata(step))
    if bar is not None:
        bar.close()
    manager.close()
    hardware = {"chip": chip, "chips": int(mesh.devices.size), "peak_tflops_per_chip": peak,
                "flops_per_token": flops.total, "peak_memory_bytes": _peak_memory()}
    summary = _summarize(run, cfg, encoded, total_steps, time.perf_counter() - t_start, first_step_seconds, hardware)
    return summary


def _check_same_run(run: Run, settings: dict) -> None:
    """A run directory belongs to one base, dataset and recipe: resuming with others is refused."""
    if not os.path.isfile(run.config) or not os.path.isdir(run.checkpoints):
        return
    with open(run.config) as f:
        old = json.load(f)
    keys = ("base", "data", "rank", "alpha", "targets", "max_length", "packing", "seed", "micro_batch",
            "grad_accum", "epochs")
    changed = [k for k in keys if old.get(k) != settings.get(k)]
    if changed:
        from ckptbridge.errors import ConfigError

        raise ConfigError(f"{run.root}: holds a run with other settings ({', '.join(changed)}); "
                          "use a new --out directory to start another run")


def _batch_sharding(mesh, micro_batch: int):
    from jax.sharding import NamedSharding, PartitionSpec

    axis = "fsdp" if micro_batch % mesh.shape["fsdp"] == 0 else None
    return NamedSharding(mesh, PartitionSpec(axis))


def _truncate_metrics(path: str, step: int) -> None:
    """Drop metric lines past the checkpoint a run resumes from (they will be logged again)."""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        keep = [line for line in _whole_lines(f) if json.loads(line).get("step", 0) <= step]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
    os.replace(tmp, path)  # whole lines only, for anything reading the file meanwhile


def _progress(total: int, start: int, enabled: bool | None):
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="train", unit="step", file=sys.stderr)


def _report(bar, record: dict, every: int, total: int) -> None:
    if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
    elif record["step"] % every == 0 or record["step"] == total:
        log.info("step %d/%d loss %.4f grad_norm %.3f lr %.2e tokens/s %.0f real %.3f", record["step"], total,
                 record["loss"], record["grad_norm"], record["lr"], record["tokens_per_s"],
                 record["real_token_fraction"])


def _whole_lines(f) -> list[str]:
    """The non-empty lines of a metrics file that end in a newline: a line cut short by a kill, or
    one being written while another process reads, has none yet."""
    return [line for line in f if line.endswith("\n") and line.strip()]


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in _whole_lines(f)]


def _peak_memory() -> int | None:
    """Peak bytes in use on the first device (GPU, TPU); None where jax keeps no count (CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def _summarize(run: Run, cfg: TrainConfig, encoded, total_steps: int, wall: float,
               first_step_seconds: float | None, hardware: dict) -> dict:
    records = read_metrics(run.metrics) if os.path.isfile(run.metrics) else []
    steady_steps = [r for r in records if not r.get("compiles")]  # steps that compiled nothing
    steady = [r["tokens_per_s"] for r in steady_steps]
    steady_mfu = [r["mfu"] for r in steady_steps if r.get("mfu") is not None]
    tokens = sum(r["tokens"] for r in records)
    capacity = sum(r["tokens"] / r["real_token_fraction"] for r in records if r["real_token_fraction"])
    train_seconds = sum(r["seconds"] for r in records)
    summary = {
        "steps": records[-1]["step"] if records else 0,
        "total_steps": total_steps,
        "final_loss": records[-1]["loss"] if records else None,
        "first_loss": records[0]["loss"] if records else None,
        "tokens": tokens,
        "real_token_fraction": tokens / capacity if capacity else None,
        "train_seconds": train_seconds,
        "tokens_per_s": tokens / train_seconds if train_seconds else None,
        "steady_tokens_per_s": float(np.median(steady)) if steady else None,
        "steady_step_seconds": float(np.median([r["seconds"] for r in steady_steps])) if steady_steps else None,
        "steady_mfu": float(np.median(steady_mfu)) if steady_mfu else None,
        **hardware,
        "compile_seconds": round(sum(r.get("compile_seconds", 0.0) for r in records), 3),
        "first_step_seconds_this_session": first_step_seconds,
        "wall_seconds_this_session": wall,
        "usd_per_hour": cfg.usd_per_hour,
        "cost_usd": cfg.usd_per_hour * train_seconds / 3600,
        "rows": encoded.rows,
        "examples": len(encoded.examples),
        "dropped_too_long": encoded.dropped_too_long,
        "dropped_empty": encoded.dropped_empty,
        "packing": cfg.packing,
        "checkpoints": os.path.abspath(run.checkpoints),
    }
    with open(run.summary, "w") as f:
        json.dump(summary, f, indent=2)
    if records:
        _plot(records, run.plot)
    return summary


def _plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], lw=1.5)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean over loss tokens)")
    ax.set_title("LoRA SFT loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

