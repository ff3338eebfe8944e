"""File formats: safetensors (lazy read, streaming sharded write), Orbax, HF model directories."""
