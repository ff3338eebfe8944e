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

from ckptbridge.deps import installed_version
from ckptbridge.metadata import KEY, LoraRules, Metadata, installed_tunix_version
from training import data as data_lib
from training.config import TrainConfig

log = logging.getLogger("training")


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
    def sessions(self) -> str:
        return os.path.join(self.root, "sessions.jsonl")

    @property
    def encoded_data(self) -> str:
        return os.path.join(self.root, "encoded_data.npz")

    @property
    def compile_cache(self) -> str:
        return os.path.join(self.root, "compile_cache")


def train(cfg: TrainConfig, *, base: str, data_path: str, out: str, progress: bool | None = None) -> dict:
    """Train (or resume) a LoRA run. Returns the summary written to ``out/run.json``.

    Start-up: the model is planned from the base's config (shapes, shardings, qwix LoRA), the two
    step programs (:mod:`training.step`) are compiled from that plan on another thread while the
    base weights stream onto the mesh, and the first step waits for whichever ends last."""
    import concurrent.futures

    import jax
    import orbax.checkpoint as ocp
    from flax import nnx
    from tunix.sft.checkpoint_manager import CheckpointManager

    from ckptbridge.lora.base import open_base
    from ckptbridge.tunix_model import check_config, open_tunix_model
    from training import compiles, throughput
    from training import step as step_lib
    from training.mesh import make_mesh
    from training.remat import tunix_remat

    t_start = time.perf_counter()
    phases = {"before_train": _process_age()}  # seconds of this session's start, by phase
    compiles.watch()
    run = Run(out)
    base_info = open_base(base)
    cfg = with_base_quant(cfg, base, base_info.spec.lora_targets)
    check_config(base_info.cfg, cfg.allow_config_mismatch, warn=False)  # before anything is written
    check_tile(cfg, base_info.cfg)
    lora_rules = cfg.lora_rules(base_info.spec.lora_targets)
    # several processes (training/distributed.py): each feeds micro_batch rows of every global
    # micro-batch; process 0 writes the run's files, all of them write the checkpoints together
    processes, primary = jax.process_count(), jax.process_index() == 0
    os.makedirs(run.root, exist_ok=True)
    settings = {**cfg.to_dict(), "base": os.path.abspath(base), "data": os.path.abspath(data_path),
                "processes": processes}
    _check_same_run(run, settings)
    if primary:
        with open(run.config, "w") as f:
            json.dump(settings, f, indent=2)
    if cfg.compile_cache != "off":  # before the first compilation
        cache = compiles.use_cache(cfg.compile_cache or run.compile_cache)
        log.info("compilation cache %s", cache)
    for key, value in settings.items():
        log.info("setting %s = %s", key, value)

    # data
    t_data = time.perf_counter()
    encoded = data_lib.encoded_data(model_files(base), data_path, cfg.max_length, run.encoded_data)
    if not encoded.examples:
        from ckptbridge.errors import ConfigError

        raise ConfigError(f"{data_path}: no row fits max_length={cfg.max_length} ({encoded.dropped_too_long} too long)")
    global_rows = cfg.micro_batch * processes  # the global micro-batch
    pipe_args = dict(seq_len=cfg.max_length, batch=global_rows, packing=cfg.packing, seed=cfg.seed,
                     epochs=cfg.epochs, num_packing_bins=cfg.num_packing_bins)
    micro_batches, real_tokens = data_lib.count_batches(encoded.examples, **pipe_args)
    total_steps = max(1, micro_batches // cfg.grad_accum)
    if cfg.max_steps:
        total_steps = min(total_steps, cfg.max_steps)
    log.info("data: %d rows, %d encoded (%d dropped over %d tokens, %d empty), %d tokens; %d micro-batches -> "
             "%d optimizer steps; real-token fraction %.3f", encoded.rows, len(encoded.examples),
             encoded.dropped_too_long, cfg.max_length, encoded.dropped_empty, encoded.tokens, micro_batches,
             total_steps, real_tokens / max(1, micro_batches * global_rows * cfg.max_length))

    # model: planned, programs compiled from the plan while the weights load
    phases["data"] = time.perf_counter() - t_data
    t_plan = time.perf_counter()
    mesh = make_mesh(cfg.fsdp, cfg.tp, base_info.cfg)
    if base_info.cfg.towers:
        log.info("base has %s towers: training the text model (Tunix builds it alone)", ", ".join(base_info.cfg.towers))
    tx, schedule = step_lib.optimizer_of(cfg, total_steps)
    rules = [dict(r, dropout=cfg.dropout) for r in lora_rules]
    batch_sharding = step_lib.batch_sharding(mesh, global_rows)
    batch_shape = (global_rows, cfg.max_length)
    my_rows = step_lib.batch_rows(batch_sharding, batch_shape)
    compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compile")
    with open_tunix_model(base, mesh=mesh, param_dtype=cfg.param_dtype, dtype=cfg.dtype,
                          remat=tunix_remat(cfg.remat), skip_multimodal=True,
                          allow_config_mismatch=cfg.allow_config_mismatch, lora_rules=rules, seed=cfg.seed) as plan:
        planned = step_lib.plan_step(plan, cfg, tx, batch_sharding)
        graphdef, opt_graphdef, shardings = planned.graphdef, planned.opt_graphdef, planned.shardings
        lora_a, frozen_a, opt_a = planned.abstract.lora, planned.abstract.frozen, planned.abstract.opt
        programs_future = compiler.submit(_compile, planned, cfg, schedule, processes)
        replaced, total = plan.lora_annotations
        phases["plan"] = time.perf_counter() - t_plan
        t_load = time.perf_counter()
        try:
            model = plan.load(workers=cfg.load_workers, memory_budget=cfg.load_memory_budget, progress=progress)
        except BaseException:
            programs_future.cancel()
            compiler.shutdown(wait=True)
            raise
        load_seconds = time.perf_counter() - t_load
        weights_bytes = plan.weights_bytes()
    log.info("base loaded in %.1f s (%.2f GB, %.2f GB/s)", load_seconds, weights_bytes / 1e9,
             weights_bytes / 1e9 / max(load_seconds, 1e-9))
    model = step_lib.for_training(model, cfg, base_info.cfg)
    log.info("mesh %s; LoRA factors: %d of %d sharded over it, %d replicated (their base annotation does not "
             "fit them)", dict(mesh.shape), total - replaced, total, replaced)
    lora_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(lora_a))
    flops = throughput.lora_step_flops(base_info.cfg, base_info.spec, cfg.max_length, lora_params)
    chip = jax.devices()[0].device_kind
    peak = throughput.chip_peak_tflops(chip)
    log.info("model FLOPs per token %.3g (matmul weights %.3g, attention %.3g, LoRA %.3g); %d x %s%s",
             flops.total, flops.weights, flops.attention, flops.lora, mesh.devices.size, chip,
             f" at {peak:g} TFLOP/s bf16 each" if peak else " (no peak known: no MFU)")

    t_restore = time.perf_counter()  # the optimizer made, and the latest checkpoint restored
    _, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)

    def init_optimizer(lora, frozen):
        return nnx.state(step_lib.new_optimizer(nnx.merge(graphdef, lora, frozen), tx))

    optimizer = nnx.merge(opt_graphdef, jax.jit(init_optimizer, in_shardings=(shardings["lora"], shardings["frozen"]),
                                                out_shardings=shardings["opt"])(lora, frozen))

    manager = CheckpointManager(os.path.abspath(run.checkpoints), options=ocp.CheckpointManagerOptions(
        max_to_keep=cfg.keep_checkpoints, create=True, enable_async_checkpointing=False))
    step, meta = manager.maybe_restore(model, optimizer, restore_only_lora_params=True)
    state = Metadata.from_json((meta or {}).get(KEY))
    tokens_seen = state.tokens_seen or 0
    if step:
        log.info("resumed from step %d (%d tokens seen)", step, tokens_seen)
        if primary:
            _truncate_metrics(run.metrics, step)
    # every process iterates the same global order (so one saved data state serves them all) and
    # keeps the rows its devices take
    iterator = data_lib.iterate(data_lib.pipeline(encoded.examples, **pipe_args, rows=my_rows), state.data_state)
    # the programs' arguments, each on the sharding it was compiled with
    _, lora, frozen, _, opt = step_lib.split(model, optimizer)
    for name, real, want in (("LoRA factors", lora, lora_a), ("frozen state", frozen, frozen_a),
                             ("optimizer state", opt, opt_a)):
        if jax.tree.structure(real) != jax.tree.structure(want):
            raise RuntimeError(f"the loaded model's {name} differ from the planned ones the step was compiled for")
    args = step_lib.StepState(jax.device_put(lora, shardings["lora"]), frozen, jax.device_put(opt, shardings["opt"]),
                              step_lib.zeros_like(lora, shardings["acc"]))

    def sync_objects() -> None:
        """The model and optimizer objects (what checkpoints save) hold the programs' latest outputs."""
        nnx.update(model, args.lora)
        nnx.update(optimizer, args.opt)

    def metadata(step: int) -> dict:
        return {KEY: Metadata(
            kind="lora", family=base_info.spec.name, lora=LoraRules(lora_rules, cfg.dropout),
            base=os.path.abspath(base), key_prefix=base_info.prefix, step=step, tokens_seen=tokens_seen,
            data_state=iterator.get_state(), tunix_version=installed_tunix_version(), base_quant=base_quant,
        ).to_json()}

    base_quant = None if cfg.base_quant == "none" else {
        "scheme": cfg.base_quant, "tile": cfg.base_quant_tile, "param_dtype": cfg.param_dtype,
        "qwix_version": installed_version("qwix"), "base_digest": _base_digest(base)}
    phases["restore"] = time.perf_counter() - t_restore
    t_wait = time.perf_counter()
    try:
        programs = programs_future.result()
    finally:
        compiler.shutdown(wait=True)
    compile_wait = time.perf_counter() - t_wait
    memory = _memory_report(programs, weights_bytes, step_lib.nbytes(args.lora), step_lib.nbytes(args.opt))
    log.info("%s", _memory_line(memory))
    startup = compiles.totals()
    log.info("compiled %s; waited %.1f s for compilation after the load", ", ".join(
        f"{name} {row['seconds']:.1f} s" + (" (from the cache)" if row["cache_hits"] else "")
        for name, row in startup.by_program().items() if row["seconds"] >= 0.05) or "nothing", compile_wait)

    bar = _progress(total_steps, step, progress) if primary else None
    seq_tokens = global_rows * cfg.max_length
    first_step_seconds = None  # from the start of this session to the end of its first step
    start_step = step
    with open(run.metrics if primary else os.devnull, "a") as metrics_file:
        while step < total_steps:
            t0 = time.perf_counter()
            compiled_before = compiles.totals()
            losses, real, loss_tokens, filler = [], 0, 0, 0
            for micro in range(cfg.grad_accum):
                try:
                    host = next(iterator)
                except StopIteration:
                    break
                real += int(host.pop("real_tokens"))
                filler += int(host.pop("filler_rows"))
                batch = step_lib.global_batch(host, batch_sharding, batch_shape, my_rows[0])
                args.acc, loss, count = programs.grad(args.lora, args.frozen, args.acc, batch,
                                                      np.int32(step * cfg.grad_accum + micro))
                losses.append(loss)
                loss_tokens += int(count)
            if not losses:
                break
            args.lora, args.opt, args.acc, grad_norm, lr = programs.apply(args.lora, args.frozen, args.opt, args.acc,
                                                                          np.float32(len(losses)))
            # finish this step before the next is dispatched: step times are then real, and
            # programs with collectives never overlap (which can deadlock CPU device threads)
            grad_norm, lr = float(grad_norm), float(lr)
            losses = [float(x) for x in losses]
            step += 1
            tokens_seen += real
            dt = time.perf_counter() - t0
            compiled = compiles.totals().since(compiled_before)
            record = {"step": step, "loss": float(np.mean(losses)), "grad_norm": grad_norm, "lr": lr,
                      "tokens": real, "loss_tokens": loss_tokens, "tokens_per_s": real / dt,
                      "real_token_fraction": real / (seq_tokens * len(losses)), "seconds": dt,
                      "tokens_seen": tokens_seen, "filler_rows": filler, "compiles": compiled.compiles,
                      "compile_seconds": round(compiled.seconds, 3), "compile_cache_hits": compiled.cache_hits,
                      "since_start_seconds": round(time.perf_counter() - t_start, 3),
                      "mfu": throughput.mfu(flops.total, real / dt, mesh.devices.size, peak),
                      "session_step": step - start_step}
            if compiled.compiles:
                record["compiled_programs"] = sorted(compiled.programs)
                log.warning("step %d compiled %s: every program should be compiled before the first step", step,
                            ", ".join(sorted(compiled.programs)))
            new_session = first_step_seconds is None
            if new_session:
                first_step_seconds = record["since_start_seconds"]
                launch = _process_age()
                if launch is not None:
                    record["since_launch_seconds"] = round(launch, 3)
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
            if new_session and primary:  # what this session's start cost, kept even if it is killed later
                session = {"resumed_from_step": start_step, "launch_to_first_step_seconds": record.get(
                    "since_launch_seconds"), "start_to_first_step_seconds": first_step_seconds,
                    "load_seconds": round(load_seconds, 3),
                    "load_gb_per_s": round(weights_bytes / 1e9 / max(load_seconds, 1e-9), 3),
                    "compile_wait_seconds": round(compile_wait, 3), "programs": compiles.totals().by_program(),
                    "memory": memory, "device_peak_bytes_after_first_step": _peak_memory(), "first_step": record,
                    "phases": {k: round(v, 3) for k, v in {**phases, "load": load_seconds, "compile_wait": compile_wait,
                                                           "first_step": record["seconds"]}.items() if v is not None}}
                with open(run.sessions, "a") as f:
                    f.write(json.dumps(session) + "\n")
            _report(bar, record, cfg.log_every, total_steps)
            if step % cfg.checkpoint_every == 0 or step == total_steps:
                sync_objects()
                manager.save(step, model, optimizer, save_only_lora_params=True, force=True,
                             custom_metadata=metadata(step))
    if bar is not None:
        bar.close()
    sync_objects()
    manager.close()
    memory["device_peak_bytes"] = _peak_memory()
    hardware = {"chip": chip, "chips": int(mesh.devices.size), "peak_tflops_per_chip": peak,
                "flops_per_token": flops.total, "peak_memory_bytes": memory["device_peak_bytes"]}
    if not primary:  # process 0 writes the run's summary
        return {"process": jax.process_index(), "processes": processes, "steps": step, "total_steps": total_steps,
                "checkpoints": os.path.abspath(run.checkpoints)}
    first = next((r for r in read_metrics(run.metrics) if r.get("session_step") == 1 and r["step"] == start_step + 1),
                 {})
    session = {"launch_to_first_step_seconds": first.get("since_launch_seconds"), "load_seconds": round(load_seconds, 3),
               "load_gb_per_s": round(weights_bytes / 1e9 / max(load_seconds, 1e-9), 3),
               "compile_wait_seconds": round(compile_wait, 3), "programs": compiles.totals().by_program(),
               "memory": memory}
    summary = _summarize(run, cfg, encoded, total_steps, time.perf_counter() - t_start, first_step_seconds, hardware,
                         session)
    return summary


def _compile(planned, cfg: TrainConfig, schedule, processes: int):
    """The step programs, with the chip's memory exceeded said in one line."""
    from ckptbridge.errors import ConfigError

    try:
        return planned.compile(cfg, schedule, processes)
    except Exception as e:
        text = str(e)
        if "RESOURCE_EXHAUSTED" in text or "exceeds" in text and "memory" in text.lower():
            first = next((line.strip() for line in text.splitlines() if line.strip()), text)
            raise ConfigError(f"the train step does not fit the device memory ({first[:300]}); lower max_length or "
                              "micro_batch, use remat=decoder, or spread the model over more chips (fsdp, tp)") from None
        raise


def _memory_report(programs, weights: int, lora: int, opt: int) -> dict:
    """What XLA's analysis says each step program needs on one device, and what holds it."""
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    return {"programs": programs.memory, "step_peak_bytes": programs.peak_bytes(), "weights_bytes": weights,
            "lora_bytes": lora, "optimizer_bytes": opt, "device_limit_bytes": stats.get("bytes_limit")}


def _memory_line(memory: dict) -> str:
    grad = memory["programs"].get("train_grad_step", {})
    limit = memory.get("device_limit_bytes")
    gb = lambda n: f"{(n or 0) / 1e9:.2f} GB"  # noqa: E731
    return (f"memory per device: base weights {gb(memory['weights_bytes'])}, LoRA {gb(memory['lora_bytes'])} + "
            f"optimizer {gb(memory['optimizer_bytes'])}; grad step {gb(grad.get('peak_bytes'))} (temporaries "
            f"{gb(grad.get('temp'))})" + (f" of {gb(limit)}" if limit else ""))


def prequantized(base: str) -> dict | None:
    """The ``base_quant`` record of a QLoRA base stored quantized (``ckptbridge convert HF DST --to
    tunix --quantize``), None for any other base."""
    from ckptbridge.formats.hf import is_hf_directory

    if is_hf_directory(base) or not os.path.isdir(base):
        return None
    from ckptbridge.errors import CkptBridgeError
    from ckptbridge.io.orbax import OrbaxCheckpoint, resolve_checkpoint

    try:
        with OrbaxCheckpoint(resolve_checkpoint(base, None)) as ckpt:
            meta = ckpt.metadata
    except CkptBridgeError:
        return None
    return meta.base_quant if meta.kind == "weights" and meta.base_quant else None


def with_base_quant(cfg: TrainConfig, base: str, family_targets: tuple[str, ...]) -> TrainConfig:
    """``cfg`` on ``base``: on a QLoRA base stored quantized, its scheme and tile (a setting that
    disagrees, or LoRA targets that leave a quantized weight out, refused in one line)."""
    held = prequantized(base)
    if held is None:
        return cfg
    from ckptbridge.errors import ConfigError
    from ckptbridge.qlora_base import check_settings

    scheme, tile = check_settings(held, base, cfg.base_quant, cfg.base_quant_tile, cfg.param_dtype)
    left_out = [t for t in held.get("targets") or () if t not in (cfg.targets or family_targets)]
    if left_out:
        raise ConfigError(f"targets: {base} holds the weights of {', '.join(left_out)} quantized; train with targets "
                          "that include them (default: every LoRA target of the family), or on the HF model")
    log.info("base: a QLoRA base stored as qwix's %s arrays%s (base_quant read from it)", scheme,
             f" in tiles of {tile}" if tile else "")
    return dataclasses.replace(cfg, base_quant=scheme, base_quant_tile=tile)


def model_files(base: str) -> str:
    """Where ``base``'s tokenizer and other non-weight files are: the HF directory itself, or an
    Orbax checkpoint's stored copy of them."""
    from ckptbridge.formats.hf import is_hf_directory

    if is_hf_directory(base):
        return base
    from ckptbridge.formats.tunix import stored_assets
    from ckptbridge.io.orbax import resolve_checkpoint

    found = stored_assets(resolve_checkpoint(base, None))
    return found[1] if found else base


def _base_digest(base: str) -> str | None:
    """:func:`ckptbridge.merge.base_digest` of an HF base, the recorded one of the HF base a QLoRA
    base stored quantized was made from (None for another Orbax base)."""
    from ckptbridge.formats.hf import is_hf_directory, open_hf_source
    from ckptbridge.merge import base_digest

    if not is_hf_directory(base):
        return (prequantized(base) or {}).get("base_digest")
    with open_hf_source(base, skip_multimodal=True) as rows:
        return base_digest(rows)


def dry_run(cfg: TrainConfig, *, base: str, topology: str | None = None) -> dict:
    """Plan the run and compile its step programs from the base's config alone (no weight or data
    read; the base may be a directory with its config.json only), for the devices here or for a
    TPU slice named by ``topology`` (ahead of time, without its chips). Returns what XLA says each
    program needs per device and whether that fits the device's memory."""
    import jax

    from ckptbridge.errors import ConfigError
    from ckptbridge.lora.base import open_base
    from ckptbridge.tunix_model import check_config
    from training import compiles, step as step_lib
    from training.mesh import device_memory, make_mesh, topology_devices

    compiles.watch()
    if cfg.compile_cache not in ("", "off"):  # a shared cache (compile_cache=DIR): what a run compiled is loaded
        compiles.use_cache(cfg.compile_cache)
    info = open_base(base)
    cfg = with_base_quant(cfg, base, info.spec.lora_targets)
    check_config(info.cfg, cfg.allow_config_mismatch, warn=False)
    check_tile(cfg, info.cfg)
    devices = topology_devices(topology) if topology else jax.devices()
    mesh = make_mesh(cfg.fsdp, cfg.tp, info.cfg, devices)
    limit, limit_source = device_memory(devices[0])
    hosts = len({getattr(d, "process_index", 0) for d in devices})  # a slice of several hosts: one process each
    report = {"base": os.path.abspath(base), "layers": info.cfg.num_layers, "max_length": cfg.max_length,
              "micro_batch": cfg.micro_batch, "processes": hosts, "global_micro_batch": cfg.micro_batch * hosts,
              "rank": cfg.rank, "remat": cfg.remat, "device_kind": devices[0].device_kind, "devices": len(devices),
              "mesh": dict(mesh.shape), "device_memory_bytes": limit, "device_memory_source": limit_source}
    t = time.perf_counter()
    try:
        programs, plan = step_lib.analyze(info.cfg, cfg, mesh, cfg.lora_rules(info.spec.lora_targets), hosts)
    except ConfigError:
        raise
    except Exception as e:
        text = str(e)
        if "RESOURCE_EXHAUSTED" not in text and "out of memory" not in text.lower():
            raise
        line = next((ln.strip() for ln in text.splitlines() if "memory" in ln.lower()), text.splitlines()[0])
        return {**report, "fits": False, "compiler": line[:400], "compile_seconds": round(time.perf_counter() - t, 1)}
    from flax import nnx

    from training import throughput

    tokens = cfg.micro_batch * hosts * cfg.max_length  # of one micro-batch, every host's
    lora_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(plan.abstract_model(), nnx.LoRAParam)))
    report.update(
        weights_bytes=plan.weights_bytes(), programs=programs.memory, step_peak_bytes=programs.peak_bytes(),
        fits=None if limit is None else programs.peak_bytes() <= limit,
        compile_seconds=round(time.perf_counter() - t, 1), compiled=compiles.totals().by_program(),
        # the count behind MFU, and what XLA's cost analysis counts in one device's gradient program
        # (rematerialisation, the attention Tunix computes in full, dequantization included)
        model_flops_per_token=throughput.lora_step_flops(info.cfg, info.spec, cfg.max_length, lora_params).total,
        xla_flops_per_token_per_device=step_lib.flops_of(programs.grad, tokens))
    return report


def check_tile(cfg: TrainConfig, model_cfg) -> None:
    """``base_quant_tile`` must divide the inputs of every LoRA module (the hidden size, the MLP
    width, each layer's head dim): a ConfigError before anything is written."""
    tile = cfg.base_quant_tile
    if not tile:
        return
    sizes = {"the hidden size": model_cfg.hidden_size, "the MLP width": model_cfg.intermediate_size,
             **{"a head dim": layer.head_dim for layer in model_cfg.layers if layer.head_dim % tile}}
    bad = [f"{name} ({size})" for name, size in sizes.items() if size % tile]
    if bad:
        from ckptbridge.errors import ConfigError

        raise ConfigError(f"base_quant_tile={tile}: does not divide {', '.join(bad)}; choose a tile that divides "
                          f"{model_cfg.hidden_size}, {model_cfg.intermediate_size} and the head dims")


def _process_age() -> float | None:
    """Seconds since this process was started (Linux: /proc), or None where it is not known."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _check_same_run(run: Run, settings: dict) -> None:
    """A run directory belongs to one base, dataset and recipe: resuming with others is refused."""
    if not os.path.isfile(run.config) or not os.path.isdir(run.checkpoints):
        return
    with open(run.config) as f:
        old = json.load(f)
    keys = ("base", "data", "rank", "alpha", "targets", "max_length", "packing", "seed", "micro_batch",
            "grad_accum", "epochs", "processes")
    changed = [k for k in keys if old.get(k, 1 if k == "processes" else None) != settings.get(k)]
    if changed:
        from ckptbridge.errors import ConfigError

        raise ConfigError(f"{run.root}: holds a run with other settings ({', '.join(changed)}); "
                          "use a new --out directory to start another run")


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

    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def _summarize(run: Run, cfg: TrainConfig, encoded, total_steps: int, wall: float,
               first_step_seconds: float | None, hardware: dict, session: dict) -> dict:
    records = read_metrics(run.metrics) if os.path.isfile(run.metrics) else []
    # steps that compiled nothing, after each session's first (which loads its programs onto the chip)
    steady_steps = [r for r in records if not r.get("compiles") and r.get("session_step", 2) > 1]
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
        "compile_seconds": round(sum(p["seconds"] for p in session["programs"].values()), 3),
        "first_step_seconds_this_session": first_step_seconds,
        **session,
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

