"""The main job: base model -> LoRA fine-tune -> conversions -> merge -> serve -> benchmark -> evaluate,
on an embedded tiny model of any family (by default the Gemma 4 shaped like 31B) or on given
inputs, with one report."""
