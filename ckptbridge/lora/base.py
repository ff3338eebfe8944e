"""The HF base model an adapter belongs to: its config, family, key prefixes and LoRA modules."""

from __future__ import annotations

import dataclasses
import os

from ckptbridge.config import ModelConfig, read_config_file
from ckptbridge.errors import CkptBridgeError, InputNotFoundError
from ckptbridge.formats.hf import find_prefix, open_hf_source
from ckptbridge.io.hf import INDEX_NAME, read_index
from ckptbridge.lora.modules import LoraModule, lora_modules
from ckptbridge.specs import FamilySpec, family_for


@dataclasses.dataclass
class Base:
    """The HF base model an adapter belongs to: config, family, key prefixes (no weights read).

    ``prefix`` is the key prefix of the base's files; ``module_prefix`` the prefix of the same
    modules inside transformers, which PEFT adapters use (they differ for some multimodal
    checkpoints). ``modules`` are named with ``module_prefix``.
    """

    path: str
    cfg: ModelConfig
    spec: FamilySpec
    prefix: str
    modules: list[LoraModule]
    module_prefix: str = ""

    def __post_init__(self) -> None:
        self.module_prefix = self.module_prefix or self.prefix

    def by_hf_module(self) -> dict[str, tuple[LoraModule, int]]:
        return {name: (m, i) for m in self.modules for i, name in enumerate(m.hf_modules)}

    def by_leaf(self) -> dict[tuple[str, ...], tuple[LoraModule, int]]:
        return {leaf: (m, i) for m in self.modules for i, leaf in enumerate(m.leaves)}

    def vllm_aliases(self) -> dict[str, str]:
        """Modules a vLLM export adds -> the module whose factors they repeat."""
        return {alias: m.hf_modules[0] for m in self.modules for alias in m.vllm_aliases}

    def module_names(self) -> dict[str, str]:
        """Every LoRA module name an adapter may use for this base (under any key prefix of the
        family, vLLM repeats included) -> the name the base's modules have."""
        names: dict[str, str] = {}
        for name in [*self.by_hf_module(), *self.vllm_aliases()]:
            if name.startswith(self.module_prefix):
                rest = name[len(self.module_prefix):]
                for p in self.spec.key_prefixes:
                    names.setdefault(p + rest, name)
            names.setdefault(name, name)
        return names

    def weight_key(self, module: str) -> str:
        """The key of ``module``'s weight in the base's files."""
        if self.module_prefix != self.prefix and module.startswith(self.module_prefix):
            module = self.prefix + module[len(self.module_prefix):]
        return f"{module}.weight"


def open_base(path: str) -> Base:
    """Read BASE's config and key prefix; shapes come from the config, weights are not read. BASE
    is an HF model directory, or an Orbax checkpoint ckptbridge wrote (its metadata carries both)."""
    if not os.path.isdir(path):
        raise InputNotFoundError(f"{path}: base (--base) must be the HF base model directory (with config.json)")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        found = _orbax_base(path)
        if found is not None:
            return found
    hf_config = read_config_file(config_path)
    spec = family_for(hf_config, config_path)
    cfg = spec.parse_config(hf_config, config_path)
    prefix = cfg.default_key_prefix
    if any(n.endswith(".safetensors") for n in os.listdir(path)):
        with open_hf_source(path, skip_multimodal=True, quantized_ok=True) as source:
            prefix = source.prefix
    elif os.path.isfile(os.path.join(path, INDEX_NAME)):  # config and index only (a Hub base whose weights stay there)
        prefix = find_prefix(spec, list(read_index(os.path.join(path, INDEX_NAME)))) or prefix
    return make_base(path, cfg, spec, prefix)


def _orbax_base(path: str) -> Base | None:
    """The base of a ckptbridge Orbax weights checkpoint (a Tunix base, a pre-quantized QLoRA
    base), from its metadata; None when ``path`` is no such checkpoint."""
    from ckptbridge.io.orbax import OrbaxCheckpoint, resolve_checkpoint

    try:
        item = resolve_checkpoint(path, None)
    except CkptBridgeError:  # not an Orbax checkpoint: the caller names the config.json it lacks
        return None
    with OrbaxCheckpoint(item) as ckpt:
        meta = ckpt.metadata
    if meta.kind != "weights" or meta.hf_config is None:
        return None
    where = f"{item} (ckptbridge metadata)"
    spec = family_for(meta.hf_config, where)
    cfg = spec.parse_config(meta.hf_config, where)
    prefix = meta.key_prefix if meta.key_prefix in spec.key_prefixes else cfg.default_key_prefix
    return make_base(path, cfg, spec, prefix)


def make_base(path: str, cfg: ModelConfig, spec: FamilySpec, prefix: str) -> Base:
    """The base of a model already read: its config, family and the key prefix of its files."""
    module_prefix = spec.module_prefix(prefix)
    return Base(path, cfg, spec, prefix, lora_modules(cfg, spec, module_prefix), module_prefix)


