"""Training: the engine loop, gradient accumulation, supervised fine-tuning, the Hugging Face bridge, other tools' runs.
May import: the foundation, dslab.launch, dslab.config, dslab.models, dslab.zero."""
