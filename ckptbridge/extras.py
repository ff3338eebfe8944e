"""Which ``pip install`` brings a missing module: the core install reads and writes safetensors
and PEFT files with numpy alone; Orbax, the Hub and the cross-framework checks come as extras."""

from __future__ import annotations

# top-level module -> the extra of ckptbridge that installs it
EXTRA_OF = {
    "orbax": "orbax", "tensorstore": "orbax", "jax": "orbax", "jaxlib": "orbax", "etils": "orbax",
    "huggingface_hub": "hub", "gcsfs": "gcs",
    "flax": "verify", "qwix": "verify", "tunix": "verify", "torch": "verify", "transformers": "verify",
    "peft": "verify", "safetensors": "verify",
    "grain": "train", "optax": "train",
    "vllm": "serve",
}


def missing_line(error: ModuleNotFoundError, extra: str | None = None) -> str | None:
    """One line naming the ``pip install`` that brings ``error``'s module (``extra``: the one the
    verb needs as a whole), or None when it is not a module of an extra (then it is a broken
    install, not a missing extra)."""
    top = (error.name or "").split(".")[0]
    if top not in EXTRA_OF:
        return None
    extra = extra or EXTRA_OF[top]
    return f"this needs {top}, which is not installed here: pip install 'ckptbridge[{extra}]'"
