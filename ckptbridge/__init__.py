"""ckptbridge: exact, streaming conversion of checkpoints between Tunix/Orbax and HF safetensors.

Public API::

    from ckptbridge import convert_safetensors_to_orbax, convert_orbax_to_safetensors, inspect_path
    from ckptbridge import convert_orbax_to_peft, convert_peft_to_orbax, merge_lora
    from ckptbridge import load_tunix_model      # HF directory or Orbax checkpoint -> the Tunix model of its family
    from ckptbridge import verify_adapter, lint_adapter, served_parity   # is an adapter live and exact
"""

from ckptbridge.errors import CkptBridgeError

__version__ = "0.1.0"

_LAZY = {
    "convert_safetensors_to_orbax": "ckptbridge.convert",
    "convert_orbax_to_safetensors": "ckptbridge.convert",
    "convert_orbax_to_peft": "ckptbridge.adapters",
    "convert_peft_to_orbax": "ckptbridge.adapters",
    "merge_lora": "ckptbridge.merge",
    "inspect_path": "ckptbridge.inspect",
    "load_tunix_model": "ckptbridge.tunix_model",
    "tunix_model_config": "ckptbridge.tunix_model",
    "verify_adapter": "ckptbridge.adapter_check",
    "lint_adapter": "ckptbridge.adapter_check",
    "served_parity": "ckptbridge.verify",
}


def __getattr__(name: str):
    # Lazy so that `import ckptbridge` stays light (no jax/torch import until needed).
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ckptbridge' has no attribute {name!r}")


__all__ = ["CkptBridgeError", "__version__", *_LAZY]
