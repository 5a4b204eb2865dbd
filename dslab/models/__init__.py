"""Models: load dslab-tiny or any causal LM (loading), LoRA adapters, generation, scoring, training checkpoints.
May import: the foundation and dslab.launch only."""
