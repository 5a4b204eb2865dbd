"""DeepSpeed configs: build them (build), check them before a run (check), the keys DeepSpeed reads (keys), presets.
May import: dslab's foundation (messages, files) only."""
