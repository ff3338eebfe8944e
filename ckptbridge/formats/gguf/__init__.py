"""GGUF, ggml's format: models written (:mod:`.model`) and read (:mod:`.reader`), LoRA adapters
written (:mod:`.adapter`), and the tokenizer's metadata (:mod:`.tokenizer`)."""
