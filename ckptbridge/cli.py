"""The ``ckptbridge`` command line.

    ckptbridge convert safetensors-to-orbax SRC DST
    ckptbridge convert orbax-to-safetensors SRC DST [--config HF_CONFIG] [--max-shard-size 5GB]
    ckptbridge convert orbax-to-peft SRC DST --base BASE [--alpha A] [--target hf|vllm]
    ckptbridge convert peft-to-orbax SRC DST --base BASE [--kv exact|svd]
    ckptbridge merge BASE ADAPTER DST
    ckptbridge inspect PATH [--json]
    ckptbridge verify logits HF_DIR [--tunix SRC]
    ckptbridge verify tensors A B
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
from typing import Sequence

from ckptbridge import __version__, deps
from ckptbridge.errors import CkptBridgeError
from ckptbridge.io import DEFAULT_CHUNK_SIZE

EPILOG = "Exit codes: 0 ok, 2 usage, 3 input not found, 4 corrupt file, 5 unsupported, 6 mismatch, 7 output, 8 config, 1 internal."


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


def _emit(args, result: dict, text: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps(result, indent=2, default=str))
    else:
        print(text)


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


def _conversion_text(r: dict) -> str:
    kinds = ", ".join(f"{v} {k}" for k, v in r["layer_kinds"].items())
    return (
        f"{r['direction']}: {r['source']} -> {r['destination']}\n"
        f"  {r['family']}, key prefix {r['key_prefix']}, layers: {kinds}\n"
        f"  {r['tensors']} tensors, {_human_bytes(r['bytes'])} in {r['seconds']:.2f} s"
    )


def cmd_s2o(args) -> int:
    from ckptbridge.convert import convert_safetensors_to_orbax

    r = convert_safetensors_to_orbax(args.src, args.dst, overwrite=args.overwrite,
                                     skip_multimodal=args.skip_multimodal, tunix_version=args.tunix_version,
                                     chunk_size=args.chunk_size, compression=not args.no_compression,
                                     progress=_progress(args))
    text = _conversion_text(r)
    if r["towers_dropped"]:
        text += f"\n  dropped {r['towers_dropped']} vision/audio tensors (--skip-multimodal)"
    _emit(args, r, text)
    return 0


def cmd_o2s(args) -> int:
    from ckptbridge.convert import convert_orbax_to_safetensors

    r = convert_orbax_to_safetensors(args.src, args.dst, config=args.config, max_shard_size=args.max_shard_size,
                                     step=args.step, overwrite=args.overwrite, chunk_size=args.chunk_size,
                                     progress=_progress(args))
    _emit(args, r, _conversion_text(r) + f"\n  files: {', '.join(r['files'])}")
    return 0


def _base_id_option(sp) -> None:
    sp.add_argument("--base-id", metavar="ORG/NAME",
                    help="the base's Hub id, for the model card (README.md) written with the output (default: "
                    "found from a Hub cache path or the base's config.json; else the card names the local path)")


def _hub_refs(sp, *refs: tuple[str, str, str]) -> None:
    """Arguments of ``sp`` that may be Hub ids, as (attribute, file set of :mod:`ckptbridge.hub`,
    what); ``--revision`` applies to the first."""
    first = refs[0][0].replace("_", "-")
    sp.add_argument("--revision", metavar="REV",
                    help=f"branch, tag or commit of {first.upper()} when it is a Hub id (default: main; ORG/NAME@REV "
                    "works for any Hub id)")
    sp.set_defaults(hub_refs=refs)


def _resolve_hub_refs(args) -> None:
    """Hub ids among the arguments -> local snapshot directories (downloaded where needed)."""
    from ckptbridge import hub

    for i, (attr, patterns, what) in enumerate(getattr(args, "hub_refs", ())):
        value = getattr(args, attr)
        if value is not None:
            setattr(args, attr, hub.local(value, getattr(hub, patterns), revision=args.revision if i == 0 else None,
                                          what=what))


def cmd_o2p(args) -> int:
    from ckptbridge.adapters import convert_orbax_to_peft

    r = convert_orbax_to_peft(args.src, args.dst, base=args.base, step=args.step, alpha=args.alpha,
                              target=args.target, base_id=args.base_id, overwrite=args.overwrite,
                              progress=_progress(args))
    text = (f"orbax-to-peft ({r['target']}): {r['source']} -> {r['destination']}\n"
            f"  {r['modules']} modules, r={r['r']}, lora_alpha={r['lora_alpha']}, {_human_bytes(r['bytes'])} "
            f"in {r['seconds']:.2f} s")
    for w in r["warnings"]:
        text += f"\n  warning: {w}"
    _emit(args, r, text)
    return 0


def cmd_p2o(args) -> int:
    from ckptbridge.adapters import convert_peft_to_orbax

    r = convert_peft_to_orbax(args.src, args.dst, base=args.base, kv=args.kv, step=args.step,
                              overwrite=args.overwrite, progress=_progress(args))
    text = (f"peft-to-orbax: {r['source']} -> {r['destination']}/{r['step']}/model_params\n"
            f"  {r['modules']} modules ({', '.join(f'{v} {k}' for k, v in r['modes'].items())}), "
            f"{_human_bytes(r['bytes'])} in {r['seconds']:.2f} s")
    for rule in r["rules"]:
        text += f"\n  rule: rank {rule['rank']}, alpha {rule['alpha']}: {rule['module_path']}"
    for module, err in r["svd_relative_error"].items():
        text += f"\n  svd {module}: relative error {err:.3e}"
    if r["vllm_repeats_dropped"]:
        text += f"\n  dropped {r['vllm_repeats_dropped']} v_proj copies of k_proj factors (vLLM export)"
    _emit(args, r, text)
    return 0


def cmd_merge(args) -> int:
    from ckptbridge.merge import merge_lora

    r = merge_lora(args.base, args.adapter, args.dst, step=args.step, alpha=args.alpha,
                   max_shard_size=args.max_shard_size, base_id=args.base_id, overwrite=args.overwrite,
                   progress=_progress(args))
    _emit(args, r, (f"merge: {r['base']} + {r['adapter']} -> {r['destination']}\n"
                    f"  {r['merged_tensors']} tensors merged, {r['copied_tensors']} copied, "
                    f"{_human_bytes(r['bytes'])} in {r['seconds']:.2f} s\n  files: {', '.join(r['files'])}"))
    return 0


def cmd_inspect(args) -> int:
    from ckptbridge.inspect import format_report, inspect_path

    info = inspect_path(args.path, step=args.step)
    _emit(args, info, format_report(info))
    return 0


def cmd_verify_logits(args) -> int:
    from ckptbridge.verify import logits_parity

    r = logits_parity(args.hf_dir, args.tunix, seq_len=args.seq_len, allow_config_mismatch=args.allow_config_mismatch)
    ok = r["rel_l2"] <= args.tolerance and r["argmax_agreement"] == 1.0
    r["ok"] = ok
    _emit(args, r, (
        f"logits parity, transformers ({r['hf']}) vs Tunix ({r['tunix']}), tokens {r['tokens'][0]}x{r['tokens'][1]}"
        f" (sliding window {r['sliding_window']}):\n  relative L2 {r['rel_l2']:.3e}, max |diff| {r['max_abs_diff']:.3e},"
        f" argmax agreement {r['argmax_agreement']:.4f} -> {'OK' if ok else 'FAIL'} (tolerance {args.tolerance:g})"
        + (f"\n  the gap measured for what Tunix computes otherwise: {'; '.join(r['config_mismatch'])}"
           if r["config_mismatch"] else "")
    ))
    return 0 if ok else 6


def cmd_verify_tensors(args) -> int:
    from ckptbridge.verify import compare_tensors

    r = compare_tensors(args.a, args.b)
    text = (
        f"{r['a']} vs {r['b']}: {r['tensors']} tensors, "
        + ("identical (keys, dtypes, shapes, bytes)" if r["identical"] else
           f"DIFFERENT: {len(r['differing'])} differ, {len(r['only_in_a'])} only in A, {len(r['only_in_b'])} only in B")
    )
    for key in (r["differing"] + r["only_in_a"] + r["only_in_b"])[:10]:
        text += f"\n  {key}"
    _emit(args, r, text)
    return 0 if r["identical"] else 6


def _adapter_text(r: dict) -> str:
    lint = r["lint"]
    lines = [f"verify adapter {r['adapter']} ({lint['kind']}, target {lint['target']}) on {r['base']}: "
             f"{lint['modules']} modules, max rank {lint['max_rank']}"]
    lines += [f"  lint: {f['severity']}: [{f['check']}] {f['message']}" for f in lint["findings"]]
    errors = sum(f["severity"] == "error" for f in lint["findings"])
    lines.append(f"  lint: {'OK' if not errors else 'FAIL'} ({errors} errors, "
                 f"{sum(f['severity'] == 'warning' for f in lint['findings'])} warnings)")
    live, exact = r.get("live"), r.get("exact")
    if live is not None:
        if "rel_change" in live:
            lines.append(f"  live: {'OK' if live['ok'] else 'FAIL'}: the adapter changes the logits by "
                         f"{live['rel_change']:.3e} (relative L2 over {r['tokens']} tokens; not live below "
                         f"{live['tolerance']:g}); {live['applied_modules']} modules carry a non-zero LoRA in PEFT")
        else:
            lines.append(f"  live: FAIL: {live.get('error') or live.get('skipped')}")
    if exact is not None:
        if "rel_l2" in exact:
            lines.append(f"  exact: {'OK' if exact['ok'] else 'FAIL'}: transformers+PEFT vs Tunix+qwix relative L2 "
                         f"{exact['rel_l2']:.3e} (tolerance {exact['tolerance']:g}, float32, via {exact['via']})")
        else:
            lines.append(f"  exact: skipped: {exact['skipped']}")
    lines.append("-> OK" if r["ok"] else "-> FAIL")
    return "\n".join(lines)


def cmd_verify_adapter(args) -> int:
    from ckptbridge.adapter_check import verify_adapter
    from ckptbridge.verify import parse_ids

    r = verify_adapter(args.adapter, args.base, target=args.target, ids=parse_ids(args.ids) if args.ids else None,
                       prompt=args.prompt, step=args.step, alpha=args.alpha, lint_only=args.lint_only,
                       exact=not args.no_exact, live_tolerance=args.live_tolerance, tolerance=args.tolerance)
    _emit(args, r, _adapter_text(r))
    return 0 if r["ok"] else 6


def cmd_verify_served(args) -> int:
    from ckptbridge.verify import parse_ids
    from ckptbridge.verify import served_parity

    if args.tokens < 1:
        from ckptbridge.errors import ConfigError

        raise ConfigError("--tokens must be at least 1")
    r = served_parity(args.url, args.model, args.base, adapter=args.adapter,
                      ids=parse_ids(args.ids) if args.ids else None, tokens=args.tokens, step=args.step,
                      alpha=args.alpha)
    ref = f"transformers{' + PEFT ' + args.adapter if args.adapter else ''} (float32)"
    if r["equal"]:
        text = f"verify served: {args.model} at {args.url}: {r['tokens']} greedy tokens equal {ref} -> OK"
    else:
        i = r["first_divergence"]
        got = r["server"][i] if i < len(r["server"]) else "none"
        want = r["reference"][i] if i < len(r["reference"]) else "none"
        text = (f"verify served: {args.model} at {args.url}: greedy tokens leave {ref} at position {i} of {r['tokens']} "
                f"(server {got}, reference {want}) -> FAIL\n  a server computing in bfloat16 (vLLM's --dtype auto on "
                "a float32 checkpoint) can diverge: serve with --dtype float32; an adapter exported for transformers "
                "diverges on k_eq_v layers: check it with `ckptbridge verify adapter ADAPTER --base BASE --target vllm`")
    _emit(args, r, text)
    return 0 if r["equal"] else 6


def _env_text(r: dict) -> str:
    mem = r["memory"]
    gib = lambda n: f"{n / (1 << 30):.1f} GiB" if n else "unknown"  # noqa: E731
    cpus = r["cpus"]
    lines = [
        f"ckptbridge {r['ckptbridge']}",
        f"python     {r['python']['version']} ({r['python']['implementation']}) {r['python']['executable']}",
        f"platform   {r['platform']['system']} {r['platform']['machine']}"
        + (f", {r['platform']['libc']}" if r["platform"]["libc"] else ""),
        f"cpus       {cpus['count']}, usable {cpus['usable']} (affinity {cpus['affinity']})",
        f"memory     {gib(mem['total'])} total, {gib(mem['available'])} available"
        + (f", cgroup limit {gib(mem['cgroup_limit'])}" if mem["cgroup_limit"] else ""),
        f"huge pages enabled: {r['transparent_hugepages']['enabled']}; defrag: {r['transparent_hugepages']['defrag']}",
        "",
        "packages (installed / supported):",
    ]
    width = max(len(n) for n in r["packages"])
    found = {name: (p["version"] or "not installed") + (f" [{p['distribution']}]" if p.get("distribution") else "")
             for name, p in r["packages"].items()}
    vwidth = max(len(v) for v in found.values())
    for name, p in r["packages"].items():
        by_range: dict[str, list[str]] = {}
        for extra, spec in p["required"].items():
            by_range.setdefault(spec, []).append(extra)
        ranges = "; ".join(f"{spec} ({', '.join(extras)})" for spec, extras in by_range.items()) or "(brought by the above)"
        lines.append(f"  {name:<{width}}  {found[name]:<{vwidth}}  {ranges}")
    lines += ["", "extras:"]
    for extra, e in r["extras"].items():
        lines.append(f"  {extra:<7} {'usable' if e['usable'] else 'NOT usable'}: {e['for']}")
        lines += [f"          {why}" for why in e.get("problems", [])[:3]]
    lines += ["", "verbs:"]
    width = max(len(v) for v in r.get("verbs", {"": 0}))
    for verb, v in r.get("verbs", {}).items():
        lines.append(f"  {verb:<{width}}  {'works' if v['works'] else 'needs ' + repr('ckptbridge[' + v['extra'] + ']')}")
    if "accelerators" in r:
        lines += ["", "accelerators:"]
        for lib, a in r["accelerators"].items():
            if a is None:
                lines.append(f"  {lib}: not installed")
            elif "error" in a:
                lines.append(f"  {lib}: {a['error']}")
            elif lib == "jax":
                lines.append(f"  jax: {a['backend']}, {a['devices']} device(s) {', '.join(a['kinds'])}")
            else:
                lines.append(f"  torch: {'CUDA ' + str(a['cuda_version']) + ', ' + str(a['devices']) + ' device(s) ' + ', '.join(a['names']) if a['cuda'] else 'CPU only'}")
    if r["environment_variables"]:
        lines += ["", "environment: " + " ".join(f"{k}={v}" for k, v in r["environment_variables"].items())]
    return "\n".join(lines)


def cmd_env(args) -> int:
    r = deps.environment(args.verbs, accelerators=not args.no_accelerators)
    _emit(args, r, _env_text(r))
    return 0


def _orbax_lora_options(sp) -> None:
    """--step and --alpha of a verb that also takes a Tunix/qwix Orbax LoRA checkpoint."""
    sp.add_argument("--step", type=int, help="step of an Orbax checkpoint root (default: latest)")
    sp.add_argument("--alpha", type=float, help="LoRA alpha of an Orbax checkpoint that does not record it")


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

    def common(sp):
        sp.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
        sp.add_argument("--quiet", action="store_true", help="no progress bar")
        sp.add_argument("--json", action="store_true", help="print the report as JSON")

    s2o = csub.add_parser(
        "safetensors-to-orbax", help="HF model directory -> Orbax checkpoint of the Tunix state",
        description="Convert an HF model directory (model.safetensors, or shards + index) into an Orbax "
        "checkpoint of the Tunix parameters of its family (Tunix layout, source dtype). The HF config, family and "
        "key prefix are stored in the checkpoint's metadata, and the tokenizer files beside it.",
        epilog=EPILOG,
    )
    s2o.add_argument("src", metavar="SRC", help="HF model directory or Hub id (ORG/NAME)")
    s2o.add_argument("dst", metavar="DST", help="Orbax checkpoint directory to create (local or gs://BUCKET/PATH)")
    s2o.add_argument("--skip-multimodal", action="store_true",
                     help="convert the text model of a checkpoint that has vision/audio towers and drop the towers")
    s2o.add_argument("--tunix-version", metavar="VERSION",
                     help="write the parameter layouts of this google-tunix version (default: the installed one), "
                     "recorded in the checkpoint; for the few parameters whose layout changed between Tunix versions")
    s2o.add_argument("--chunk-size", default=DEFAULT_CHUNK_SIZE, metavar="SIZE",
                     help=f"a tensor larger than this is converted and stored in row blocks of at most this size, "
                     f"each one chunk of the Orbax array; memory is a few of them (default {DEFAULT_CHUNK_SIZE}; "
                     "smaller tensors are one chunk each, as Orbax stores them)")
    s2o.add_argument("--no-compression", action="store_true",
                     help="store the chunks without zstd: faster to write and read, larger on disk")
    _hub_refs(s2o, ("src", "MODEL", "model"))
    common(s2o)
    s2o.set_defaults(extra="orbax")
    s2o.set_defaults(huge_pages=True)  # large TensorStore buffers (ckptbridge.hugepages)
    s2o.set_defaults(func=cmd_s2o)

    o2s = csub.add_parser(
        "orbax-to-safetensors", help="Orbax checkpoint -> HF model directory",
        description="Convert an Orbax checkpoint of Tunix parameters back into an HF model directory "
        "(sharded safetensors + index, config.json, tokenizer files).",
        epilog=EPILOG,
    )
    o2s.add_argument("src", metavar="SRC", help="Orbax checkpoint (or a checkpoint-manager root / step directory), "
                     "local or gs://BUCKET/PATH")
    o2s.add_argument("dst", metavar="DST", help="HF model directory to create")
    o2s.add_argument("--config", metavar="HF_CONFIG",
                     help="config.json (or its directory) for checkpoints without ckptbridge metadata; "
                     "non-weight files beside it are copied too")
    o2s.add_argument("--max-shard-size", default="5GB", help="largest shard (default 5GB; units B, KB, MB, GB, KiB, MiB, GiB)")
    o2s.add_argument("--step", type=int, help="step to read from a checkpoint-manager root (default: latest)")
    o2s.add_argument("--chunk-size", default=DEFAULT_CHUNK_SIZE, metavar="SIZE",
                     help=f"a tensor larger than this is read, rearranged and written in blocks of about this size "
                     f"(whole stored chunks: a checkpoint stored in larger chunks is read a chunk at a time; "
                     f"default {DEFAULT_CHUNK_SIZE})")
    common(o2s)
    o2s.set_defaults(extra="orbax")
    o2s.set_defaults(huge_pages=True)  # large TensorStore buffers (ckptbridge.hugepages)
    o2s.set_defaults(func=cmd_o2s)

    o2p = csub.add_parser(
        "orbax-to-peft", help="Tunix/qwix LoRA checkpoint -> PEFT adapter",
        description="Convert a Tunix/qwix LoRA checkpoint (checkpoint-manager root, step directory or its "
        "model_params) into a PEFT adapter for the HF base model. Reads files only: no model, no accelerator.",
        epilog=EPILOG,
    )
    o2p.add_argument("src", metavar="SRC", help="LoRA checkpoint: root with step directories, a step, or model_params "
                     "(local or gs://BUCKET/PATH)")
    o2p.add_argument("dst", metavar="DST", help="PEFT adapter directory to create")
    o2p.add_argument("--base", required=True, help="HF base model directory or Hub id (config and key names; "
                     "weights not read, nor downloaded)")
    o2p.add_argument("--step", type=int, help="step to read from a root (default: latest)")
    o2p.add_argument("--alpha", type=float,
                     help="LoRA alpha, when the checkpoint does not record it (scale = alpha / rank)")
    o2p.add_argument("--target", choices=["hf", "vllm"], default="hf",
                     help="hf: for transformers/PEFT (default); vllm: also repeat k_proj LoRA as v_proj on "
                     "k_eq_v layers and make rank/alpha uniform")
    _base_id_option(o2p)
    _hub_refs(o2p, ("base", "CONFIG", "base model"))
    common(o2p)
    o2p.set_defaults(extra="orbax")
    o2p.set_defaults(func=cmd_o2p)

    p2o = csub.add_parser(
        "peft-to-orbax", help="PEFT adapter -> Tunix/qwix LoRA checkpoint",
        description="Convert a PEFT LoRA adapter into a Tunix checkpoint root DST/<step>/model_params that "
        "tunix CheckpointManager.maybe_restore(..., restore_only_lora_params=True) loads; the qwix rules that "
        "build the matching LoRA model are stored in the step's custom metadata.",
        epilog=EPILOG,
    )
    p2o.add_argument("src", metavar="SRC", help="PEFT adapter directory or Hub id")
    p2o.add_argument("dst", metavar="DST", help="checkpoint root to create (local or gs://BUCKET/PATH)")
    p2o.add_argument("--base", required=True, help="HF base model directory or Hub id (config and key names; "
                     "weights not read, nor downloaded)")
    p2o.add_argument("--kv", choices=["exact", "svd"], default="exact",
                     help="k/v with different lora_A: exact (default) stacks them at rank r_k + r_v; svd keeps "
                     "rank r with the best shared A and reports the error")
    p2o.add_argument("--step", type=int, default=0, help="step number to write (default 0)")
    _hub_refs(p2o, ("base", "CONFIG", "base model"), ("src", "ADAPTER", "adapter"))
    common(p2o)
    p2o.set_defaults(extra="orbax")
    p2o.set_defaults(func=cmd_p2o)

    mrg = sub.add_parser(
        "merge", help="merge a LoRA adapter into the base model", epilog=EPILOG,
        description="Merge a PEFT adapter or a Tunix/qwix LoRA checkpoint into the HF base model, tensor by "
        "tensor (float32 accumulation, base dtype kept), writing a sharded HF model directory.",
    )
    mrg.add_argument("base", metavar="BASE", help="HF base model directory or Hub id")
    mrg.add_argument("adapter", metavar="ADAPTER", help="PEFT adapter directory or Hub id, or an Orbax LoRA checkpoint (local or gs://)")
    mrg.add_argument("dst", metavar="DST", help="merged HF model directory to create")
    _orbax_lora_options(mrg)
    mrg.add_argument("--max-shard-size", default="5GB", help="largest shard (default 5GB)")
    _base_id_option(mrg)
    _hub_refs(mrg, ("base", "MODEL", "base model"), ("adapter", "ADAPTER", "adapter"))
    common(mrg)
    mrg.set_defaults(func=cmd_merge)

    ins = sub.add_parser("inspect", help="say what a checkpoint is", epilog=EPILOG,
                         description="Identify PATH (HF model, Orbax weights, Orbax LoRA, PEFT adapter) and "
                         "summarise it: family, layer kinds, dtypes, parameter count, metadata.")
    ins.add_argument("path", metavar="PATH", help="HF model, Orbax checkpoint (local or gs://), PEFT adapter, "
                     "a .safetensors file, or a Hub id")
    ins.add_argument("--step", type=int, help="step of a checkpoint-manager root (default: latest)")
    ins.add_argument("--json", action="store_true", help="print JSON")
    _hub_refs(ins, ("path", "MODEL", "model"))
    ins.set_defaults(func=cmd_inspect)

    ver = sub.add_parser("verify", help="check a conversion", description="Check a conversion.", epilog=EPILOG)
    vsub = ver.add_subparsers(dest="check", metavar="CHECK", required=True)
    vl = vsub.add_parser("logits", help="transformers vs Tunix logits on the same tokens", epilog=EPILOG,
                         description="Run transformers on HF_DIR and Tunix on --tunix (default HF_DIR) in float32 "
                         "over a sequence longer than the sliding window; compare logits.")
    vl.add_argument("hf_dir", metavar="HF_DIR", help="HF model directory or Hub id")
    vl.add_argument("--tunix", metavar="SRC", help="HF directory or Orbax checkpoint to load into Tunix")
    vl.add_argument("--seq-len", type=int, help="tokens per sequence (default 2 x window + 3)")
    vl.add_argument("--tolerance", type=float, default=1e-5, help="largest relative L2 accepted (default 1e-5)")
    vl.add_argument("--allow-config-mismatch", action="store_true",
                    help="build the Tunix model even where it computes something else than the HF config says "
                    "(e.g. a RoPE theta Tunix ignores) and measure the gap")
    vl.add_argument("--json", action="store_true")
    _hub_refs(vl, ("hf_dir", "MODEL", "model"))
    vl.set_defaults(extra="verify")
    vl.set_defaults(func=cmd_verify_logits)
    vt = vsub.add_parser("tensors", help="bitwise comparison of two HF model directories", epilog=EPILOG)
    vt.add_argument("a", metavar="A", help="HF model directory or Hub id")
    vt.add_argument("b", metavar="B", help="HF model directory or Hub id")
    vt.add_argument("--json", action="store_true")
    _hub_refs(vt, ("a", "MODEL", "model"), ("b", "MODEL", "model"))
    vt.set_defaults(func=cmd_verify_tensors)

    va = vsub.add_parser(
        "adapter", help="prove a LoRA adapter is live and exact for its base", epilog=EPILOG,
        description="lint (files only): targets, shapes, ranks, vLLM needs (k_eq_v v_proj copies, --max-lora-rank), "
        "DoRA / modules_to_save / biases, the recorded base; live: the adapter moves BASE's logits "
        "(transformers+PEFT); exact: transformers+PEFT vs Tunix+qwix logits of the same adapter, converted through "
        "ckptbridge (float32). One line per finding with its fix; exit 6 when the adapter is wrong in its target.")
    va.add_argument("adapter", metavar="ADAPTER", help="PEFT adapter directory or Hub id, or a Tunix/qwix Orbax LoRA checkpoint")
    va.add_argument("--base", required=True, help="HF base model directory or Hub id")
    va.add_argument("--target", choices=["hf", "vllm"], default="hf",
                    help="where the adapter will run: hf (transformers/PEFT, default) or vllm")
    toks = va.add_mutually_exclusive_group()
    toks.add_argument("--prompt", metavar="TEXT", help="text to check on (BASE's tokenizer)")
    toks.add_argument("--ids", metavar="1,2,3", help="token ids to check on (default: 24 random ids, seed 0)")
    va.add_argument("--lint-only", action="store_true", help="files only: no model is loaded")
    va.add_argument("--no-exact", action="store_true", help="skip the Tunix+qwix comparison")
    _orbax_lora_options(va)
    va.add_argument("--tolerance", type=float, default=1e-4,
                    help="largest relative L2 between the two frameworks (default 1e-4)")
    va.add_argument("--live-tolerance", type=float, default=1e-6,
                    help="smallest relative change of the logits that counts as live (default 1e-6)")
    va.add_argument("--json", action="store_true")
    _hub_refs(va, ("base", "MODEL", "base model"), ("adapter", "ADAPTER", "adapter"))
    va.set_defaults(func=cmd_verify_adapter)

    vs = vsub.add_parser(
        "served", help="greedy tokens of a running server vs transformers (+PEFT)", epilog=EPILOG,
        description="Ask a running OpenAI-compatible server (vLLM) for the greedy token ids of a prompt and compare "
        "them with transformers (+ PEFT with --adapter) on the same ids, in float32; reports the first divergent "
        "position.")
    vs.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    vs.add_argument("--model", required=True, help="served model or adapter name")
    vs.add_argument("--base", required=True, help="HF base model directory the server serves")
    vs.add_argument("--adapter", help="the adapter served as --model (PEFT directory or Orbax LoRA checkpoint)")
    vs.add_argument("--ids", metavar="1,2,3", help="prompt token ids (default: 12 random ids, seed 0)")
    vs.add_argument("--tokens", type=int, default=16, help="greedy tokens to compare (default 16)")
    _orbax_lora_options(vs)
    vs.add_argument("--json", action="store_true")
    vs.set_defaults(extra="verify")
    vs.set_defaults(func=cmd_verify_served)

    env = sub.add_parser(
        "env", help="this environment, for bug reports", epilog=EPILOG,
        description="Print what a bug report needs: Python, platform, CPUs and affinity, memory, transparent huge "
        "pages, the version of every package ckptbridge uses against its supported range, which extras are usable "
        "and which verbs work here, and the accelerators JAX and torch see.")
    env.add_argument("--json", action="store_true", help="print JSON")
    env.add_argument("--no-accelerators", action="store_true", help="do not import jax and torch to list devices")
    env.set_defaults(func=cmd_env)
    verbs = {}
    for name, sp in sub.choices.items():
        for leaf_name, leaf in ((csub if name == "convert" else vsub).choices.items()
                                if name in ("convert", "verify") else [("", sp)]):
            verb = f"{name} {leaf_name}".strip()
            verbs[verb] = leaf.get_default("extra")
            for what, extra in INPUT_EXTRAS.get(verb, ()):
                verbs[f"{verb} ({what})"] = extra
    p.set_defaults(verbs=verbs)
    return p


# Verbs that need more than their own extra for some inputs: (which inputs, the extra).
INPUT_EXTRAS = {
    "merge": [("Orbax adapter", "orbax")],
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
        _resolve_hub_refs(args)
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
