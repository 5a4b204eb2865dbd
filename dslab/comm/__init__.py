"""Communication: what each collective moves, what gloo and NCCL send, the bytes of one ZeRO step, chapter 10's table.
May import: the foundation, dslab.launch, dslab.config, dslab.models, dslab.zero."""
