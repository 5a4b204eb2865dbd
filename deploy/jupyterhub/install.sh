#!/usr/bin/env bash
# Install JupyterHub for the course, once, beside the kit (docs/instructor_guide.md, "Running it on JupyterHub"):
#
#   deploy/jupyterhub/install.sh KIT HUB      e.g. deploy/jupyterhub/install.sh /opt/dslab /opt/jupyterhub
#
# KIT: the kit, with its venv built there (make setup). HUB gets:
#   HUB/venv   JupyterHub and JupyterLab, pinned (requirements.txt), from PyPI, with PYTHON (default python3);
#   HUB/proxy  configurable-http-proxy, from npm, pinned by package-lock.json (npm ci; Node.js 20 or later);
# and the kit's venv becomes the learners' kernel: the "python3" kernel in HUB/venv runs KIT/.venv/bin/python.
# Run it again after changing the pins: it brings HUB up to them.
set -euo pipefail
if [ $# -ne 2 ]; then
    echo "usage: $0 KIT HUB" >&2
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
kit=$(cd "$1" && pwd)
mkdir -p "$2"
hub=$(cd "$2" && pwd)
python=${PYTHON:-python3}
if [ ! -x "$kit/.venv/bin/python" ]; then
    echo "no venv in $kit: run make setup there first" >&2
    exit 1
fi
test -x "$hub/venv/bin/python" || "$python" -m venv "$hub/venv"
"$hub/venv/bin/pip" install --quiet --upgrade pip
"$hub/venv/bin/pip" install --quiet -r "$here/requirements.txt"
mkdir -p "$hub/proxy"
cp "$here/package.json" "$here/package-lock.json" "$hub/proxy/"
npm ci --prefix "$hub/proxy" --no-audit --no-fund --loglevel=error
# (ipykernel warns that HUB/venv is not among the kit's own kernel folders: true, and meant; shown only on failure)
if ! out=$("$kit/.venv/bin/python" -m ipykernel install --prefix "$hub/venv" --name python3 \
        --display-name "Python 3 (dslab)" 2>&1); then
    echo "$out" >&2
    exit 1
fi
echo "installed: $hub/venv/bin/jupyterhub, $hub/proxy/node_modules/.bin/configurable-http-proxy;"
echo "the learners' kernel: $kit/.venv/bin/python"
