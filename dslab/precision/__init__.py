"""Number formats and mixed precision: dtypes and casts (formats), loss scaling.
May import: the foundation, dslab.launch, dslab.config, dslab.models, dslab.training."""
