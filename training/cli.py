"""``python -m training``: LoRA SFT of an HF base model (any family ckptbridge builds Tunix models for;
the family comes from the base's config.json) on CodeV-R1-format data.

    python -m training --preset tiny-cpu --base HF_DIR --data DATA.jsonl --out RUN_DIR [--max-steps N]
                       [--config FILE.yaml] [--no-packing] [key=value ...]

Re-running the same command on the same RUN_DIR resumes from its latest checkpoint. Several
processes (the hosts of a TPU slice, or processes on one machine) train one run together: start the
same command in each, with ``--coordinator HOST:PORT --num-processes N --process-id I`` (or JAX's
variables; a TPU slice's hosts find each other alone), see training/distributed.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from ckptbridge import deps
from ckptbridge.errors import CkptBridgeError

SAMPLE_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data_files", "codev_sample.jsonl")


def build_parser() -> argparse.ArgumentParser:
    from training.config import PRESETS, TrainConfig

    p = argparse.ArgumentParser(
        prog="python -m training",
        description="LoRA SFT (Tunix + qwix + Grain) of an HF base model (its family from its config.json) on "
        "CodeV-R1 jsonl rows "
        "(prompt, response). Settings: a preset, then --config, then key=value overrides "
        f"(any of: {', '.join(f.name for f in __import__('dataclasses').fields(TrainConfig))}).",
        epilog="Exit codes as for ckptbridge: 3 input not found, 4 corrupt file, 5 unsupported, 8 configuration; "
        "9 another process of the run stopped.",
    )
    p.add_argument("--preset", required=True, choices=sorted(PRESETS), help="recipe to start from")
    p.add_argument("--base", required=True, help="HF base model directory (with tokenizer and chat template), or its "
                   "Hub id (ORG/NAME[@REV]: from the Hugging Face cache, downloaded where needed)")
    p.add_argument("--data", default=SAMPLE_DATA, help="training rows, jsonl (default: the bundled sample)")
    p.add_argument("--out", help="run directory (config, metrics, checkpoints); re-use to resume (required but with "
                   "--dry-run)")
    p.add_argument("--config", help="YAML or JSON file of settings")
    p.add_argument("--max-steps", type=int, help="stop after this many optimizer steps")
    p.add_argument("--no-packing", action="store_true", help="one example per row, padded (the paper's setup)")
    p.add_argument("--allow-config-mismatch", action="store_true",
                   help="train even where Tunix's model of the base's family computes another model than "
                        "transformers (e.g. a RoPE theta or scaling it ignores); default: stop and say what differs")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--dry-run", action="store_true",
                   help="read no weights and train nothing: compile the step programs from the base's config.json "
                        "(it may be all the directory holds) and print, as JSON, the memory each needs per device "
                        "and whether it fits")
    p.add_argument("--topology", metavar="TPU", help="with --dry-run: compile for this TPU slice without its chips, "
                   "e.g. v5p:2x2x1 (a v5p-8) or v5e:1x1 (needs libtpu: pip install 'jax[tpu]')")
    g = p.add_argument_group("several processes", "one run over the devices of several processes (the hosts of a "
                             "TPU slice, or processes on one machine): start the same command in each. Without "
                             "these flags JAX's variables JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and "
                             "JAX_PROCESS_ID are read, and a multi-host TPU slice describes itself")
    g.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's host and a free port, the same in every "
                   "process")
    g.add_argument("--num-processes", type=int, metavar="N", help="how many processes train the run")
    g.add_argument("--process-id", type=int, metavar="I", help="this process's index, 0 to N-1 (0 runs the "
                   "coordinator and writes the run's metrics)")
    g.add_argument("--peer-timeout", type=float, metavar="SECONDS", default=None,
                   help="seconds without a heartbeat from another process before this one stops with a line "
                        "naming it (default 180); a process that ends is seen at once, through the connection "
                        "its end closes")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="setting overrides, e.g. rank=16 learning_rate=2e-4")
    return p


def _fit_line(report: dict) -> str:
    where = f"{report['devices']} x {report['device_kind']}"
    if report.get("processes", 1) > 1:
        where += f" on {report['processes']} hosts (global micro-batch {report['global_micro_batch']})"
    if report.get("programs") is None:
        return f"training: the step does not fit {where}: {report.get('compiler')}"
    peak = report["step_peak_bytes"] / 1e9
    limit = report.get("device_memory_bytes")
    if limit is None:
        return f"training: the step needs {peak:.2f} GB per device on {where} (its memory is not known)"
    verdict = "fits" if report["fits"] else "does not fit"
    return f"training: the step needs {peak:.2f} GB per device of {limit / 1e9:.2f} GB: {verdict} {where}"


def _name_process_in_log() -> None:
    """Each line a process logs says which process it is."""
    import jax

    tag = f"[process {jax.process_index()}/{jax.process_count()}]"
    for handler in logging.getLogger().handlers:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {tag} %(name)s: %(message)s"))


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.topology and not args.dry_run:
        parser.error("--topology compiles for chips that are not here: use it with --dry-run")
    if not args.dry_run and not args.out:
        parser.error("--out is required (the run directory), except with --dry-run")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    for name in ("absl", "jax", "orbax", "transformers", "tunix", "grain"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        deps.require("train")  # before anything is read or written
        from training.config import build_config

        overrides = list(args.overrides)
        if args.max_steps is not None:
            overrides.append(f"max_steps={args.max_steps}")
        if args.no_packing:
            overrides.append("packing=false")
        if args.allow_config_mismatch:
            overrides.append("allow_config_mismatch=true")
        cfg = build_config(args.preset, args.config, overrides)
        if cfg.xla_flags and cfg.xla_flags not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {cfg.xla_flags}".strip()
        from training import distributed
        from training.mesh import start_backend

        cluster = None if args.dry_run else distributed.cluster_of(args.coordinator, args.num_processes,
                                                                   args.process_id)
        if args.dry_run and (args.coordinator or args.num_processes is not None or args.process_id is not None):
            parser.error("--dry-run compiles in this one process (a slice of several hosts: --topology); "
                         "leave out --coordinator, --num-processes and --process-id")
        if cluster is not None:  # before JAX's backend starts
            distributed.join(cluster, peer_timeout=args.peer_timeout or distributed.DEFAULT_PEER_TIMEOUT)
            _name_process_in_log()
        if not args.topology:
            start_backend()  # while the trainer imports Tunix, Flax and Orbax
        from training.trainer import train

        from ckptbridge import hub

        if args.dry_run:
            from training.trainer import dry_run

            report = dry_run(cfg, base=hub.local(args.base, hub.MODEL, what="base model"), topology=args.topology)
            print(json.dumps(report, indent=2))
            print(_fit_line(report), file=sys.stderr)
            return 0
        summary = train(cfg, base=hub.local(args.base, hub.MODEL, what="base model"), data_path=args.data, out=args.out,
                        progress=False if args.quiet else None)
        distributed.finish()
    except CkptBridgeError as e:
        print(f"training: error: {e}", file=sys.stderr)
        return e.exit_code
    except Exception as e:  # a package that does not import with the versions beside it: one line
        from training import distributed

        distributed.end_if_peer_lost(e)  # a collective that failed because a peer is gone: exit 9
        code = deps.import_failure_exit("training", e, "train")
        if code is None:
            raise
        return code
    print(json.dumps(summary, indent=2))
    return 0

