"""Parallelism beyond data parallel: pipeline stages, AutoTP tensor parallel (training and inference), ZeRO++ hpZ.
May import: the foundation, dslab.launch, dslab.config, dslab.models, dslab.zero, dslab.comm."""
