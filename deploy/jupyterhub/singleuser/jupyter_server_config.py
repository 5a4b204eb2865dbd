"""Every learner's single-user server reads this (DslabSpawner sets JUPYTER_CONFIG_PATH to this folder; a learner's
own ~/.jupyter still comes first).

- The chapters' code finds its files relative to notebooks/ (runs/05, ../data, ../pyproject.toml). A Chinese twin in
  notebooks/zh/ would start its kernel in notebooks/zh/; the kit's kernel manager (tools/zh_lab.py, the one `make
  lab-zh` uses) starts it in notebooks/ instead. The kit is put on this server's own sys.path, not on PYTHONPATH,
  which every kernel would inherit.
- A kernel talks to its server over TCP ports on 127.0.0.1, which every account on the server can connect to; its
  output channel answers whoever subscribes. With CurveZMQ keys (the kit's kernel declares it can use them) that
  traffic is encrypted with keys only the learner's own files hold.
"""
import sys
from pathlib import Path

KIT = Path(__file__).resolve().parents[3]
if str(KIT) not in sys.path:
    sys.path.append(str(KIT))

c = get_config()  # noqa: F821 (given to a config file by Jupyter)
c.ServerApp.kernel_manager_class = "tools.zh_lab.KernelManager"
c.MappingKernelManager.transport_encryption = "auto"
