"""dslab: the support kit for a hands-on DeepSpeed course."""
from dslab.dist import ensure_build_tools_on_path

__version__ = "0.1.0"

# One ninja for every process and rank of the course (see ensure_build_tools_on_path: two ninjas rebuild the ops).
ensure_build_tools_on_path()
