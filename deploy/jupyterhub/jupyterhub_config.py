"""JupyterHub for the course on one shared server: the server's own accounts, the kit and its venv installed once
(read-only for learners), each learner's own copy of the course in their home, and a CPU and memory limit per
learner, enforced with cgroups (docs/instructor_guide.md, "Running it on JupyterHub"; deploy/jupyterhub/install.sh
installs what it needs).

Load it from a config of the site's own, where the site's choices go, e.g. /etc/jupyterhub/jupyterhub_config.py:

    load_subconfig("/opt/dslab/deploy/jupyterhub/jupyterhub_config.py")
    c.Spawner.cpu_limit = 2          # cores per learner: `dslab workshop plan --learners N`
    c.Spawner.mem_limit = "4G"

and start the hub as root (it starts each learner's server as that learner) in the folder that keeps its state:

    cd /srv/jupyterhub && /opt/jupyterhub/venv/bin/jupyterhub -f /etc/jupyterhub/jupyterhub_config.py
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from dslab_spawner import DslabSpawner  # noqa: E402 (found through the folder put on sys.path above)

c = get_config()  # noqa: F821 (given to a config file by JupyterHub)

# Each learner's server: their own account, their own cgroup with these limits, the kit's venv as the kernel.
# The heaviest chapter needs about 1.5 cores and 3.2 GiB for one learner (dslab workshop plan --learners 1); a quota
# is a cap, not a reservation, so learners who are reading leave their share to the others.
c.JupyterHub.spawner_class = DslabSpawner
c.Spawner.cpu_limit = 2
c.Spawner.mem_limit = "4G"
c.Spawner.notebook_dir = "~"
c.Spawner.default_url = "/lab/tree/dslab/notebooks"
c.Spawner.start_timeout = 120       # a first start copies the course first
c.Spawner.http_timeout = 60

# Who may log in: the server's accounts (PAM) in the group "learners"; those in "instructors" are the hub's admins.
c.JupyterHub.authenticator_class = "pam"
c.PAMAuthenticator.allowed_groups = {"learners"}
c.PAMAuthenticator.admin_groups = {"instructors"}

# configurable-http-proxy, installed by install.sh beside the hub's venv (HUB/venv, HUB/proxy)
proxy = Path(sys.prefix).parent / "proxy" / "node_modules" / ".bin" / "configurable-http-proxy"
if proxy.exists():
    c.ConfigurableHTTPProxy.command = [str(proxy)]
