"""``ckptbridge verify adapter``: prove that a LoRA adapter is right for its base and its target.

Three checks, cheapest first:

* **lint** (files only, no model): every LoRA tensor belongs to a LoRA-able module of BASE and
  fits its shape; ``target_modules`` selects those modules (PEFT applies nothing it does not
  select); factors are finite and not all zero; a vLLM-bound adapter carries the copies vLLM
  needs under the family's module aliases (a ``v_proj`` computed from ``k_proj``); rank against
  vLLM's ``--max-lora-rank``; features vLLM or Tunix cannot take (DoRA, ``modules_to_save``,
  biases); ``base_model_name_or_path`` against BASE's config. One :class:`Finding` per problem,
  each one line with its fix.
* **live** (transformers + PEFT): the adapter moves BASE's logits (relative L2 of the change).
* **exact**: transformers + PEFT logits against Tunix + qwix logits of the same adapter, converted
  through ckptbridge in whichever direction is needed (float32, relative L2).

An adapter is a PEFT directory or a Tunix/qwix Orbax LoRA checkpoint in any form
``orbax-to-peft`` accepts.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile

import numpy as np

from ckptbridge import deps, options
from ckptbridge.errors import CkptBridgeError, ConfigError, CorruptFileError, MismatchError, UnsupportedError
from ckptbridge.formats import peft
from ckptbridge.formats.tunix_lora import open_orbax_lora
from ckptbridge.io.files import read_json_object
from ckptbridge.lora.base import Base, open_base
from ckptbridge.metadata import KEY, Metadata
from ckptbridge.options import EXACT_TOLERANCE, LIVE_TOLERANCE, TARGETS
from ckptbridge.report import Report
from ckptbridge.verify import adapter_kind, as_peft, prompt_ids

ALIAS = "vllm-alias"  # findings about modules vLLM computes with a LoRA slot of their own



@dataclasses.dataclass(frozen=True)
class Finding:
    """One lint result: ``error`` makes the adapter wrong in its target, ``warning`` needs a look
    or a flag, ``info`` is for the record."""

    severity: str  # "error" | "warning" | "info"
    check: str  # short name of what was checked
    message: str  # one line: what, where, and what to do

    def line(self) -> str:
        return f"{self.severity}: [{self.check}] {self.message}"


@dataclasses.dataclass
class Lint:
    adapter: str
    base: str
    kind: str  # "peft" | "orbax"
    target: str
    findings: list[Finding] = dataclasses.field(default_factory=list)
    modules: int = 0  # adapter modules that are LoRA-able modules of BASE
    max_rank: int = 0
    loadable: bool = True  # False: an Orbax checkpoint does not open against BASE (not checked further)

    def add(self, severity: str, check: str, message: str) -> None:
        self.findings.append(Finding(severity, check, " ".join(message.split())))

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def max_lora_rank(self) -> int:
        return peft.next_rank(self.max_rank)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "target": self.target, "modules": self.modules, "max_rank": self.max_rank,
                "vllm_max_lora_rank": self.max_lora_rank, "ok": not self.errors,
                "findings": [dataclasses.asdict(f) for f in self.findings]}


# --------------------------------------------------------------------------- lint


def _config_summary(hf_config: dict) -> dict:
    sub = hf_config.get("text_config")
    text: dict = sub if isinstance(sub, dict) else hf_config
    return {"model_type": text.get("model_type"), "hidden_size": text.get("hidden_size"),
            "num_hidden_layers": text.get("num_hidden_layers"), "vocab_size": text.get("vocab_size")}


def _describe(summary: dict) -> str:
    return (f"{summary['model_type']}, hidden {summary['hidden_size']}, {summary['num_hidden_layers']} layers, "
            f"vocab {summary['vocab_size']}")


def _recorded_base_config(name: str | None) -> tuple[dict | None, str]:
    """config.json of the base an adapter records: a local directory, or the Hugging Face cache."""
    if not name:
        return None, "not recorded"
    path = os.path.join(name, "config.json")
    if not os.path.isfile(path):
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(name, "config.json")
        except Exception:  # noqa: BLE001 - not a repo id, or no huggingface_hub: cannot tell
            cached = None
        if not isinstance(cached, str):
            return None, "neither a local directory nor in the Hugging Face cache"
        path = cached
    try:
        return read_json_object(path, "the shapes are checked against BASE instead"), path
    except (CkptBridgeError, OSError) as e:
        return None, str(e)


def _check_recorded_base(lint: Lint, base: Base, recorded: str | None, where: str) -> None:
    cfg, whence = _recorded_base_config(recorded)
    if cfg is None:
        if recorded:
            lint.add("info", "base", f"{where}: base {recorded!r} cannot be read here ({whence}); shapes were checked "
                                     f"against {base.path} instead")
        return
    from ckptbridge.config import read_config_file

    base_cfg = read_config_file(os.path.join(base.path, "config.json"))
    ours, theirs = _config_summary(base_cfg), _config_summary(cfg)
    if ours != theirs:
        lint.add("error", "base", f"{where}: made for {recorded} ({_describe(theirs)}) but BASE {base.path} is "
                                  f"{_describe(ours)}: use the adapter with the base it was trained on")
    elif cfg.get("architectures") != base_cfg.get("architectures"):
        lint.add("info", "base", f"{where}: made for {recorded} ({cfg.get('architectures')}), BASE is "
                                 f"{base_cfg.get('architectures')}: the same text model under another class")


def _note_base_quant(lint: Lint, record: dict | None, where: str, base: Base) -> None:
    """An adapter trained on a quantized base (QLoRA): said, with how to reproduce the trained model."""
    if not record:
        return
    from ckptbridge.model_card import quant_line

    lint.add("info", "base-quant", f"{where}: trained against the {quant_line(record)}; on BASE as it is (PEFT, "
                                   "vLLM, a plain merge) it computes slightly differently from the trained model; "
                                   f"`ckptbridge merge {base.path} {lint.adapter} MERGED --as-trained` reproduces it")


def _values_check(lint: Lint, arrays, where: str) -> None:
    """Factors must be finite, and some lora_B (and its A) non-zero, or the adapter does nothing."""
    zero, bad, total = [], [], 0
    for name, a, b in arrays:
        total += 1
        a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if not (np.isfinite(a32).all() and np.isfinite(b32).all()):
            bad.append(name)
        elif not a32.any() or not b32.any():
            zero.append(name)
    if bad:
        lint.add("error", "values", f"{where}: {len(bad)} module(s) have NaN or infinite factors (e.g. {bad[0]}): the "
                                    "training diverged; use an earlier checkpoint")
    if total and len(zero) == total:
        lint.add("error", "live", f"{where}: every module has an all-zero lora_B or lora_A: the adapter changes "
                                  "nothing (untrained, or saved right after initialisation)")
    elif zero:
        lint.add("warning", "live", f"{where}: {len(zero)} of {total} modules have an all-zero factor and change "
                                    f"nothing (e.g. {zero[0]})")


def _reexport(adapter: str, base: str, source: str | None) -> str:
    if source:
        return f"re-export it: `ckptbridge convert orbax-to-peft {source} NEW_DIR --base {base} --target vllm`"
    return (f"re-export it: `ckptbridge convert peft-to-orbax {adapter} CKPT --base {base}` then "
            f"`ckptbridge convert orbax-to-peft CKPT NEW_DIR --base {base} --target vllm`")


def _vllm_rank(lint: Lint, where: str, merge_hint: str) -> None:
    if lint.target != "vllm" or not lint.max_rank:
        return
    if lint.max_rank > peft.LORA_RANKS[-1]:
        lint.add("error", "rank", f"{where}: rank {lint.max_rank} exceeds vLLM's largest --max-lora-rank "
                                  f"{peft.LORA_RANKS[-1]}; {merge_hint}")
    elif lint.max_rank > peft.DEFAULT_MAX_LORA_RANK:
        lint.add("warning", "rank", f"{where}: rank {lint.max_rank} exceeds vLLM's default --max-lora-rank "
                                    f"{peft.DEFAULT_MAX_LORA_RANK}: start vLLM with --max-lora-rank "
                                    f"{lint.max_lora_rank} (`python -m serving serve` does)")


def lint_adapter(adapter: str, base: str, *, target: str = "hf", step: int | None = None,
                 alpha: float | None = None) -> Lint:
    """Check an adapter against BASE for ``target`` ("hf": transformers/PEFT, "vllm") from files alone.
    Inputs that cannot be read at all (missing, corrupt) raise as the conversions do."""
    options.choice("target", target, TARGETS)
    if not os.path.exists(adapter):
        from ckptbridge.errors import InputNotFoundError

        raise InputNotFoundError(f"{adapter}: no such adapter directory")
    b = open_base(base)
    lint = Lint(adapter, base, adapter_kind(adapter), target)
    if lint.kind == "peft":
        if step is not None or alpha is not None:
            raise ConfigError(f"{adapter}: alpha/step (--alpha, --step) apply to Orbax LoRA checkpoints; "
                              "a PEFT adapter records its own")
        _lint_peft(lint, b)
    else:
        _lint_orbax(lint, b, step, alpha)
    return lint


def _lint_orbax(lint: Lint, b: Base, step: int | None, alpha: float | None) -> None:
    src = lint.adapter
    deps.require("orbax")  # an unusable Orbax is the environment's fault, not the adapter's
    try:
        ad = open_orbax_lora(src, b, step=step, alpha=alpha)
    except (MismatchError, UnsupportedError) as e:
        lint.loadable = False
        lint.add("error", "targets", str(e))
        return
    except ConfigError as e:
        lint.loadable = False
        lint.add("error", "alpha", str(e))
        return
    with ad:
        lint.modules = sum(len(m.hf_modules) for m in ad.scaling)
        lint.max_rank = max(sc.rank for sc in ad.scaling.values())
        _check_recorded_base(lint, b, ad.metadata.base, ad.path)
        _note_base_quant(lint, ad.base_quant, ad.path, b)
        _values_check(lint, (("/".join(m.path), *f) for m, f in ad.module_factors()), ad.path)
        if lint.target == "vllm":
            aliased = [m for m in ad.scaling if m.vllm_aliases]
            how = f"`ckptbridge convert orbax-to-peft {src} NEW_DIR --base {b.path} --target vllm`"
            lint.add("info", "export", f"{ad.path}: a Tunix checkpoint is served by vLLM as a PEFT adapter: {how}"
                     + (f" (it adds the copies vLLM needs under {len(aliased)} module alias(es), e.g. "
                        f"{aliased[0].vllm_aliases[0]})" if aliased else ""))
        _vllm_rank(lint, ad.path, f"merge it (`ckptbridge merge {b.path} {src} MERGED`) and serve the merged model")


def _base_module_names(b: Base) -> set[str]:
    """Names of BASE's modules that own a weight (from the weight files' keys; no weights read)."""
    names = {name for m in b.modules for name in m.hf_modules}
    if any(n.endswith(".safetensors") for n in os.listdir(b.path)):
        from ckptbridge.io.hf import HFModelDir

        with HFModelDir(b.path) as model:
            names |= {b.module_prefix + k[len(b.prefix):-len(".weight")] if k.startswith(b.prefix) else
                      k.removesuffix(".weight") for k in model.keys() if k.endswith(".weight")}
    return names


def _lint_peft(lint: Lint, b: Base) -> None:
    from ckptbridge.io.hf import check_inside
    from ckptbridge.io.safetensors import SafetensorsFile

    src, target = lint.adapter, lint.target
    cfg = peft.AdapterConfig.read(src)
    where = os.path.join(src, peft.ADAPTER_CONFIG)
    if cfg.peft_type != "LORA":
        lint.add("error", "format", f"{where}: peft_type {cfg.peft_type!r}; only LoRA adapters can be checked")
        return
    _lint_features(lint, cfg, where, b)
    weights = os.path.join(src, peft.ADAPTER_WEIGHTS)
    if not os.path.isfile(weights):
        from ckptbridge.errors import InputNotFoundError

        if os.path.isfile(os.path.join(src, "adapter_model.bin")):
            raise UnsupportedError(f"{os.path.join(src, 'adapter_model.bin')}: pickle adapters are never loaded; "
                                   "re-save with save_pretrained(..., safe_serialization=True)")
        raise InputNotFoundError(f"{src}: no {peft.ADAPTER_WEIGHTS}")
    with SafetensorsFile(check_inside(src, weights)) as f:
        source = Metadata.from_json((f.metadata or {}).get(KEY)).source
        _note_base_quant(lint, peft.base_quant_of(src, f.metadata or {}), src, b)
        modules: dict[str, list] = {}
        others = []
        for key in f.keys():
            parsed = peft.parse_factor_key(key)
            if parsed is None:
                others.append(key)
                continue
            modules.setdefault(parsed[0], [None, None])["AB".index(parsed[1])] = key
        if others:
            why = ("modules_to_save weights" if cfg.modules_to_save else "not LoRA factors")
            lint.add("error" if target == "vllm" else "warning", "format",
                     f"{weights}: {len(others)} tensor(s) are {why} (e.g. {others[0]}); vLLM and Tunix take LoRA "
                     "factors only")
        if not modules:
            lint.add("error", "targets", f"{weights}: no LoRA tensors")
            return
        _lint_peft_modules(lint, b, cfg, f, modules, source)


def _lint_features(lint: Lint, cfg: peft.AdapterConfig, where: str, b: Base) -> None:
    vllm = lint.target == "vllm"
    merge = ("merge it with PEFT (`merge_and_unload`) and serve the merged model" if vllm else
             "transformers+PEFT apply it, but it cannot go to Tunix (no exact check)")
    if cfg.use_dora:
        lint.add("error" if vllm else "warning", "dora", f"{where}: DoRA (use_dora): vLLM refuses it and qwix has no "
                 f"equivalent; {merge}")
    if cfg.modules_to_save:
        lint.add("error" if vllm else "warning", "modules_to_save",
                 f"{where}: modules_to_save {cfg.modules_to_save} trains whole modules; vLLM refuses them and a "
                 f"qwix LoRA cannot carry them; {merge}")
    if cfg.lora_bias or cfg.bias not in (None, "none"):
        lint.add("error" if vllm else "warning", "bias", f"{where}: LoRA biases (bias={cfg.bias!r}, lora_bias="
                 f"{cfg.lora_bias!r}): vLLM refuses them and qwix has none; {merge}")
    for field in ("layer_replication", "trainable_token_indices", "alora_invocation_tokens"):
        if cfg.get(field):
            lint.add("error" if vllm else "warning", "features", f"{where}: {field} is set; vLLM and Tunix cannot "
                     f"apply it; {merge}")
    if cfg.use_rslora:
        lint.add("info", "scale", f"{where}: rsLoRA (scale alpha / sqrt(r)): honoured by PEFT, vLLM and ckptbridge's "
                                  "conversions")
    if vllm and (cfg.rank_pattern or cfg.alpha_pattern):
        lint.add("info", "patterns", f"{where}: rank_pattern/alpha_pattern set: vLLM 0.32 (this project's serving "
                                     "environment) honours them; releases before it used the global r/lora_alpha "
                                     "for every module (re-export with `--target vllm` for one uniform rank)")
    for problem in cfg.number_problems():
        lint.add("error", "format", f"{where}: {problem}")
    _check_recorded_base(lint, b, cfg.base_model_name_or_path, where)


def _lint_peft_modules(lint: Lint, b: Base, cfg: peft.AdapterConfig, f, modules: dict, source: str | None) -> None:
    src, weights = lint.adapter, f.path
    where = os.path.join(src, peft.ADAPTER_CONFIG)
    known = b.by_hf_module()
    alias_of = b.vllm_aliases()
    rename = b.module_names()  # adapter module name -> BASE module name
    base_names = _base_module_names(b)
    own, foreign, absent = {}, [], []
    for module, pair in modules.items():
        name = rename.get(module, module)
        if name in known or name in alias_of:
            own[name] = pair
        elif name in base_names:
            foreign.append(module)
        else:
            absent.append(module)
    if absent:
        lint.add("error", "targets", f"{weights}: {len(absent)} LoRA module(s) are not modules of BASE {b.path} (e.g. "
                                     f"{absent[0]}): they load into nothing; the adapter was made for another model")
    if foreign:
        lint.add("warning", "targets", f"{weights}: {len(foreign)} LoRA module(s) are not attention/MLP projections "
                                       f"(e.g. {foreign[0]}); transformers+PEFT apply them, Tunix/qwix cannot")
    used = {max((p for p in b.spec.key_prefixes if m.startswith(p)), key=len) for m in modules
            if rename.get(m, m) != m}
    if used:
        fix = ("re-export it for this base: `ckptbridge convert peft-to-orbax ADAPTER CKPT --base BASE` then "
               "`ckptbridge convert orbax-to-peft CKPT NEW_DIR --base BASE` (written under BASE's prefix)")
        lint.add("error" if lint.target == "hf" else "warning", "targets",
                 f"{weights}: module names use the key prefix {sorted(used)[0]} while BASE's modules are under "
                 f"{b.prefix}; PEFT loads LoRA tensors by module name, so none of them would load; {fix}")
    # what PEFT wraps: target_modules against BASE's module names
    selected = [n for n in sorted(base_names) if cfg.selects(n)]
    if not selected:
        lint.add("error", "targets", f"{where}: target_modules {cfg.target_modules!r} match no module of BASE "
                                     f"{b.path}: PEFT refuses to load it and nothing would be applied")
    else:
        skipped = [n for n in own if n not in alias_of and not cfg.selects(n)]
        if skipped:
            lint.add("error", "targets", f"{where}: {len(skipped)} module(s) have LoRA tensors that target_modules "
                                         f"{cfg.target_modules!r} does not select (e.g. {skipped[0]}): PEFT "
                                         "loads them into nothing; list them in target_modules")
    # shapes, ranks, dtypes
    bad_shape, bad_rank, half, misfit = [], [], [], set()
    for name, (ka, kb) in own.items():
        if ka is None or kb is None:
            half.append(name)
            continue
        mod, _ = known.get(name) or known[alias_of[name]]
        ia, ib = f.info(ka), f.info(kb)
        rank = ia.shape[0] if ia.shape else 0
        want = mod.shapes(rank)
        if rank < 1 or ia.shape != want["a_peft"] or ib.shape != want["b_peft"]:
            bad_shape.append(f"{name}: lora_A {ia.shape} / lora_B {ib.shape}, BASE needs {want['a_peft']} / "
                             f"{want['b_peft']}")
            misfit.add(name)
            continue
        r_m = cfg.rank_of(name)
        if isinstance(r_m, (int, float)) and int(r_m) != rank:
            bad_rank.append(f"{name} has rank {rank}, the config says {r_m}")
        lint.max_rank = max(lint.max_rank, rank)
    if half:
        lint.add("error", "format",
                 f"{weights}: {len(half)} module(s) have only one of lora_A / lora_B (e.g. {half[0]})")
    if bad_shape:
        lint.add("error", "shapes", f"{weights}: {len(bad_shape)} module(s) do not fit BASE {b.path} ({bad_shape[0]}): "
                                    "the adapter was made for another base")
    if bad_rank:
        lint.add("error", "rank", f"{weights}: {len(bad_rank)} module(s) disagree with r/rank_pattern of "
                                  f"{peft.ADAPTER_CONFIG} ({bad_rank[0]}); PEFT cannot load it: fix the config")
    good = {n: p for n, p in own.items() if None not in p and n not in misfit}
    lint.modules = len(good)
    _values_check(lint, ((n, f.array(ka), f.array(kb)) for n, (ka, kb) in good.items()), weights)
    # vLLM aliases (vllm_lora_aliases of the family's rules): a module BASE computes from another
    # module's output, which vLLM computes with a LoRA slot of its own; its export repeats the factors
    copies = [n for n in good if n in alias_of]
    unequal = [n for n in copies if alias_of[n] not in good or any(
        f.info(x).shape != f.info(y).shape or f.raw(x) != f.raw(y) for x, y in zip(good[n], good[alias_of[n]]))]
    if unequal:
        lint.add("error", ALIAS, f"{weights}: {unequal[0]} (BASE computes it from {alias_of[unequal[0]]}'s output) "
                                 f"has LoRA factors that are not a copy of {alias_of[unequal[0]]}'s: transformers "
                                 "ignores them and vLLM applies them, so the two compute different models; "
                                 + _reexport(src, b.path, source))
    aliased = [n for n in good if n in known and known[n][0].vllm_aliases]
    missing = [n for n in aliased if not any(a in good for a in known[n][0].vllm_aliases)]
    if lint.target == "vllm" and missing:
        alias = known[missing[0]][0].vllm_aliases[0]
        lint.add("error", ALIAS, f"{weights}: LoRA on {len(missing)} module(s) without the "
                                 f"{alias.rsplit('.', 1)[-1]} copies vLLM needs (e.g. {missing[0]} -> {alias}: vLLM "
                                 "would apply it to one output only, transformers to both; made for "
                                 f"transformers/PEFT); {_reexport(src, b.path, source)}")
    elif lint.target == "hf" and copies and not unequal:
        lint.add("info", ALIAS, f"{weights}: carries {len(copies)} alias copies of LoRA factors for vLLM (e.g. "
                                f"{copies[0]}); transformers+PEFT leave them unused (same model)")
    _vllm_rank(lint, weights, f"retrain at a lower rank or merge it (`ckptbridge merge {b.path} {src} MERGED`) and "
                              "serve the merged model")


# --------------------------------------------------------------------------- live and exact


def _peft_live(base: str, peft_dir: str, tokens: np.ndarray) -> dict:
    """Logits of BASE with and without the adapter (transformers + PEFT, float32, eager)."""
    import torch
    from peft import PeftModel
    from transformers.utils import logging as hf_logging

    from ckptbridge.verify import hf_model_class

    hf_logging.disable_progress_bar()
    model = hf_model_class(base).from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    try:
        model = PeftModel.from_pretrained(model, peft_dir).eval()
    except Exception as e:  # noqa: BLE001 - PEFT's refusal is the finding
        why = " ".join(str(e).split())
        return {"ok": False, "error": f"transformers+PEFT cannot apply it: {type(e).__name__}: {why}"}
    # modules where PEFT now applies a non-zero LoRA (wrapped modules whose factors did not load keep B = 0)
    applied = {name.rsplit(".lora_B", 1)[0] for name, p in model.named_parameters()
               if ".lora_B." in name and bool(p.detach().abs().sum() > 0)}
    with torch.no_grad():
        with_adapter = model(input_ids=torch.as_tensor(tokens)).logits.float().numpy()
        with model.disable_adapter():
            without = model(input_ids=torch.as_tensor(tokens)).logits.float().numpy()
    change = float(np.linalg.norm(with_adapter.astype(np.float64) - without)
                   / np.linalg.norm(without.astype(np.float64)))
    return {"rel_change": change, "applied_modules": len(applied), "logits": with_adapter}


@dataclasses.dataclass(frozen=True)
class AdapterReport(Report):
    """``verify adapter``: the lint (as :meth:`Lint.to_dict`), then live and exact (None: not run)."""

    OMIT_NONE = ("tokens",)

    adapter: str
    base: str
    lint: dict
    live: dict | None
    exact: dict | None
    tokens: int | None
    ok: bool

    def summary(self) -> str:
        lint = self.lint
        lines = [f"verify adapter {self.adapter} ({lint['kind']}, target {lint['target']}) on {self.base}: "
                 f"{lint['modules']} modules, max rank {lint['max_rank']}"]
        lines += [f"  lint: {f['severity']}: [{f['check']}] {f['message']}" for f in lint["findings"]]
        errors = sum(f["severity"] == "error" for f in lint["findings"])
        lines.append(f"  lint: {'OK' if not errors else 'FAIL'} ({errors} errors, "
                     f"{sum(f['severity'] == 'warning' for f in lint['findings'])} warnings)")
        live, exact = self.live, self.exact
        if live is not None:
            if "rel_change" in live:
                lines.append(f"  live: {'OK' if live['ok'] else 'FAIL'}: the adapter changes the logits by "
                             f"{live['rel_change']:.3e} (relative L2 over {self.tokens} tokens; not live below "
                             f"{live['tolerance']:g}); {live['applied_modules']} modules carry a non-zero LoRA in PEFT")
            else:
                lines.append(f"  live: FAIL: {live.get('error') or live.get('skipped')}")
        if exact is not None:
            if "rel_l2" in exact:
                lines.append(f"  exact: {'OK' if exact['ok'] else 'FAIL'}: transformers+PEFT vs Tunix+qwix relative "
                             f"L2 {exact['rel_l2']:.3e} (tolerance {exact['tolerance']:g}, float32, via "
                             f"{exact['via']})")
            else:
                lines.append(f"  exact: skipped: {exact['skipped']}")
        lines.append("-> OK" if self.ok else "-> FAIL")
        return "\n".join(lines)


def verify_adapter(adapter: str, base: str, *, target: str = "hf", ids: list[int] | None = None,
                   prompt: str | None = None, step: int | None = None, alpha: float | None = None,
                   lint_only: bool = False, exact: bool = True, live_tolerance: float = LIVE_TOLERANCE,
                   tolerance: float = EXACT_TOLERANCE, revision: str | None = None) -> AdapterReport:
    """lint, then live and exact (see the module doc). ``ok`` is False when lint found an error,
    the adapter does not move the logits, or the two frameworks disagree above ``tolerance``.
    ``base`` and ``adapter`` may be Hub ids (``revision``: the base's branch, tag or commit)."""
    from ckptbridge import hub

    base = hub.local(base, hub.MODEL, revision=revision, what="base model")
    adapter = hub.local(adapter, hub.ADAPTER, what="adapter")
    lint = lint_adapter(adapter, base, target=target, step=step, alpha=alpha)
    report = functools.partial(AdapterReport, adapter, base, lint.to_dict())
    if lint_only:
        return report(None, None, None, not lint.errors)
    if not lint.loadable:
        reason = "skipped: the checkpoint does not fit BASE (see lint)"
        return report({"ok": False, "skipped": reason}, {"ok": None, "skipped": reason}, None, False)
    tokens = np.asarray([prompt_ids(base, ids=ids, prompt=prompt)])
    with tempfile.TemporaryDirectory(prefix="ckptbridge-verify-") as tmp:
        peft_dir = as_peft(adapter, base, tmp, step=step, alpha=alpha)
        live = _peft_live(base, peft_dir, tokens)
        logits = live.pop("logits", None)
        if "rel_change" in live:
            live["ok"] = live["rel_change"] > live_tolerance
        live["tolerance"] = live_tolerance
        checked = _exact(lint, adapter, peft_dir, base, tokens, logits, step, alpha, tmp, tolerance) \
            if exact and logits is not None else {"ok": None, "skipped": "--no-exact" if not exact else
                                                  "transformers+PEFT could not apply the adapter"}
    return report(live, checked, int(tokens.shape[1]),
                  not lint.errors and bool(live["ok"]) and checked["ok"] is not False)


def _exact(lint: Lint, adapter: str, peft_dir: str, base: str, tokens, peft_logits, step, alpha, tmp: str,
           tolerance: float) -> dict:
    try:
        import jax

        from ckptbridge.tunix_model import load_tunix_adapter
    except ModuleNotFoundError as e:
        return {"ok": None, "skipped": f"Tunix is not installed here ({e.name}); install ckptbridge[verify]"}
    except ImportError as e:  # installed, but not in versions that import together
        raise deps.DependencyError(deps.import_failure(e, "verify") or str(e)) from None
    from ckptbridge.verify import rel_l2, tunix_logits

    b = open_base(base)
    line = b.spec.mismatch_line(b.cfg)
    if line is not None:  # Tunix's logits would differ with or without the adapter
        return {"ok": None, "skipped": line}

    via = "orbax-to-peft"
    orbax_src = adapter
    if lint.kind == "peft":
        from ckptbridge import convert_peft_to_orbax

        via, orbax_src, step, alpha = "peft-to-orbax", os.path.join(tmp, "orbax"), None, None
        try:
            convert_peft_to_orbax(adapter, orbax_src, base=base, progress=False)
        except (UnsupportedError, MismatchError, CorruptFileError) as e:
            return {"ok": None, "skipped": f"cannot go to Tunix: {e}"}
    jax.config.update("jax_default_matmul_precision", "highest")
    model = load_tunix_adapter(base, orbax_src, step=step, alpha=alpha)
    rel = rel_l2(tunix_logits(model, tokens), peft_logits)
    return {"ok": rel <= tolerance, "rel_l2": rel, "tolerance": tolerance, "via": via}
