"""An adapter of any kind (PEFT directory, Tunix/qwix Orbax LoRA checkpoint, MaxText LoRA checkpoint)
and its deltas."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Union

import numpy as np

from ckptbridge.errors import ConfigError, InputNotFoundError
from ckptbridge.io import storage
from ckptbridge.io.files import close_on_error
from ckptbridge.io.orbax import OrbaxCheckpoint, resolve_checkpoint
from ckptbridge.lora.base import Base
from ckptbridge.lora.modules import tunix_to_peft
from ckptbridge.lora.orbax import OrbaxLora, orbax_lora_of
from ckptbridge.lora.peft import ADAPTER_CONFIG, PeftLora, open_peft_lora
from ckptbridge.stream import Engine

if TYPE_CHECKING:
    from ckptbridge.lora.maxtext import MaxTextLora

Adapter = Union[PeftLora, OrbaxLora, "MaxTextLora"]
MAXTEXT_ITEM = "items"  # the item MaxText's Linen checkpoints keep their tree in


def open_checkpoint_lora(src: str, base: Base, *, step: int | None = None, alpha: float | None = None,
                         engine: Engine | None = None) -> OrbaxLora | MaxTextLora:
    """A LoRA checkpoint of either JAX trainer: Tunix/qwix (``<step>/model_params``, the Tunix
    model's tree) or MaxText (``<step>/items`` or an NNX ``model_params``, MaxText's tree with
    ``kernel_lora_a`` / ``kernel_lora_b``), told apart by its tree."""
    first: InputNotFoundError | None = None
    try:
        path = resolve_checkpoint(src, step)
    except InputNotFoundError as e:
        first = e
        try:
            path = resolve_checkpoint(src, step, item=MAXTEXT_ITEM)
        except InputNotFoundError:
            raise first from None
    from ckptbridge.lora import maxtext as maxtext_lora  # it imports the MaxText layout (and convert: a cycle)

    ckpt = OrbaxCheckpoint(path)  # opened once, for whichever reader its tree is for
    with close_on_error(ckpt):
        is_maxtext = maxtext_lora.is_maxtext(ckpt)
        if not is_maxtext and first is not None:  # only MaxText's item is named items
            raise first
    if is_maxtext:
        return maxtext_lora.open_maxtext_lora(ckpt, base, alpha=alpha)
    return orbax_lora_of(path, ckpt, base, alpha=alpha, engine=engine)


def open_adapter(src: str, base: Base, *, step: int | None = None, alpha: float | None = None,
                 engine: Engine | None = None) -> Adapter:
    """A PEFT adapter directory or a Tunix/qwix or MaxText LoRA checkpoint (local or on Cloud
    Storage; a Tunix checkpoint's factors read ahead on ``engine``)."""
    if storage.is_remote(src):
        return open_checkpoint_lora(src, base, step=step, alpha=alpha, engine=engine)
    if not os.path.exists(src):
        raise InputNotFoundError(f"{src}: no such adapter directory")
    if os.path.isfile(os.path.join(src, ADAPTER_CONFIG)):
        if alpha is not None or step is not None:
            raise ConfigError(f"{src}: alpha/step (--alpha, --step) apply to Orbax LoRA checkpoints; "
                              "a PEFT adapter records its own")
        return open_peft_lora(src, base)
    return open_checkpoint_lora(src, base, step=step, alpha=alpha, engine=engine)


def hf_deltas(adapter: Adapter) -> Iterable[tuple[str, int, float, tuple[np.ndarray, np.ndarray]]]:
    """(HF key, first row, scale, (lora_A, lora_B)) for every LoRA delta of an adapter of either
    kind, in PEFT layout: ``scale * B @ A`` adds to rows ``first row :`` ``+ len(B)`` of the key's
    tensor seen as a matrix ``(prod(shape[:-1]), shape[-1])``. For an Orbax checkpoint each
    module (a batch of them for MaxText's) is read and converted when reached."""
    if isinstance(adapter, PeftLora):
        for module in adapter.keys:
            yield adapter.base.weight_key(module), 0, adapter.scaling[module].scale, adapter.pair(module)
        for param in adapter.params.values():
            for key, row, pair in param.expert_deltas(adapter.file):
                yield key, row, param.scaling.scale, pair
    elif isinstance(adapter, OrbaxLora):
        for mod, sc in adapter.scaling.items():
            for name, pair in zip(mod.hf_modules, tunix_to_peft(mod, *adapter.factors(mod))):
                yield adapter.base.weight_key(name), 0, sc.scale, pair
    else:
        for module, scale, pair in adapter.deltas():
            yield adapter.base.weight_key(module), 0, scale, pair
