"""ZeRO memory: the paper's formulas (memory), the bytes a live engine holds, runs on ranks, optimizer states, widget.
May import: the foundation, dslab.launch, dslab.config, dslab.models."""
