"""Model cards (``README.md``) for what ckptbridge writes for the Hub: exported adapters and merged
models, so that ``hf upload`` needs nothing else.

The YAML front matter is the one PEFT's ``save_pretrained`` writes for a LoRA adapter
(``base_model``, ``library_name: peft``, ``pipeline_tag``, tags with ``lora`` and
``base_model:adapter:<base>``), or for a merged model ``base_model`` with
``base_model_relation: merge``. The body says how the files were made. Written by hand (the
values are strings and lists): no huggingface_hub needed.
"""

from __future__ import annotations

import json
import os
import re

FILENAME = "README.md"
# a Hub repository id: "name" or "org/name" (the Hub's own rule: letters, digits, - _ .)
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")
# a snapshot folder of the Hub cache: .../models--org--name/snapshots/<revision>
_CACHE_SNAPSHOT = re.compile(r"(?:^|/)models--(.+?)/snapshots/[^/]+/?$")


def is_repo_id(value: str) -> bool:
    return bool(_REPO_ID.match(value)) and not value.endswith((".", "-")) and ".." not in value


def check_repo_id(name: str, value: str | None) -> None:
    """A ConfigError naming the parameter ``name`` when ``value`` is given and not a Hub model id."""
    if value is not None and not is_repo_id(value):
        from ckptbridge.errors import ConfigError

        raise ConfigError(f"{name} {value!r}: not a Hub model id (ORG/NAME)")


def hub_id(path: str, explicit: str | None = None) -> str | None:
    """The Hub id of the model or adapter at ``path``: ``explicit`` when given, else the repository
    of a Hub cache snapshot folder, else the config's ``_name_or_path`` when that is a Hub id (not a
    local path); None when none says."""
    if explicit:
        return explicit
    m = _CACHE_SNAPSHOT.search(os.path.abspath(path).replace(os.sep, "/"))
    if m:
        return m.group(1).replace("--", "/")
    from ckptbridge.errors import CkptBridgeError
    from ckptbridge.io.files import read_json_object

    try:
        name = read_json_object(os.path.join(path, "config.json"), "").get("_name_or_path")
    except (CkptBridgeError, OSError):
        return None
    if isinstance(name, str) and is_repo_id(name) and "/" in name and not os.path.exists(name):
        return name
    return None


def _yaml(data: dict) -> str:
    """YAML front matter of strings and lists of strings (JSON strings are YAML strings)."""
    lines = ["---"]
    for key, value in data.items():
        if isinstance(value, list):
            lines.append(f"{key}:")
            lines.extend(f"- {json.dumps(v)}" for v in value)
        else:
            lines.append(f"{key}: {json.dumps(value)}")
    lines.append("---")
    return "\n".join(lines) + "\n"


def _table(rows: list[tuple[str, str]]) -> str:
    out = ["| | |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in rows if v not in (None, "")]
    return "\n".join(out) + "\n"


def _version() -> str:
    from ckptbridge import __version__

    return __version__


def installed_version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def adapter_card(*, base_id: str | None, base_path: str, source: str, step: int | None, rank: int,
                 alpha: float, patterns: int, target_modules: list[str], target: str, family: str,
                 peft_version: str | None = None, base_quant: dict | None = None) -> str:
    """README.md of a PEFT adapter exported from a Tunix/qwix LoRA checkpoint."""
    base = base_id or os.path.abspath(base_path)
    meta: dict = {}
    if base_id:
        meta["base_model"] = base_id
    meta["library_name"] = "peft"
    meta["pipeline_tag"] = "text-generation"
    meta["tags"] = ([f"base_model:adapter:{base_id}"] if base_id else []) + ["ckptbridge", "lora", "transformers"]
    made = f"step {step} of " if step is not None else ""
    text = [
        _yaml(meta),
        f"# LoRA adapter for {base}\n",
        f"A PEFT LoRA adapter for [{base_id}](https://huggingface.co/{base_id}), " if base_id else
        f"A PEFT LoRA adapter for the model at `{base}`, ",
        f"converted with ckptbridge {_version()} from {made}the Tunix/qwix LoRA checkpoint `{source}`.\n\n",
        _table([
            ("model family", family),
            ("rank", str(rank)),
            ("lora_alpha", f"{alpha:g}"),
            ("per-module ranks/alphas", f"{patterns} modules (`rank_pattern` / `alpha_pattern`)" if patterns else ""),
            ("target modules", ", ".join(f"`{m}`" for m in target_modules)),
            ("exported for", {"vllm": "vLLM (`--target vllm`)", "hf": "transformers + PEFT"}.get(target, target)),
            ("trained against (QLoRA)", quant_line(base_quant) if base_quant else ""),
        ]),
        _qlora_section(base) if base_quant else "",
        "\n## Use\n\n```python\nfrom peft import PeftModel\nfrom transformers import AutoModelForCausalLM\n\n"
        f"base = AutoModelForCausalLM.from_pretrained({json.dumps(base)})\n"
        "model = PeftModel.from_pretrained(base, \"path/or/id/of/this/adapter\")\n```\n",
        "\n### Framework versions\n\n",
        f"- PEFT {peft_version}\n" if peft_version else "",
        f"- ckptbridge {_version()}\n",
    ]
    return "".join(text)


def quant_line(record: dict) -> str:
    """One line of how a QLoRA run held its base, e.g. ``nf4 quantization of the base (qwix 0.1.8)``."""
    tile = f", tiles of {record['tile']}" if record.get("tile") else ""
    version = f"qwix {record['qwix_version']}" if record.get("qwix_version") else "qwix"
    return f"{record.get('scheme')} quantization of the base ({version}{tile}, {record.get('param_dtype')} scales)"


def _qlora_section(base: str) -> str:
    return ("\n## Trained on a quantized base\n\n"
            "The training run held the base quantized (`base_quant.json` says how). On the base as it is, as above, "
            "the adapter computes slightly differently from the trained model (the usual QLoRA practice). To "
            "reproduce the trained model exactly, merge it into the base quantized as the run held it:\n\n"
            f"```bash\nckptbridge merge {base} path/of/this/adapter MERGED --as-trained\n```\n")


def _model_meta(base_id: str | None, relation: str, tags: list[str], towers: dict | None = None) -> dict:
    """Front matter of a full model made from ``base_id`` (``relation``: the Hub's base_model_relation;
    ``towers``: a multimodal model's, :func:`ckptbridge.rows.tower_record`)."""
    meta: dict = {}
    if base_id:
        meta["base_model"] = [base_id]
        meta["base_model_relation"] = relation
    meta["library_name"] = "transformers"
    meta["pipeline_tag"] = "image-text-to-text" if _held(towers) else "text-generation"
    meta["tags"] = tags
    return meta


def _held(towers: dict | None) -> dict:
    return {k: v for k, v in (towers or {}).items() if k != "spelling" and isinstance(v, dict)}


def towers_row(towers: dict | None) -> tuple[str, str]:
    """The model card's table row of a multimodal model's towers (empty for a text model)."""
    held = _held(towers)
    return ("towers (byte for byte the base's)",
            ", ".join(f"{k} ({v['tensors']} tensors)" for k, v in held.items()) if held else "")


def merged_card(*, base_id: str | None, base_path: str, adapter: str, adapter_id: str | None, step: int | None,
                family: str, merged_tensors: int, quantized: str | None = None, towers: dict | None = None) -> str:
    """README.md of a model merged from a base and a LoRA adapter (``quantized``: how its weights were
    quantized in the same pass, from :meth:`ckptbridge.formats.compressed_tensors.Plan.describe`;
    ``towers``: the vision/audio towers it carries, :func:`ckptbridge.rows.tower_record`)."""
    base = base_id or os.path.abspath(base_path)
    meta = _model_meta(base_id, "merge", ["ckptbridge", "lora", "merge"], towers)
    what = f"[{adapter_id}](https://huggingface.co/{adapter_id})" if adapter_id else \
        f"`{adapter if adapter.startswith('gs://') else os.path.abspath(adapter)}`"
    made = f" (step {step})" if step is not None else ""
    return "".join([
        _yaml(meta),
        f"# {base} with a LoRA adapter merged in\n\n",
        f"The LoRA adapter {what}{made} merged into ",
        f"[{base_id}](https://huggingface.co/{base_id})" if base_id else f"the model at `{base}`",
        f" with ckptbridge {_version()}: W + (alpha / r) B A for each of {merged_tensors} weight tensors, "
        "accumulated in float32 and stored in the base's dtype; every other tensor is the base's, byte for "
        "byte. Loads with transformers and vLLM as the base does.\n\n",
        f"Then quantized in the same pass: {_quantization(quantized)}" if quantized else "",
        _table([("model family", family), ("merged tensors", str(merged_tensors)), towers_row(towers)]),
        f"\n### Framework versions\n\n- ckptbridge {_version()}\n",
    ])


def _quantization(description: str) -> str:
    return (f"{description}. The weights, scales and `quantization_config` are "
            "those llm-compressor writes for the same scheme without calibration data; vLLM and transformers "
            "(with compressed-tensors) load it as such.\n\n")


def quantized_card(*, base_id: str | None, base_path: str, family: str, description: str,
                   towers: dict | None = None) -> str:
    """README.md of a quantized copy of an HF model (``towers``: as :func:`merged_card`'s)."""
    base = base_id or os.path.abspath(base_path)
    meta = _model_meta(base_id, "quantized", ["ckptbridge", "compressed-tensors", "quantized"], towers)
    return "".join([
        _yaml(meta),
        f"# {base}, quantized\n\n",
        f"[{base_id}](https://huggingface.co/{base_id})" if base_id else f"The model at `{base}`",
        f" quantized with ckptbridge {_version()}, without calibration data: ",
        _quantization(description),
        _table([("model family", family), towers_row(towers)]),
        f"\n### Framework versions\n\n- ckptbridge {_version()}\n",
    ])
