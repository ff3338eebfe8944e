"""File formats: safetensors (lazy read, streaming sharded write), Orbax, HF model directories."""

from ckptbridge.options import DEFAULT_CHUNK_SIZE

__all__ = ["DEFAULT_CHUNK_SIZE"]
