"""The ``ckptbridge`` command line.

    ckptbridge convert safetensors-to-orbax SRC DST
    ckptbridge convert orbax-to-safetensors SRC DST [--config HF_CONFIG] [--max-shard-size 5GB] [--quantize int8|fp8]
    ckptbridge convert orbax-to-peft SRC DST --base BASE [--alpha A] [--target hf|vllm]
    ckptbridge convert peft-to-orbax SRC DST --base BASE [--kv exact|svd]
    ckptbridge convert peft-to-maxtext SRC DST --base BASE [--scan-layers]
    ckptbridge convert safetensors-to-maxtext SRC DST [--scan-layers]
    ckptbridge convert maxtext-to-safetensors SRC DST [--config HF_CONFIG]
    ckptbridge convert orbax-to-maxtext SRC DST [--scan-layers]
    ckptbridge convert maxtext-to-orbax SRC DST [--config HF_CONFIG]
    ckptbridge convert to-gguf SRC DST.gguf [--adapter ADAPTER] [--outtype f32|f16|bf16|q8_0]
    ckptbridge convert adapter-to-gguf ADAPTER DST.gguf --base BASE [--outtype f32|f16|bf16|q8_0]
    ckptbridge merge BASE ADAPTER DST [--quantize int8|fp8]
    ckptbridge quantize SRC DST --scheme int8|fp8
    ckptbridge inspect PATH [--json]
    ckptbridge verify logits HF_DIR [--tunix SRC]
    ckptbridge verify quantized QUANTIZED --source SRC [--tolerance X]
    ckptbridge verify tensors A B
    ckptbridge verify gguf FILE.gguf SRC [--adapter ADAPTER]
    ckptbridge verify adapter ADAPTER --base BASE [--target hf|vllm] [--prompt TEXT | --ids 1,2,3] [--lint-only]
    ckptbridge verify served --url URL --model NAME --base BASE [--adapter DIR] [--ids ...] [--tokens N]
    ckptbridge env [--json]

Errors end in one line on stderr (``ckptbridge: error: ...``) and a non-zero exit code that
tells the kind of failure (see ``docs/reliability.md``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence

from ckptbridge import __version__, deps
from ckptbridge.errors import CkptBridgeError
from ckptbridge.options import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_MAX_SHARD_SIZE,
    DEFAULT_MEMORY_BUDGET,
    EXACT_TOLERANCE,
    KV_MODES,
    LIVE_TOLERANCE,
    LOGITS_TOLERANCE,
    QUANT_SCHEMES,
    SERVED_TOKENS,
    TARGETS,
    parse_size,
)
from ckptbridge.stream import CODEC_VERB_WORKERS, default_workers

EPILOG = ("Exit codes: 0 ok, 2 usage, 3 input not found, 4 corrupt file, 5 unsupported, 6 mismatch, 7 output, "
          "8 config, 1 internal.")


def _quiet_libraries(cpu: bool = True) -> None:
    """Quiet third-party logging; with ``cpu``, JAX on the CPU unless JAX_PLATFORMS says otherwise
    (conversions and checks need no accelerator, and must not take one from a running job)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if cpu:
        os.environ["JAX_PLATFORMS"] = os.environ.get("JAX_PLATFORMS") or "cpu"
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:
        pass
    for name in ("absl", "jax", "orbax", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _progress(args) -> bool | None:
    return False if args.quiet else None


def _emit(args, report) -> None:
    """Print a verb's report: ``--json`` as JSON, else its summary."""
    if getattr(args, "json", False):
        print(json.dumps(report.to_json(), indent=2, default=str))
    else:
        print(report.summary())


def _size(args, name: str) -> int:
    """The size flag ``name`` parsed here, at the edge (the library takes bytes): a ConfigError
    (exit 8) naming the flag when it is not a size."""
    try:
        return parse_size(getattr(args, name))
    except ValueError as e:
        from ckptbridge.errors import ConfigError

        raise ConfigError(f"--{name.replace('_', '-')}: {e}") from None


def _parallel(args) -> dict:
    """The library's ``workers`` and ``memory_budget`` from ``--workers`` and ``--memory-budget``."""
    return {"workers": args.workers, "memory_budget": _size(args, "memory_budget")}


def _revision_option(sp, first: str) -> None:
    """``--revision`` of a verb whose inputs may be Hub ids; the library resolves them (the first,
    ``first``, at this revision)."""
    sp.add_argument("--revision", metavar="REV",
                    help=f"branch, tag or commit of {first} when it is a Hub id (default: main; ORG/NAME@REV "
                    "works for any Hub id)")


def cmd_s2o(args) -> int:
    from ckptbridge.convert import convert_safetensors_to_orbax

    _emit(args, convert_safetensors_to_orbax(args.src, args.dst, overwrite=args.overwrite,
                                             skip_multimodal=args.skip_multimodal, tunix_version=args.tunix_version,
                                             chunk_size=_size(args, "chunk_size"), compression=not args.no_compression,
                                             **_parallel(args), progress=_progress(args), revision=args.revision))
    return 0


def cmd_o2s(args) -> int:
    from ckptbridge.convert import convert_orbax_to_safetensors

    _emit(args, convert_orbax_to_safetensors(args.src, args.dst, config=args.config,
                                             max_shard_size=_size(args, "max_shard_size"), step=args.step,
                                             overwrite=args.overwrite, chunk_size=_size(args, "chunk_size"),
                                             **_parallel(args), progress=_progress(args), quantize=args.quantize))
    return 0


def cmd_s2m(args) -> int:
    from ckptbridge.maxtext import convert_safetensors_to_maxtext

    _emit(args, convert_safetensors_to_maxtext(args.src, args.dst, scan_layers=args.scan_layers,
                                               overwrite=args.overwrite, skip_multimodal=args.skip_multimodal,
                                               chunk_size=_size(args, "chunk_size"),
                                               compression=not args.no_compression,
                                               vocab_size=args.vocab_size, **_parallel(args),
                                               progress=_progress(args), revision=args.revision))
    return 0


def cmd_m2s(args) -> int:
    from ckptbridge.maxtext import convert_maxtext_to_safetensors

    _emit(args, convert_maxtext_to_safetensors(args.src, args.dst, config=args.config, step=args.step,
                                               max_shard_size=_size(args, "max_shard_size"),
                                               overwrite=args.overwrite, chunk_size=_size(args, "chunk_size"),
                                               **_parallel(args), progress=_progress(args)))
    return 0


def cmd_o2m(args) -> int:
    from ckptbridge.maxtext import convert_orbax_to_maxtext

    _emit(args, convert_orbax_to_maxtext(args.src, args.dst, scan_layers=args.scan_layers, config=args.config,
                                         step=args.step, overwrite=args.overwrite,
                                         chunk_size=_size(args, "chunk_size"), compression=not args.no_compression,
                                         vocab_size=args.vocab_size, **_parallel(args), progress=_progress(args)))
    return 0


def cmd_m2o(args) -> int:
    from ckptbridge.maxtext import convert_maxtext_to_orbax

    _emit(args, convert_maxtext_to_orbax(args.src, args.dst, config=args.config, step=args.step,
                                         overwrite=args.overwrite, tunix_version=args.tunix_version,
                                         chunk_size=_size(args, "chunk_size"), compression=not args.no_compression,
                                         **_parallel(args), progress=_progress(args)))
    return 0


def cmd_o2p(args) -> int:
    from ckptbridge.adapters import convert_orbax_to_peft

    _emit(args, convert_orbax_to_peft(args.src, args.dst, base=args.base, step=args.step, alpha=args.alpha,
                                      target=args.target, base_id=args.base_id, overwrite=args.overwrite,
                                      **_parallel(args), progress=_progress(args), revision=args.revision))
    return 0


def cmd_p2o(args) -> int:
    from ckptbridge.adapters import convert_peft_to_orbax

    _emit(args, convert_peft_to_orbax(args.src, args.dst, base=args.base, kv=args.kv, step=args.step,
                                      overwrite=args.overwrite, **_parallel(args), progress=_progress(args),
                                      revision=args.revision))
    return 0


def cmd_p2m(args) -> int:
    from ckptbridge.adapters import convert_peft_to_maxtext

    _emit(args, convert_peft_to_maxtext(args.src, args.dst, base=args.base, scan_layers=args.scan_layers,
                                        overwrite=args.overwrite, compression=not args.no_compression,
                                        **_parallel(args), progress=_progress(args), revision=args.revision))
    return 0


def cmd_to_gguf(args) -> int:
    from ckptbridge.gguf_export import convert_to_gguf

    _emit(args, convert_to_gguf(args.src, args.dst, adapter=args.adapter, outtype=args.outtype, step=args.step,
                                alpha=args.alpha, tokenizer=not args.no_tokenizer, name=args.name,
                                overwrite=args.overwrite, **_parallel(args), progress=_progress(args),
                                revision=args.revision))
    return 0


def cmd_adapter_to_gguf(args) -> int:
    from ckptbridge.gguf_adapter import convert_adapter_to_gguf

    _emit(args, convert_adapter_to_gguf(args.src, args.dst, base=args.base, step=args.step, alpha=args.alpha,
                                        outtype=args.outtype, name=args.name, overwrite=args.overwrite,
                                        progress=_progress(args), revision=args.revision))
    return 0


def cmd_merge(args) -> int:
    from ckptbridge.merge import merge_lora

    _emit(args, merge_lora(args.base, args.adapter, args.dst, step=args.step, alpha=args.alpha,
                           max_shard_size=_size(args, "max_shard_size"), base_id=args.base_id, overwrite=args.overwrite,
                           **_parallel(args), progress=_progress(args), revision=args.revision,
                           quantize=args.quantize))
    return 0


def cmd_quantize(args) -> int:
    from ckptbridge.merge import quantize_model

    _emit(args, quantize_model(args.src, args.dst, scheme=args.scheme, max_shard_size=_size(args, "max_shard_size"),
                               base_id=args.base_id, overwrite=args.overwrite, **_parallel(args),
                               progress=_progress(args), revision=args.revision))
    return 0


def cmd_inspect(args) -> int:
    from ckptbridge.inspect import inspect_path

    _emit(args, inspect_path(args.path, step=args.step, revision=args.revision))
    return 0


def cmd_verify_logits(args) -> int:
    from ckptbridge.verify import logits_parity

    report = logits_parity(args.hf_dir, args.tunix, seq_len=args.seq_len, tolerance=args.tolerance,
                           allow_config_mismatch=args.allow_config_mismatch, revision=args.revision)
    _emit(args, report)
    return 0 if report.ok else 6


def cmd_verify_quantized(args) -> int:
    from ckptbridge.verify import quantized_cost

    report = quantized_cost(args.quantized, args.source, seq_len=args.seq_len, tolerance=args.tolerance)
    _emit(args, report)
    return 0 if report.ok else 6


def cmd_verify_tensors(args) -> int:
    from ckptbridge.verify import compare_tensors

    report = compare_tensors(args.a, args.b, revision=args.revision)
    _emit(args, report)
    return 0 if report.identical else 6


def cmd_verify_gguf(args) -> int:
    from ckptbridge.gguf_export import verify_gguf

    report = verify_gguf(args.gguf, args.src, adapter=args.adapter, step=args.step, alpha=args.alpha,
                         **_parallel(args), revision=args.revision)
    _emit(args, report)
    return 0 if report.identical else 6


def cmd_verify_adapter(args) -> int:
    from ckptbridge.adapter_check import verify_adapter
    from ckptbridge.verify import parse_ids

    report = verify_adapter(args.adapter, args.base, target=args.target,
                            ids=parse_ids(args.ids) if args.ids else None, prompt=args.prompt, step=args.step,
                            alpha=args.alpha, lint_only=args.lint_only, exact=not args.no_exact,
                            live_tolerance=args.live_tolerance, tolerance=args.tolerance, revision=args.revision)
    _emit(args, report)
    return 0 if report.ok else 6


def cmd_verify_served(args) -> int:
    from ckptbridge.verify import parse_ids, served_parity

    if args.tokens < 1:
        from ckptbridge.errors import ConfigError

        raise ConfigError("--tokens must be at least 1")
    report = served_parity(args.url, args.model, args.base, adapter=args.adapter,
                           ids=parse_ids(args.ids) if args.ids else None, tokens=args.tokens, step=args.step,
                           alpha=args.alpha)
    _emit(args, report)
    return 0 if report.equal else 6


def cmd_env(args) -> int:
    _emit(args, deps.environment(args.verbs, accelerators=not args.no_accelerators))
    return 0


# --------------------------------------------------------------------------- options shared by verbs


def _output_options(sp, *, json_help: str = "print the report as JSON") -> None:
    sp.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    sp.add_argument("--quiet", action="store_true", help="no progress bar")
    sp.add_argument("--json", action="store_true", help=json_help)


def _json_option(sp) -> None:
    sp.add_argument("--json", action="store_true", help="print the report as JSON")


def _base_option(sp, what: str = "HF base model directory or Hub id (config and key names; weights not read, "
                                  "nor downloaded)") -> None:
    sp.add_argument("--base", required=True, help=what)


def _base_id_option(sp) -> None:
    sp.add_argument("--base-id", metavar="ORG/NAME",
                    help="the base's Hub id, for the model card (README.md) written with the output (default: "
                    "found from a Hub cache path or the base's config.json; else the card names the local path)")


def _max_shard_size_option(sp) -> None:
    sp.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE, metavar="SIZE",
                    help=f"largest shard (default {DEFAULT_MAX_SHARD_SIZE}; units B, KB, MB, GB, KiB, MiB, GiB)")


def _chunk_size_option(sp, what: str) -> None:
    sp.add_argument("--chunk-size", default=DEFAULT_CHUNK_SIZE, metavar="SIZE",
                    help=f"{what} (default {DEFAULT_CHUNK_SIZE})")


def _parallel_options(sp, what: str, cap: int | None = None) -> None:
    """``--workers`` and ``--memory-budget`` of a converting verb (default workers: the usable
    cores, at most ``cap``)."""
    most = f", at most {cap}" if cap else ""
    sp.add_argument("--workers", type=int, metavar="N",
                    help=f"threads that {what} (default: the cores this process may use{most}, "
                    f"{default_workers(cap)} here; the output does not depend on it)")
    sp.add_argument("--memory-budget", default=DEFAULT_MEMORY_BUDGET, metavar="SIZE",
                    help=f"bytes of pieces read, computed or being written at once, over all workers (default "
                    f"{DEFAULT_MEMORY_BUDGET}: peak memory within 1.5 GB at 31B scale; at least one chunk)")


def _quantize_option(sp, flag: str = "--quantize", required: bool = False) -> None:
    sp.add_argument(flag, choices=QUANT_SCHEMES, required=required,
                    help="int8: W8A8 (int8 weights, one scale per output channel, int8 activations per token at run "
                    "time: vLLM on x86 CPUs, TPUs, GPUs); fp8: FP8_DYNAMIC (float8 e4m3 weights, per-token fp8 "
                    "activations: Hopper/Ada GPUs). compressed-tensors, as llm-compressor writes it; the decoder's "
                    "linear projections only" + ("" if required else " (default: not quantized)"))


def _target_option(sp, what: str) -> None:
    sp.add_argument("--target", choices=TARGETS, default=TARGETS[0], help=what)


def _step_option(sp, what: str = "step of a checkpoint-manager root (default: latest)", **kw) -> None:
    sp.add_argument("--step", type=int, help=what, **kw)


def _orbax_lora_options(sp) -> None:
    """--step and --alpha of a verb that also takes a Tunix/qwix or MaxText LoRA checkpoint."""
    _step_option(sp, "step of an Orbax checkpoint root (default: latest)")
    sp.add_argument("--alpha", type=float, help="LoRA alpha of an Orbax or MaxText checkpoint that does not record "
                    "it (scale = alpha / rank)")


# --------------------------------------------------------------------------- one function per verb


def add_s2o(csub) -> None:
    sp = csub.add_parser(
        "safetensors-to-orbax", help="HF model directory -> Orbax checkpoint of the Tunix state",
        description="Convert an HF model directory (model.safetensors, or shards + index) into an Orbax "
        "checkpoint of the Tunix parameters of its family (Tunix layout, source dtype). The HF config, family and "
        "key prefix are stored in the checkpoint's metadata, and the tokenizer files beside it.",
        epilog=EPILOG,
    )
    sp.add_argument("src", metavar="SRC", help="HF model directory or Hub id (ORG/NAME)")
    sp.add_argument("dst", metavar="DST", help="Orbax checkpoint directory to create (local or gs://BUCKET/PATH)")
    sp.add_argument("--skip-multimodal", action="store_true",
                    help="convert the text model of a checkpoint that has vision/audio towers and drop the towers")
    sp.add_argument("--tunix-version", metavar="VERSION",
                    help="write the parameter layouts of this google-tunix version (default: the installed one), "
                    "recorded in the checkpoint; for the few parameters whose layout changed between Tunix versions")
    _chunk_size_option(sp, "a tensor larger than this is converted and stored in row blocks of at most this size, "
                           "each one chunk of the Orbax array; memory is a few of them (smaller tensors are one "
                           "chunk each, as Orbax stores them)")
    sp.add_argument("--no-compression", action="store_true",
                    help="store the chunks without zstd: faster to write and read, larger on disk")
    _parallel_options(sp, "read and rearrange row blocks while TensorStore encodes and writes earlier ones",
                      CODEC_VERB_WORKERS)
    _revision_option(sp, "SRC")
    _output_options(sp)
    sp.set_defaults(extra="orbax", huge_pages=True, func=cmd_s2o)  # huge pages: large TensorStore buffers


def add_o2s(csub) -> None:
    sp = csub.add_parser(
        "orbax-to-safetensors", help="Orbax checkpoint -> HF model directory",
        description="Convert an Orbax checkpoint of Tunix parameters back into an HF model directory "
        "(sharded safetensors + index, config.json, tokenizer files).",
        epilog=EPILOG,
    )
    sp.add_argument("src", metavar="SRC", help="Orbax checkpoint (or a checkpoint-manager root / step directory), "
                    "local or gs://BUCKET/PATH")
    sp.add_argument("dst", metavar="DST", help="HF model directory to create")
    sp.add_argument("--config", metavar="HF_CONFIG",
                    help="config.json (or its directory) for checkpoints without ckptbridge metadata; "
                    "non-weight files beside it are copied too")
    _max_shard_size_option(sp)
    _step_option(sp)
    _chunk_size_option(sp, "a tensor larger than this is read, rearranged and written in blocks of about this size "
                           "(whole stored chunks: a checkpoint stored in larger chunks is read a chunk at a time)")
    _quantize_option(sp)
    _parallel_options(sp, "read, decode and rearrange leaves and blocks ahead of the writer", CODEC_VERB_WORKERS)
    _output_options(sp)
    sp.set_defaults(extra="orbax", huge_pages=True, func=cmd_o2s)


def _maxtext_writer_options(sp) -> None:
    """--scan-layers, --chunk-size, --no-compression, --vocab-size, --workers, --memory-budget of a verb
    that writes MaxText."""
    sp.add_argument("--scan-layers", action="store_true",
                    help="stack the layers on axis 1, for MaxText's scan_layers=true (default: decoder/layers_{i}, "
                    "for scan_layers=false)")
    _chunk_size_option(sp, "a tensor larger than this is converted and stored in row blocks of at most this size; "
                           "a scanned tensor is stored one layer per chunk")
    sp.add_argument("--no-compression", action="store_true",
                    help="store the chunks without zstd: faster to write and read, larger on disk (MaxText reads both)")
    sp.add_argument("--vocab-size", type=int, metavar="N",
                    help="MaxText's vocab_size where its model config pads the embedding (rows past the model's "
                    "are zeros; default: what MaxText's own model config gives for the model's vocabulary)")
    _parallel_options(sp, "read, rearrange and transform pieces while TensorStore encodes and writes earlier ones",
                      CODEC_VERB_WORKERS)


def add_o2m(csub) -> None:
    sp = csub.add_parser(
        "orbax-to-maxtext", help="Orbax checkpoint of Tunix parameters -> MaxText checkpoint",
        description="Convert an Orbax checkpoint of Tunix parameters into a MaxText checkpoint (DST/0/items), "
        "tensor by tensor, without HF files in between: what safetensors-to-maxtext writes for the same model.",
        epilog=EPILOG,
    )
    sp.add_argument("src", metavar="SRC", help="Orbax checkpoint (or a checkpoint-manager root / step directory), "
                    "local or gs://BUCKET/PATH")
    sp.add_argument("dst", metavar="DST", help="MaxText checkpoint directory to create (local or gs://BUCKET/PATH)")
    sp.add_argument("--config", metavar="HF_CONFIG",
                    help="config.json (or its directory) for checkpoints without ckptbridge metadata")
    _step_option(sp)
    _maxtext_writer_options(sp)
    _output_options(sp)
    sp.set_defaults(extra="orbax", huge_pages=True, func=cmd_o2m)


def add_m2o(csub) -> None:
    sp = csub.add_parser(
        "maxtext-to-orbax", help="MaxText checkpoint -> Orbax checkpoint of the Tunix parameters",
        description="Convert a MaxText checkpoint (scanned or not) into an Orbax checkpoint of the Tunix parameters, "
        "tensor by tensor, without HF files in between: what safetensors-to-orbax writes for the HF model "
        "maxtext-to-safetensors would write.",
        epilog=EPILOG,
    )
    sp.add_argument("src", metavar="SRC", help="MaxText checkpoint: a run's checkpoint directory, a step, or its "
                    "items / model_params (local or gs://BUCKET/PATH)")
    sp.add_argument("dst", metavar="DST", help="Orbax checkpoint directory to create (local or gs://BUCKET/PATH)")
    sp.add_argument("--config", metavar="HF_CONFIG",
                    help="the model's HF config.json (or its directory), needed unless ckptbridge wrote the checkpoint")
    _step_option(sp)
    sp.add_argument("--tunix-version", metavar="VERSION",
                    help="write the parameter layouts of this google-tunix version (default: the installed one)")
    _chunk_size_option(sp, "a tensor larger than this is converted and stored in row blocks of at most this size")
    sp.add_argument("--no-compression", action="store_true",
                    help="store the chunks without zstd: faster to write and read, larger on disk")
    _parallel_options(sp, "read, rearrange and transform pieces while TensorStore encodes and writes earlier ones",
                      CODEC_VERB_WORKERS)
    _output_options(sp)
    sp.set_defaults(extra="orbax", huge_pages=True, func=cmd_m2o)


def add_s2m(csub) -> None:
    sp = csub.add_parser(
        "safetensors-to-maxtext", help="HF model directory -> MaxText checkpoint",
        description="Convert an HF model directory into a MaxText checkpoint (DST/0/items: what MaxText's "
        "to_maxtext writes for the same model, with its value transforms, in the source dtype), streaming. "
        "Load it in MaxText with load_parameters_path=DST/0/items and the same scan_layers. Families: "
        "see docs/maxtext.md.",
        epilog=EPILOG,
    )
    sp.add_argument("src", metavar="SRC", help="HF model directory or Hub id (ORG/NAME)")
    sp.add_argument("dst", metavar="DST", help="MaxText checkpoint directory to create (local or gs://BUCKET/PATH)")
    sp.add_argument("--skip-multimodal", action="store_true",
                    help="convert the text model of a checkpoint that has vision/audio towers and drop the towers")
    _maxtext_writer_options(sp)
    _revision_option(sp, "SRC")
    _output_options(sp)
    sp.set_defaults(extra="orbax", huge_pages=True, func=cmd_s2m)


def add_m2s(csub) -> None:
    sp = csub.add_parser(
        "maxtext-to-safetensors", help="MaxText checkpoint -> HF model directory",
        description="Convert a MaxText checkpoint (scanned or not; Linen items or NNX SFT model_params) into an "
        "HF model directory, undoing MaxText's value transforms as its to_huggingface does, streaming.",
        epilog=EPILOG,
    )
    sp.add_argument("src", metavar="SRC", help="MaxText checkpoint: a run's checkpoint directory, a step, or its "
                    "items / model_params (local or gs://BUCKET/PATH)")
    sp.add_argument("dst", metavar="DST", help="HF model directory to create")
    sp.add_argument("--config", metavar="HF_CONFIG",
                    help="the model's HF config.json (or its directory), needed unless ckptbridge wrote the "
                    "checkpoint; non-weight files beside it are copied too")
    _max_shard_size_option(sp)
    _step_option(sp)
    _chunk_size_option(sp, "a tensor larger than this is read, rearranged and written in blocks of about this size "
                           "(whole stored chunks)")
    _parallel_options(sp, "read, decode and rearrange pieces ahead of the writer", CODEC_VERB_WORKERS)
    _output_options(sp)
    sp.set_defaults(extra="orbax", huge_pages=True, func=cmd_m2s)


def add_o2p(csub) -> None:
    sp = csub.add_parser(
        "orbax-to-peft", help="Tunix/qwix or MaxText LoRA checkpoint -> PEFT adapter",
        description="Convert a Tunix/qwix LoRA checkpoint (checkpoint-manager root, step directory or its "
        "model_params) or a MaxText LoRA checkpoint (kernel_lora_a/kernel_lora_b; items or model_params, scanned "
        "or not) into a PEFT adapter for the HF base model. Reads files only: no model, no accelerator.",
        epilog=EPILOG,
    )
    sp.add_argument("src", metavar="SRC", help="LoRA checkpoint: root with step directories, a step, or its "
                    "model_params / items (local or gs://BUCKET/PATH)")
    sp.add_argument("dst", metavar="DST", help="PEFT adapter directory to create")
    _base_option(sp)
    _orbax_lora_options(sp)
    _target_option(sp, "hf: for transformers/PEFT (default); vllm: also repeat k_proj LoRA as v_proj on k_eq_v "
                       "layers and make rank/alpha uniform")
    _base_id_option(sp)
    _parallel_options(sp, "read and convert batches of factors ahead of the writer")
    _revision_option(sp, "BASE")
    _output_options(sp)
    sp.set_defaults(extra="orbax", func=cmd_o2p)


def add_p2o(csub) -> None:
    sp = csub.add_parser(
        "peft-to-orbax", help="PEFT adapter -> Tunix/qwix LoRA checkpoint",
        description="Convert a PEFT LoRA adapter into a Tunix checkpoint root DST/<step>/model_params that "
        "tunix CheckpointManager.maybe_restore(..., restore_only_lora_params=True) loads; the qwix rules that "
        "build the matching LoRA model are stored in the step's custom metadata.",
        epilog=EPILOG,
    )
    sp.add_argument("src", metavar="SRC", help="PEFT adapter directory or Hub id")
    sp.add_argument("dst", metavar="DST", help="checkpoint root to create (local or gs://BUCKET/PATH)")
    _base_option(sp)
    sp.add_argument("--kv", choices=KV_MODES, default=KV_MODES[0],
                    help="k/v with different lora_A: exact (default) stacks them at rank r_k + r_v; svd keeps "
                    "rank r with the best shared A and reports the error")
    _step_option(sp, "step number to write (default 0)", default=0)
    _parallel_options(sp, "convert modules while earlier ones are written")
    _revision_option(sp, "BASE")
    _output_options(sp)
    sp.set_defaults(extra="orbax", func=cmd_p2o)


def add_p2m(csub) -> None:
    sp = csub.add_parser(
        "peft-to-maxtext", help="PEFT adapter -> MaxText LoRA checkpoint",
        description="Convert a PEFT LoRA adapter into a MaxText LoRA checkpoint DST/0/items (kernel_lora_a and "
        "kernel_lora_b beside each kernel's path, as MaxText's to_maxtext converts an adapter), with lora_rank and "
        "lora_alpha in the step's metadata. Load it with lora.lora_restore_path=DST/0/items and the same "
        "scan_layers.",
        epilog=EPILOG,
    )
    sp.add_argument("src", metavar="SRC", help="PEFT adapter directory or Hub id")
    sp.add_argument("dst", metavar="DST", help="MaxText checkpoint directory to create (local or gs://BUCKET/PATH)")
    _base_option(sp)
    sp.add_argument("--scan-layers", action="store_true",
                    help="stack the layers on axis 1, for MaxText's scan_layers=true (default: decoder/layers_{i})")
    sp.add_argument("--no-compression", action="store_true", help="store the factors without zstd")
    _parallel_options(sp, "convert factors while earlier ones are written")
    _revision_option(sp, "BASE")
    _output_options(sp)
    sp.set_defaults(extra="orbax", func=cmd_p2m)


def _gguf_options(sp, default: str, what: str, named_after: str) -> None:
    """--outtype and --name of a verb that writes GGUF."""
    sp.add_argument("--outtype", choices=("f32", "f16", "bf16", "q8_0"), default=default,
                    help=f"stored type of the {what}")
    sp.add_argument("--name", help=f"general.name (default: from the {named_after} directory's name, as ggml's "
                    "converter)")


def add_to_gguf(csub) -> None:
    sp = csub.add_parser(
        "to-gguf", help="model (HF, Orbax, or base + LoRA) -> GGUF file for ggml's runtimes (Ollama, LM Studio)",
        description="Write a model as one GGUF file, as ggml's own converter (convert_hf_to_gguf.py) writes it for "
        "the same model: from an HF model directory or Hub id, a Tunix Orbax weights checkpoint, or an HF base with "
        "a PEFT adapter or Tunix/qwix LoRA checkpoint merged on the way; tokenizer and chat template included. "
        "Norms, 1-D tensors and routers stay float32; Q8_0 falls back to float16 for rows that are not whole "
        "blocks of 32. Streaming: memory stays within the budget plus one tensor that must be whole (a q/k "
        "projection whose rows are reordered).",
        epilog=EPILOG,
    )
    sp.add_argument("src", metavar="SRC", help="HF model directory or Hub id, or a Tunix Orbax weights checkpoint "
                    "(local or gs://)")
    sp.add_argument("dst", metavar="DST", help="GGUF file to create (e.g. model-Q8_0.gguf)")
    sp.add_argument("--adapter", metavar="ADAPTER", help="PEFT adapter directory or Hub id, or a Tunix/qwix Orbax "
                    "LoRA checkpoint, merged into SRC (an HF directory) on the way")
    _gguf_options(sp, "bf16", "weights (default bf16: the source's bits for bf16 models)", "source")
    sp.add_argument("--no-tokenizer", action="store_true",
                    help="leave the tokenizer out (ggml's runtimes then need it from elsewhere)")
    _orbax_lora_options(sp)
    _parallel_options(sp, "read, merge and quantize row blocks ahead of the writer")
    _revision_option(sp, "SRC")
    _output_options(sp)
    sp.set_defaults(func=cmd_to_gguf)


def add_adapter_to_gguf(csub) -> None:
    sp = csub.add_parser(
        "adapter-to-gguf", help="LoRA adapter (PEFT or Tunix) -> GGUF LoRA (--lora, Ollama ADAPTER)",
        description="Write a PEFT adapter or a Tunix/qwix LoRA checkpoint as a GGUF LoRA adapter, applied at load time "
        "to the base model's GGUF (convert to-gguf BASE). Names, reordered q/k rows and alpha as ggml's own "
        "convert_lora_to_gguf.py writes them; an adapter whose modules' scales differ (rank or alpha patterns, "
        "rsLoRA with several ranks) gets each scale folded into its B and alpha 0, so that it computes what it "
        "computes in PEFT.",
        epilog=EPILOG,
    )
    sp.add_argument("src", metavar="ADAPTER", help="PEFT adapter directory or Hub id, or a Tunix/qwix Orbax LoRA "
                    "checkpoint (local or gs://)")
    sp.add_argument("dst", metavar="DST", help="GGUF file to create (e.g. adapter-f16.gguf)")
    _base_option(sp)
    _gguf_options(sp, "f32", "LoRA factors (default f32, as ggml's converter)", "adapter")
    _orbax_lora_options(sp)
    _revision_option(sp, "BASE")
    _output_options(sp)
    sp.set_defaults(func=cmd_adapter_to_gguf)


def add_merge(sub) -> None:
    sp = sub.add_parser(
        "merge", help="merge a LoRA adapter into the base model", epilog=EPILOG,
        description="Merge a PEFT adapter, a Tunix/qwix LoRA checkpoint or a MaxText LoRA checkpoint into the HF "
        "base model, tensor by tensor (float32 accumulation, base dtype kept), writing a sharded HF model directory.",
    )
    sp.add_argument("base", metavar="BASE", help="HF base model directory or Hub id")
    sp.add_argument("adapter", metavar="ADAPTER", help="PEFT adapter directory or Hub id, or a Tunix or MaxText "
                    "LoRA checkpoint (local or gs://)")
    sp.add_argument("dst", metavar="DST", help="merged HF model directory to create")
    _orbax_lora_options(sp)
    _max_shard_size_option(sp)
    _base_id_option(sp)
    _quantize_option(sp)
    _parallel_options(sp, "compute merged row blocks ahead of the writer")
    _revision_option(sp, "BASE")
    _output_options(sp)
    sp.set_defaults(func=cmd_merge)


def add_quantize(sub) -> None:
    sp = sub.add_parser(
        "quantize", help="quantize an HF model to int8 or fp8 (compressed-tensors, for vLLM)", epilog=EPILOG,
        description="Quantize the linear projections of an HF model's decoder layers without calibration data, "
        "streaming a block of rows at a time, into the compressed-tensors format llm-compressor writes (the same "
        "bytes) and vLLM and transformers load. Embeddings, norms and the LM head are copied unchanged.",
    )
    sp.add_argument("src", metavar="SRC", help="HF model directory or Hub id (unquantized: BF16, F16 or F32)")
    sp.add_argument("dst", metavar="DST", help="quantized HF model directory to create")
    _quantize_option(sp, "--scheme", required=True)
    _max_shard_size_option(sp)
    _base_id_option(sp)
    _parallel_options(sp, "read and quantize row blocks ahead of the writer")
    _revision_option(sp, "SRC")
    _output_options(sp)
    sp.set_defaults(func=cmd_quantize)


def add_inspect(sub) -> None:
    sp = sub.add_parser("inspect", help="say what a checkpoint is", epilog=EPILOG,
                        description="Identify PATH (HF model, Orbax weights, Orbax LoRA, PEFT adapter, GGUF "
                        "model or adapter) and summarise it: family or architecture, layer kinds, dtypes or "
                        "tensor types, parameter count, tokenizer, metadata.")
    sp.add_argument("path", metavar="PATH", help="HF model, Orbax checkpoint (local or gs://), PEFT adapter, "
                    "a .safetensors or .gguf file, or a Hub id")
    _step_option(sp)
    _json_option(sp)
    _revision_option(sp, "PATH")
    sp.set_defaults(func=cmd_inspect)


def add_verify_logits(vsub) -> None:
    sp = vsub.add_parser("logits", help="transformers vs Tunix logits on the same tokens", epilog=EPILOG,
                         description="Run transformers on HF_DIR and Tunix on --tunix (default HF_DIR) in float32 "
                         "over a sequence longer than the sliding window; compare logits.")
    sp.add_argument("hf_dir", metavar="HF_DIR", help="HF model directory or Hub id")
    sp.add_argument("--tunix", metavar="SRC", help="HF directory or Orbax checkpoint to load into Tunix")
    sp.add_argument("--seq-len", type=int, help="tokens per sequence (default 2 x window + 3)")
    sp.add_argument("--tolerance", type=float, default=LOGITS_TOLERANCE,
                    help=f"largest relative L2 accepted (default {LOGITS_TOLERANCE:g})")
    sp.add_argument("--allow-config-mismatch", action="store_true",
                    help="build the Tunix model even where it computes something else than the HF config says "
                    "(e.g. a RoPE theta Tunix ignores) and measure the gap")
    _json_option(sp)
    _revision_option(sp, "HF_DIR")
    sp.set_defaults(extra="verify", func=cmd_verify_logits)


def add_verify_quantized(vsub) -> None:
    sp = vsub.add_parser("quantized", help="what quantization cost: logits of a quantized model vs its source",
                         epilog=EPILOG,
                         description="Compute the logits of the unquantized SOURCE and of the same model with the "
                         "quantized weights of QUANTIZED (weight x scale) and its activations rounded per token as the "
                         "scheme does when served, in float32 with transformers, on the same random tokens; report "
                         "relative L2 and argmax agreement.")
    sp.add_argument("quantized", metavar="QUANTIZED",
                    help="quantized model directory (int8 or fp8, compressed-tensors)")
    sp.add_argument("--source", required=True, help="the unquantized HF model directory it was made from")
    sp.add_argument("--seq-len", type=int, help="tokens per sequence (default 2 x window + 3)")
    sp.add_argument("--tolerance", type=float, help="fail (exit 6) above this relative L2 of the logits (default: "
                    "report only)")
    _json_option(sp)
    sp.set_defaults(extra="verify", func=cmd_verify_quantized)


def add_verify_tensors(vsub) -> None:
    sp = vsub.add_parser("tensors", help="bitwise comparison of two HF model directories", epilog=EPILOG)
    sp.add_argument("a", metavar="A", help="HF model directory or Hub id")
    sp.add_argument("b", metavar="B", help="HF model directory or Hub id")
    _json_option(sp)
    _revision_option(sp, "A")
    sp.set_defaults(func=cmd_verify_tensors)


def add_verify_gguf(vsub) -> None:
    sp = vsub.add_parser(
        "gguf", help="a GGUF file against the model it was made from, tensor by tensor", epilog=EPILOG,
        description="Check that every tensor of a GGUF file (ours or ggml's converter's) holds the source model's "
        "values in its stored type (F32/F16/BF16 bit for bit, Q8_0 equal to quantizing them again), with ggml's "
        "value changes, and that no tensor is missing or extra. Exit 6 when they differ.")
    sp.add_argument("gguf", metavar="GGUF", help="the GGUF file")
    sp.add_argument("src", metavar="SRC", help="the model it was made from: HF model directory or Hub id, or a Tunix "
                    "Orbax weights checkpoint")
    sp.add_argument("--adapter", metavar="ADAPTER", help="the LoRA adapter merged into it (PEFT, or Tunix/qwix Orbax)")
    _orbax_lora_options(sp)
    _parallel_options(sp, "read, merge and quantize row blocks ahead of the comparison")
    _json_option(sp)
    _revision_option(sp, "SRC")
    sp.set_defaults(func=cmd_verify_gguf)


def add_verify_adapter(vsub) -> None:
    sp = vsub.add_parser(
        "adapter", help="prove a LoRA adapter is live and exact for its base", epilog=EPILOG,
        description="lint (files only): targets, shapes, ranks, vLLM needs (k_eq_v v_proj copies, --max-lora-rank), "
        "DoRA / modules_to_save / biases, the recorded base; live: the adapter moves BASE's logits "
        "(transformers+PEFT); exact: transformers+PEFT vs Tunix+qwix logits of the same adapter, converted through "
        "ckptbridge (float32). One line per finding with its fix; exit 6 when the adapter is wrong in its target.")
    sp.add_argument("adapter", metavar="ADAPTER", help="PEFT adapter directory or Hub id, or a Tunix/qwix Orbax LoRA "
                    "checkpoint")
    _base_option(sp, "HF base model directory or Hub id")
    _target_option(sp, "where the adapter will run: hf (transformers/PEFT, default) or vllm")
    toks = sp.add_mutually_exclusive_group()
    toks.add_argument("--prompt", metavar="TEXT", help="text to check on (BASE's tokenizer)")
    toks.add_argument("--ids", metavar="1,2,3", help="token ids to check on (default: 24 random ids, seed 0)")
    sp.add_argument("--lint-only", action="store_true", help="files only: no model is loaded")
    sp.add_argument("--no-exact", action="store_true", help="skip the Tunix+qwix comparison")
    _orbax_lora_options(sp)
    sp.add_argument("--tolerance", type=float, default=EXACT_TOLERANCE,
                    help=f"largest relative L2 between the two frameworks (default {EXACT_TOLERANCE:g})")
    sp.add_argument("--live-tolerance", type=float, default=LIVE_TOLERANCE,
                    help=f"smallest relative change of the logits that counts as live (default {LIVE_TOLERANCE:g})")
    _json_option(sp)
    _revision_option(sp, "BASE")
    sp.set_defaults(func=cmd_verify_adapter)


def add_verify_served(vsub) -> None:
    sp = vsub.add_parser(
        "served", help="greedy tokens of a running server vs transformers (+PEFT)", epilog=EPILOG,
        description="Ask a running OpenAI-compatible server (vLLM) for the greedy token ids of a prompt and compare "
        "them with transformers (+ PEFT with --adapter) on the same ids, in float32; reports the first divergent "
        "position.")
    sp.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    sp.add_argument("--model", required=True, help="served model or adapter name")
    _base_option(sp, "HF base model directory the server serves")
    sp.add_argument("--adapter", help="the adapter served as --model (PEFT directory or Orbax LoRA checkpoint)")
    sp.add_argument("--ids", metavar="1,2,3", help="prompt token ids (default: 12 random ids, seed 0)")
    sp.add_argument("--tokens", type=int, default=SERVED_TOKENS,
                    help=f"greedy tokens to compare (default {SERVED_TOKENS})")
    _orbax_lora_options(sp)
    _json_option(sp)
    sp.set_defaults(extra="verify", func=cmd_verify_served)


def add_env(sub) -> None:
    sp = sub.add_parser(
        "env", help="this environment, for bug reports", epilog=EPILOG,
        description="Print what a bug report needs: Python, platform, CPUs and affinity, memory, transparent huge "
        "pages, the version of every package ckptbridge uses against its supported range, which extras are usable "
        "and which verbs work here, and the accelerators JAX and torch see.")
    _json_option(sp)
    sp.add_argument("--no-accelerators", action="store_true", help="do not import jax and torch to list devices")
    sp.set_defaults(func=cmd_env)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ckptbridge",
        description="Convert LLM checkpoints between HF safetensors and Tunix/Orbax, exactly and streaming.",
        epilog=EPILOG,
    )
    p.add_argument("--version", action="version", version=f"ckptbridge {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    conv = sub.add_parser("convert", help="convert a checkpoint", description="Convert a checkpoint.", epilog=EPILOG)
    csub = conv.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    for add in (add_s2o, add_o2s, add_s2m, add_m2s, add_o2m, add_m2o, add_o2p, add_p2o, add_p2m, add_to_gguf,
                add_adapter_to_gguf):
        add(csub)
    add_merge(sub)
    add_quantize(sub)
    add_inspect(sub)
    ver = sub.add_parser("verify", help="check a conversion", description="Check a conversion.", epilog=EPILOG)
    vsub = ver.add_subparsers(dest="check", metavar="CHECK", required=True)
    for add_check in (add_verify_logits, add_verify_quantized, add_verify_tensors, add_verify_gguf, add_verify_adapter,
                      add_verify_served):
        add_check(vsub)
    add_env(sub)
    verbs = {}
    for name, sp in sub.choices.items():
        leaves = {"convert": csub, "verify": vsub}.get(name)
        for leaf_name, leaf in (leaves.choices.items() if leaves else [("", sp)]):
            verb = f"{name} {leaf_name}".strip()
            verbs[verb] = leaf.get_default("extra")
            for what, extra in INPUT_EXTRAS.get(verb, ()):
                verbs[f"{verb} ({what})"] = extra
    p.set_defaults(verbs=verbs)
    return p


# Verbs that need more than their own extra for some inputs: (which inputs, the extra).
INPUT_EXTRAS = {
    "merge": [("Orbax adapter", "orbax")],
    "convert to-gguf": [("Orbax checkpoint or adapter", "orbax")],
    "verify gguf": [("Orbax checkpoint or adapter", "orbax")],
    "convert adapter-to-gguf": [("Orbax adapter", "orbax")],
    "inspect": [("Orbax checkpoint", "orbax")],
    "verify adapter": [("Orbax adapter", "orbax"), ("live and exact checks", "verify")],
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None and getattr(args, "huge_pages", False):
        from ckptbridge import hugepages

        if hugepages.wanted():
            hugepages.reexec(sys.argv[1:])
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    _quiet_libraries(cpu=args.func is not cmd_env)  # env reports the accelerators JAX finds by itself
    extra = getattr(args, "extra", None)
    try:
        if args.func is not cmd_env:  # env reports what is wrong instead
            deps.require(extra)
        return args.func(args)
    except CkptBridgeError as e:
        print(f"ckptbridge: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("ckptbridge: interrupted; the destination was not written", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout went away (`ckptbridge inspect X | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as e:  # a missing module, a version skew at import, or an internal error
        line = deps.missing_line(e, extra) if isinstance(e, ModuleNotFoundError) else None
        line = line or deps.import_failure(e, extra)
        if os.environ.get("CKPTBRIDGE_DEBUG"):
            raise
        if line is not None:
            print(f"ckptbridge: error: {line}", file=sys.stderr)
            return 8
        print(f"ckptbridge: internal error: {type(e).__name__}: {e} (set CKPTBRIDGE_DEBUG=1 for a traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
