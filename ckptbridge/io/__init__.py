"""File formats: safetensors (lazy read, streaming sharded write), Orbax, HF model directories."""

# Tensors larger than this are converted in row blocks of at most this size (one Orbax chunk
# each); see ckptbridge.convert. Here so that the CLI can show it without importing numpy.
DEFAULT_CHUNK_SIZE = "128MiB"
