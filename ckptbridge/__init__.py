"""ckptbridge: exact, streaming conversion of LLM checkpoints and LoRA adapters between formats.

Public API::

    from ckptbridge import convert                 # any format -> any format (ckptbridge.formats)
    convert("base-model", "ckpt", to="tunix")
    convert("runs/31b/checkpoints", "adapter", to="peft", base="base-model", target="vllm")
    convert("base-model", "merged.gguf", adapter="runs/31b/checkpoints", outtype="q8_0")

    from ckptbridge import merge_lora, convert_orbax_to_peft, convert_peft_to_orbax   # the named conversions
    from ckptbridge import inspect_path, load_tunix_model
    from ckptbridge import verify_adapter, lint_adapter, served_parity   # is an adapter live and exact
"""

from ckptbridge.errors import CkptBridgeError

__version__ = "0.1.0"

_API = ("convert_safetensors_to_orbax", "convert_orbax_to_safetensors", "convert_safetensors_to_maxtext",
        "convert_maxtext_to_safetensors", "convert_orbax_to_maxtext", "convert_maxtext_to_orbax",
        "convert_orbax_to_peft", "convert_peft_to_orbax", "convert_peft_to_maxtext", "convert_to_gguf",
        "convert_adapter_to_gguf", "merge_lora", "quantize_model")
_LAZY = {
    "convert": "ckptbridge.conversion",
    **dict.fromkeys(_API, "ckptbridge.api"),
    "inspect_path": "ckptbridge.inspect",
    "load_tunix_model": "ckptbridge.tunix_model",
    "tunix_model_config": "ckptbridge.tunix_model",
    "verify_adapter": "ckptbridge.adapter_check",
    "lint_adapter": "ckptbridge.adapter_check",
    "served_parity": "ckptbridge.verify",
    "verify_gguf": "ckptbridge.verify",
}


def __getattr__(name: str):
    # Lazy so that `import ckptbridge` stays light (no jax/torch import until needed).
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ckptbridge' has no attribute {name!r}")


__all__ = ["CkptBridgeError", "__version__", *_LAZY]
