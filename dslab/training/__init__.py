"""Training: the engine loop, accumulation, supervised fine-tuning, the Hugging Face bridge, other frameworks' runs.
May import: the foundation, dslab.launch, dslab.config, dslab.models, dslab.zero."""
