"""dslab: the support kit for a hands-on DeepSpeed course."""

__version__ = "0.1.0"
