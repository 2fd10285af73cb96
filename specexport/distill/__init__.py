"""Self-distillation of a draft model from a target (`specexport distill-draft`)."""
