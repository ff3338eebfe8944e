"""The named conversions of earlier releases, each :func:`ckptbridge.convert` with its source and
destination formats pinned (and its report's name): the same parameters, defaults and reports."""

from __future__ import annotations

from ckptbridge.conversion import convert
from ckptbridge.options import DEFAULT_CHUNK_SIZE, DEFAULT_MAX_SHARD_SIZE
from ckptbridge.report import Report


def convert_safetensors_to_orbax(src: str, dst: str, *, overwrite: bool = False, skip_multimodal: bool = False,
                                 tunix_version: str | None = None, chunk_size: str | int = DEFAULT_CHUNK_SIZE,
                                 compression: bool = True, workers: int | None = None,
                                 memory_budget: str | int | None = None, progress: bool | None = None,
                                 revision: str | None = None) -> Report:
    """HF model directory (or Hub id) -> Orbax checkpoint of the Tunix state: ``convert(src, dst, to="tunix")``."""
    return convert(src, dst, to="tunix", source_format="hf", direction="safetensors-to-orbax",
                   desc="safetensors -> orbax", overwrite=overwrite, skip_multimodal=skip_multimodal or None,
                   tunix_version=tunix_version, chunk_size=chunk_size, compression=compression, workers=workers,
                   memory_budget=memory_budget, progress=progress, revision=revision)


def convert_orbax_to_safetensors(src: str, dst: str, *, config: str | None = None,
                                 max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE, step: int | None = None,
                                 overwrite: bool = False, chunk_size: str | int = DEFAULT_CHUNK_SIZE,
                                 workers: int | None = None, memory_budget: str | int | None = None,
                                 progress: bool | None = None, quantize: str | None = None) -> Report:
    """Orbax (Tunix) weights checkpoint -> HF model directory: ``convert(src, dst, to="hf")``."""
    return convert(src, dst, to="hf", source_format="tunix", direction="orbax-to-safetensors",
                   desc="orbax -> safetensors", config=config, max_shard_size=max_shard_size, step=step,
                   overwrite=overwrite, chunk_size=chunk_size, workers=workers, memory_budget=memory_budget,
                   progress=progress, quantize=quantize)


def convert_safetensors_to_maxtext(src: str, dst: str, *, scan_layers: bool = False, overwrite: bool = False,
                                   skip_multimodal: bool = False, chunk_size: str | int = DEFAULT_CHUNK_SIZE,
                                   compression: bool = True, vocab_size: int | None = None,
                                   workers: int | None = None, memory_budget: str | int | None = None,
                                   progress: bool | None = None, revision: str | None = None) -> Report:
    """HF model directory -> MaxText checkpoint (``dst/0/items``): ``convert(src, dst, to="maxtext")``."""
    return convert(src, dst, to="maxtext", source_format="hf", direction="safetensors-to-maxtext",
                   desc="safetensors -> maxtext", scan_layers=scan_layers, overwrite=overwrite,
                   skip_multimodal=skip_multimodal or None, chunk_size=chunk_size, compression=compression,
                   vocab_size=vocab_size, workers=workers, memory_budget=memory_budget, progress=progress,
                   revision=revision)


def convert_orbax_to_maxtext(src: str, dst: str, *, scan_layers: bool = False, config: str | None = None,
                             step: int | None = None, overwrite: bool = False,
                             chunk_size: str | int = DEFAULT_CHUNK_SIZE, compression: bool = True,
                             vocab_size: int | None = None, workers: int | None = None,
                             memory_budget: str | int | None = None, progress: bool | None = None) -> Report:
    """Orbax (Tunix) weights checkpoint -> MaxText checkpoint, without HF files in between."""
    return convert(src, dst, to="maxtext", source_format="tunix", direction="orbax-to-maxtext",
                   desc="orbax -> maxtext", scan_layers=scan_layers, config=config, step=step, overwrite=overwrite,
                   chunk_size=chunk_size, compression=compression, vocab_size=vocab_size, workers=workers,
                   memory_budget=memory_budget, progress=progress)


def convert_maxtext_to_safetensors(src: str, dst: str, *, config: str | None = None, step: int | None = None,
                                   max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE, overwrite: bool = False,
                                   chunk_size: str | int = DEFAULT_CHUNK_SIZE, workers: int | None = None,
                                   memory_budget: str | int | None = None,
                                   progress: bool | None = None) -> Report:
    """MaxText checkpoint (scanned or not) -> HF model directory: ``convert(src, dst, to="hf")``."""
    return convert(src, dst, to="hf", source_format="maxtext", direction="maxtext-to-safetensors",
                   desc="maxtext -> safetensors", config=config, step=step, max_shard_size=max_shard_size,
                   overwrite=overwrite, chunk_size=chunk_size, workers=workers, memory_budget=memory_budget,
                   progress=progress)


def convert_maxtext_to_orbax(src: str, dst: str, *, config: str | None = None, step: int | None = None,
                             overwrite: bool = False, tunix_version: str | None = None,
                             chunk_size: str | int = DEFAULT_CHUNK_SIZE, compression: bool = True,
                             workers: int | None = None, memory_budget: str | int | None = None,
                             progress: bool | None = None) -> Report:
    """MaxText checkpoint -> Orbax checkpoint of the Tunix state, without HF files in between."""
    return convert(src, dst, to="tunix", source_format="maxtext", direction="maxtext-to-orbax",
                   desc="maxtext -> orbax", config=config, step=step, overwrite=overwrite,
                   tunix_version=tunix_version, chunk_size=chunk_size, compression=compression, workers=workers,
                   memory_budget=memory_budget, progress=progress)


def convert_orbax_to_peft(src: str, dst: str, *, base: str, step: int | None = None, alpha: float | None = None,
                          target: str = "hf", base_id: str | None = None, overwrite: bool = False,
                          workers: int | None = None, memory_budget: str | int | None = None,
                          progress: bool | None = None, revision: str | None = None) -> Report:
    """Tunix/qwix or MaxText LoRA checkpoint -> PEFT adapter (``target="vllm"``: for vLLM)."""
    return convert(src, dst, to="peft", base=base, direction="orbax-to-peft", desc="orbax -> peft", step=step,
                   alpha=alpha, target=target, base_id=base_id, overwrite=overwrite, workers=workers,
                   memory_budget=memory_budget, progress=progress, revision=revision)


def convert_peft_to_orbax(src: str, dst: str, *, base: str, kv: str = "exact", step: int = 0,
                          overwrite: bool = False, workers: int | None = None, memory_budget: str | int | None = None,
                          progress: bool | None = None, revision: str | None = None) -> Report:
    """PEFT adapter -> Tunix checkpoint root ``dst/<step>/model_params`` with its qwix rules."""
    return convert(src, dst, to="tunix-lora", base=base, source_format="peft", direction="peft-to-orbax",
                   desc="peft -> orbax", kv=kv, save_step=step, overwrite=overwrite, workers=workers,
                   memory_budget=memory_budget, progress=progress, revision=revision)


def convert_peft_to_maxtext(src: str, dst: str, *, base: str, scan_layers: bool = False, overwrite: bool = False,
                            compression: bool = True, workers: int | None = None,
                            memory_budget: str | int | None = None, progress: bool | None = None,
                            revision: str | None = None) -> Report:
    """PEFT adapter -> MaxText LoRA checkpoint ``dst/0/items``."""
    return convert(src, dst, to="maxtext-lora", base=base, source_format="peft", direction="peft-to-maxtext",
                   desc="peft -> maxtext", scan_layers=scan_layers, overwrite=overwrite, compression=compression,
                   workers=workers, memory_budget=memory_budget, progress=progress, revision=revision)


def convert_to_gguf(src: str, dst: str, *, adapter: str | None = None, outtype: str = "bf16",
                    step: int | None = None, alpha: float | None = None, tokenizer: bool = True,
                    name: str | None = None, overwrite: bool = False, workers: int | None = None,
                    memory_budget: str | int | None = None, progress: bool | None = None,
                    revision: str | None = None) -> Report:
    """A model (any model format, with ``adapter`` merged on the way) -> one GGUF file."""
    return convert(src, dst, to="gguf", adapter=adapter, direction="to-gguf", desc="to gguf", outtype=outtype,
                   step=step, alpha=alpha, tokenizer=tokenizer, name=name, overwrite=overwrite, workers=workers,
                   memory_budget=memory_budget, progress=progress, revision=revision)


def convert_adapter_to_gguf(adapter: str, dst: str, *, base: str, step: int | None = None,
                            alpha: float | None = None, outtype: str = "f32", name: str | None = None,
                            overwrite: bool = False, progress: bool | None = None,
                            revision: str | None = None) -> Report:
    """An adapter (PEFT, Tunix/qwix or MaxText LoRA) -> a GGUF LoRA adapter for its base's GGUF."""
    return convert(adapter, dst, to="gguf-lora", base=base, direction="adapter-to-gguf", desc="adapter to gguf",
                   step=step, alpha=alpha, outtype=outtype, name=name, overwrite=overwrite, progress=progress,
                   revision=revision)


def merge_lora(base: str, adapter: str, dst: str, *, step: int | None = None, alpha: float | None = None,
               max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE, base_id: str | None = None,
               overwrite: bool = False, workers: int | None = None, memory_budget: str | int | None = None,
               progress: bool | None = None, revision: str | None = None, quantize: str | None = None,
               as_trained: bool = False) -> Report:
    """Merge ``adapter`` (a PEFT directory, a Tunix/qwix or MaxText LoRA checkpoint) into the model
    ``base`` and write the merged HF model to ``dst`` (sharded safetensors + index, config.json,
    the base's non-weight files, and a model card naming the base, its Hub id ``base_id`` or the
    one found from its path or config): ``W + scale * B @ A`` accumulated in float32, stored in the
    base's dtype, a block of rows at a time on ``workers`` threads within ``memory_budget``.
    ``quantize`` (``"int8"`` or ``"fp8"``): the merged decoder projections written quantized in the
    same pass (compressed-tensors). ``as_trained``: a QLoRA adapter merged into the quantized base it
    was trained against (dequantized as qwix held it), not into ``base`` as it is."""
    return convert(base, dst, to="hf", adapter=adapter, direction="merge", desc="merge", step=step, alpha=alpha,
                   as_trained=as_trained or None,
                   max_shard_size=max_shard_size, base_id=base_id, overwrite=overwrite, workers=workers,
                   memory_budget=memory_budget, progress=progress, revision=revision, quantize=quantize)


def quantize_model(src: str, dst: str, *, scheme: str, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
                   base_id: str | None = None, overwrite: bool = False, workers: int | None = None,
                   memory_budget: str | int | None = None, progress: bool | None = None,
                   revision: str | None = None) -> Report:
    """Quantize the HF model ``src`` to ``dst`` under ``scheme`` (``"int8"``: W8A8, ``"fp8"``:
    FP8_DYNAMIC): the compressed-tensors format llm-compressor writes for the same data-free scheme
    (the same bytes), streaming; every other tensor copied byte for byte."""
    return convert(src, dst, to="hf", quantize=scheme, source_format="hf", direction="quantize", desc="quantize",
                   max_shard_size=max_shard_size, base_id=base_id, overwrite=overwrite, workers=workers,
                   memory_budget=memory_budget, progress=progress, revision=revision)


__all__ = ["convert_adapter_to_gguf", "convert_maxtext_to_orbax", "convert_maxtext_to_safetensors",
           "convert_orbax_to_maxtext", "convert_orbax_to_peft", "convert_orbax_to_safetensors",
           "convert_peft_to_maxtext", "convert_peft_to_orbax", "convert_safetensors_to_maxtext",
           "convert_safetensors_to_orbax", "convert_to_gguf",
           "merge_lora", "quantize_model"]
