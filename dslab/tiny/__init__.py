"""Building dslab-tiny, already shipped in data/: its tokenizer, corpus (word lists, made-up identities), pretraining.
May import: everything below it (the foundation, launch, config, models, training); nothing at run time imports it."""
