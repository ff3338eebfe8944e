"""MaxText's formats: its checkpoints (:mod:`.model`), its LoRA factors (:mod:`.lora`) and the
parameter tree both share (:mod:`.layout`)."""
