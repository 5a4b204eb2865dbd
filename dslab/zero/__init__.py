"""ZeRO memory: the paper's formulas, a live engine's bytes, runs on ranks, optimizer states, partitions, the widget.
May import: the foundation, dslab.launch, dslab.config, dslab.models."""
