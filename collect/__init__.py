"""steplens in-job collector (imports torch/deepspeed lazily)."""
