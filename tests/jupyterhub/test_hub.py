"""The JupyterHub recipe (deploy/jupyterhub), run for real: the hub from its own venv and proxy (`make
test-jupyterhub` builds them with deploy/jupyterhub/install.sh), the recipe's config as a site would load it, two local
accounts made for the test, each learner's server started through the hub's REST API, and code run in a kernel of
each through the server's websocket.

In each learner's kernel: the kit's venv runs it, as the learner; dslab reads the CPU quota of the learner's cgroup
(dslab.machine.cpu_cores, dslab.machine.cpu_info) and the memory limit is set; the course was copied into the
learner's home on their first start; an exercise check writes the verdict into their own ~/.dslab; they can write
neither into the kit nor into the other learner's home; a Chinese chapter's kernel starts next to the English ones.
Then the servers are stopped, the hub too, the accounts removed, and nothing may be left: no process of the learners,
the hub or the proxy, no cgroup, no account, no folder.

Needs root (the hub starts each server as its learner, and the test makes accounts and cgroups) and a cgroup
hierarchy with the cpu and memory controllers; skipped with the reason elsewhere. About 20 s on 2 cores.
"""
import asyncio
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "jupyterhub"
HUB = ROOT / "build" / "jupyterhub"          # where `make test-jupyterhub` installs the hub (install.sh . HUB)
JUPYTERHUB = HUB / "venv" / "bin" / "jupyterhub"
CPU_LIMIT = 1.0                              # cores per learner: fewer than this machine's, so the quota shows
MEM_LIMIT_GIB = 3
TIMEOUT_S = 240

sys.path.insert(0, str(DEPLOY))
import dslab_hub  # noqa: E402 (deploy/jupyterhub is no package: found through sys.path)

# The test's own hub: the recipe loaded as a site's config would load it, then what only a test wants: a shared
# password instead of the server's passwords (PAM), ports of its own, an admin token for the test, smaller limits,
# and a cgroup parent of its own.
CONFIG = """
load_subconfig({recipe!r})
c.JupyterHub.bind_url = "http://127.0.0.1:{port}"
c.JupyterHub.hub_bind_url = "http://127.0.0.1:{hub_port}"
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{proxy_port}"
c.JupyterHub.authenticator_class = "shared-password"
c.SharedPasswordAuthenticator.user_password = {password!r}
c.Authenticator.allowed_users = set({learners!r})
c.JupyterHub.services = [{{"name": "dslab-test", "api_token": {token!r}}}]
c.JupyterHub.load_roles = [{{"name": "dslab-test", "services": ["dslab-test"],
                            "scopes": ["admin:users", "admin:servers", "tokens", "access:servers"]}}]
c.Spawner.cpu_limit = {cpu_limit!r}
c.Spawner.mem_limit = "{mem_gib}G"
c.DslabSpawner.cgroup_parent = {cgroup_parent!r}
"""

# What each learner's kernel reports (one JSON line), run in the kernel of their notebooks/01 chapter.
CHECK = r"""
import getpass, json, os, runpy, sys
from pathlib import Path
from dslab import exercises, machine
from dslab.exercises import progress

kit, other_home = Path({kit!r}), Path({other_home!r})
home = Path.home()

def memory_limit():
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        v2 = Path(f"/sys/fs/cgroup{{path}}/memory.max")
        v1 = Path(f"/sys/fs/cgroup/memory{{path}}/memory.limit_in_bytes")
        if hierarchy == "0" and not controllers and v2.exists():
            return v2.read_text().strip()
        if "memory" in controllers.split(",") and v1.exists():
            return v1.read_text().strip()

def can_create_in(folder):
    probe = Path(folder) / f".dslab-probe-{{os.getpid()}}"
    try:
        probe.write_text("x")
    except OSError:
        return False
    probe.unlink()
    return True

def can_append_to(file):
    try:
        with open(file, "a"):
            return True
    except OSError:
        return False

from ipykernel.connect import get_connection_file
connection = Path(get_connection_file())
solutions = runpy.run_path("solutions/01_solutions.py")["SOLUTIONS"]
checks = [exercises.check("01.ring_gb", 14.0), exercises.check("01.ring_gb", solutions["01.ring_gb"])]
chapter = home / "dslab" / "notebooks" / "01_distributed_basics.ipynb"
report = {{
    "user": getpass.getuser(), "hub_user": os.environ.get("JUPYTERHUB_USER"), "home": str(home), "cwd": os.getcwd(),
    "prefix": sys.prefix, "cores": machine.cpu_cores(), "env_cpu": machine.cpu_info()["cpu_quota"],
    "memory_limit": memory_limit(), "cgroup": Path("/proc/self/cgroup").read_text(),
    "copy": {{"chapter": chapter.is_file(), "mine": chapter.is_file() and chapter.stat().st_uid == os.getuid(),
              "venv": os.readlink(home / "dslab" / ".venv") if (home / "dslab" / ".venv").is_symlink() else None}},
    "connection": {{"encrypted": "curve_publickey" in json.loads(connection.read_text()),
                    "mode": oct(connection.stat().st_mode & 0o777)}},
    "checks": checks, "progress_env": os.environ.get("DSLAB_PROGRESS"),
    "progress": [[e.learner, e.exercise, e.verdict] for e in progress.read(home / ".dslab" / "progress.jsonl")],
    "write": {{"kit": can_create_in(kit), "kit_notebooks": can_create_in(kit / "notebooks"),
               "kit_file": can_append_to(kit / "pyproject.toml"), "kit_venv": can_create_in(Path(sys.prefix) / "bin"),
               "other_home": can_create_in(other_home), "own_home": can_create_in(home)}},
}}
print("DSLAB-HUB-CHECK " + json.dumps(report))
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(url, token, method="GET", body=None, timeout=60):
    """(status, JSON body or None) of a request to the hub's REST API or a learner's server."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Authorization": f"token {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode()
            return response.status, (json.loads(text) if text.strip() else None)
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")
    except (urllib.error.URLError, ConnectionError, TimeoutError) as err:     # not up yet, or going
        return None, str(err)


def _server_of(base_url, name, token):
    """The learner's default server as the hub's API shows it ({} when none runs)."""
    status, body = _api(f"{base_url}/hub/api/users/{name}", token)
    assert status == 200, (name, status, body)
    return body.get("servers", {}).get("", {})


def _wait(what, condition, timeout, hub=None, log=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        if hub is not None and hub.poll() is not None:
            raise AssertionError(f"the hub ended (exit {hub.returncode}) waiting for {what}:\n{_tail(log)}")
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}:\n{_tail(log)}")


def _tail(log, chars=6000):
    try:
        return Path(log).read_text(errors="replace")[-chars:] if log else ""
    except OSError:
        return ""


async def _execute(ws_url, token, code, timeout):
    """Run `code` in the kernel at `ws_url` (a server's kernel channels): (stdout, the error's traceback or None)."""
    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect

    conn = await websocket_connect(HTTPRequest(ws_url, headers={"Authorization": f"token {token}"}))
    msg_id = uuid.uuid4().hex
    conn.write_message(json.dumps({
        "header": {"msg_id": msg_id, "username": "test", "session": uuid.uuid4().hex, "msg_type": "execute_request",
                   "version": "5.3", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
        "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                    "allow_stdin": False, "stop_on_error": True}}))
    out, error = [], None
    try:
        while True:
            raw = await asyncio.wait_for(conn.read_message(), timeout)
            if raw is None:
                raise AssertionError("the kernel's websocket closed before the code ended")
            if isinstance(raw, bytes):
                continue
            msg = json.loads(raw)
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                error = "\n".join(msg["content"]["traceback"])
            elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                return "".join(out), error
    finally:
        conn.close()


def _in_kernel(base_url, name, token, notebook, code):
    """Start a kernel for `notebook` (a path in the learner's home) on the learner's server and run `code` in it."""
    status, session = _api(f"{base_url}/user/{name}/api/sessions", token, "POST",
                           {"path": notebook, "type": "notebook", "name": Path(notebook).name,
                            "kernel": {"name": "python3"}})
    assert status == 201, (status, session)
    ws = f"{base_url.replace('http', 'ws', 1)}/user/{name}/api/kernels/{session['kernel']['id']}/channels"
    out, error = asyncio.run(_execute(ws, token, code, TIMEOUT_S))
    assert error is None, f"{name}'s kernel for {notebook}:\n{error}"
    return out


def _processes_of(uids):
    """{pid: what it is} of the processes whose real user is one of `uids`. Zombies are left out: they have ended, and
    only wait for their parent to collect them (where init collects orphans lazily, a while after they ended)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = dict(x.split(":", 1) for x in (entry / "status").read_text().splitlines() if ":" in x)
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if int(status["Uid"].split()[0]) in uids and not status["State"].strip().startswith("Z"):
                found[int(entry.name)] = cmdline[:300]
    return found


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie has ended: only its parent has yet to collect it
    return not (Path(f"/proc/{pid}/stat").exists()
                and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z")


def _views_needed(paths):
    """What other accounts cannot reach on the way to `paths`: [(a folder they may not enter, its entry on the way)].

    This machine's Python may live where only root may go (pyenv under /root, mode 700); the venvs built from it then
    run for root alone. A server for learners installs its Python where every account can run it (/usr/bin/python3);
    here the hub runs in a mount namespace of its own in which such a folder is replaced by one that shows only that
    entry (_hub_command). Skips where an entry further down is closed too."""
    views = []
    for path in paths:
        path = Path(os.path.realpath(path))
        closed = [p for p in reversed(path.parents) if not p.stat().st_mode & stat.S_IXOTH]
        if not closed:
            continue
        if len(closed) > 1 or not path.stat().st_mode & stat.S_IROTH:
            pytest.skip(f"other accounts cannot reach {path} ({', '.join(map(str, closed))} closed to them)")
        entry = path.relative_to(closed[0]).parts[0]
        if (closed[0], entry) not in views:
            views.append((closed[0], entry))
    return views


def _hub_command(config, views, base):
    command = [str(JUPYTERHUB), "-f", str(config)]
    if not views:
        return command
    if not shutil.which("unshare"):
        pytest.skip(f"{views[0][0]} is closed to other accounts and unshare(1) is not here to open a view of it")
    lines = ["set -e"]
    for i, (folder, entry) in enumerate(views):
        (base / "views" / str(i)).mkdir(parents=True)
        lines.append(f"mount --bind '{folder / entry}' '{base / 'views' / str(i)}'")
    for folder in dict.fromkeys(folder for folder, _ in views):
        lines.append(f"mount -t tmpfs -o mode=755 tmpfs '{folder}'")
    for i, (folder, entry) in enumerate(views):
        lines += [f"mkdir -p '{folder / entry}'", f"mount --move '{base / 'views' / str(i)}' '{folder / entry}'"]
    lines.append('exec "$@"')
    # a mount namespace of its own, its mounts private: nothing of this is seen outside, and it ends with the hub
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(lines), "hub", *command]


def _preconditions(cgroup_parent):
    if os.geteuid() != 0:
        pytest.skip("the hub starts each learner's server as that learner, and the test makes accounts: needs root")
    if not JUPYTERHUB.exists():
        pytest.skip(f"no hub at {HUB}: `make test-jupyterhub` installs it (deploy/jupyterhub/install.sh . {HUB})")
    for tool in ("useradd", "userdel"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} is not here to make the learners' accounts")
    try:       # a cgroup with both limits, a process moved into it, the cgroup removed: what the spawner does
        probe = dslab_hub.LearnerCgroup("probe", cgroup_parent)
        try:
            probe.create(cpus=CPU_LIMIT, memory=MEM_LIMIT_GIB * 2 ** 30)
            subprocess.run(["true"], preexec_fn=lambda: dslab_hub.join(probe.procs_files()), check=True, timeout=60)
        finally:
            probe.remove()
    except (dslab_hub.CgroupError, OSError, subprocess.SubprocessError) as err:
        _remove_cgroup_parent(cgroup_parent)
        pytest.skip(f"this machine does not let root make a learner's cgroup with CPU and memory limits: {err}")


def _remove_cgroup_parent(cgroup_parent):
    try:
        parents = set(dslab_hub.LearnerCgroup("x", cgroup_parent).parents.values())
    except dslab_hub.CgroupError:
        return
    for folder in parents:
        try:
            folder.rmdir()
        except FileNotFoundError:
            pass


@pytest.fixture(scope="module")
def hub():
    """The whole run, from the accounts to the clean-up: what each learner's kernel reported, and what was left."""
    suffix = secrets.token_hex(3)
    learners = [f"ana{suffix}", f"bo{suffix}"]
    cgroup_parent = f"dslab-hub-test-{suffix}"
    _preconditions(cgroup_parent)
    base = Path(tempfile.mkdtemp(prefix="dslab-hub-test-"))
    base.chmod(0o755)                                    # the learners' homes are in it
    (base / "home").mkdir(mode=0o755)
    state = base / "hub"                                 # the hub's database, cookie secret, log: root's alone
    state.mkdir(mode=0o700)
    log = state / "hub.log"
    admin_token, port = secrets.token_hex(32), _free_port()
    base_url = f"http://127.0.0.1:{port}"
    result = {"learners": learners, "base": base, "reports": {}, "zh_cwd": {}, "times": {}}
    made, uids, hub_proc, proxy_pid = [], set(), None, None
    start = time.monotonic()
    try:
        for name in learners:
            add = subprocess.run(["useradd", "--create-home", "--home-dir", str(base / "home" / name), "--shell",
                                  "/bin/bash", "--user-group", name], capture_output=True, text=True, timeout=60)
            if add.returncode:          # the clean-up below still runs
                pytest.skip(f"root cannot make the learners' accounts here: {add.stderr.strip()}")
            made.append(name)
            uids.add(pwd.getpwnam(name).pw_uid)
        config = state / "jupyterhub_config.py"
        config.write_text(CONFIG.format(
            recipe=str(DEPLOY / "jupyterhub_config.py"), port=port, hub_port=_free_port(), proxy_port=_free_port(),
            password=secrets.token_hex(12), learners=learners, token=admin_token, cpu_limit=CPU_LIMIT,
            mem_gib=MEM_LIMIT_GIB, cgroup_parent=cgroup_parent))
        views = _views_needed([ROOT / ".venv" / "bin" / "python", HUB / "venv" / "bin" / "python",
                               DEPLOY / "dslab_hub.py"])
        result["views"] = [str(folder / entry) for folder, entry in views]
        hub_env = {k: v for k, v in os.environ.items()
                   if not k.startswith(("DSLAB_", "PYTEST_")) and k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        with open(log, "w") as out:
            hub_proc = subprocess.Popen(_hub_command(config, views, base), cwd=state, env=hub_env, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        _wait("the hub's API", lambda: _api(f"{base_url}/hub/api/", admin_token, timeout=5)[0] == 200,
              TIMEOUT_S, hub_proc, log)
        pid_file = state / "jupyterhub-proxy.pid"
        proxy_pid = int(pid_file.read_text().strip()) if pid_file.exists() else None
        result["times"]["hub up"] = time.monotonic() - start

        # each learner: a token made by the admin, then their own server started with it
        tokens = {}
        for name in learners:
            status, body = _api(f"{base_url}/hub/api/users/{name}", admin_token, "POST", {})
            assert status in (201, 409), (status, body)
            status, body = _api(f"{base_url}/hub/api/users/{name}/tokens", admin_token, "POST",
                                {"note": "dslab hub test", "expires_in": 3600})
            assert status == 201, (status, body)
            tokens[name] = body["token"]
            status, body = _api(f"{base_url}/hub/api/users/{name}/server", tokens[name], "POST", {})
            assert status in (201, 202), (name, status, body)
        for name in learners:
            _wait(f"{name}'s server", lambda name=name: _server_of(base_url, name, tokens[name]).get("ready"),
                  TIMEOUT_S, hub_proc, log)
        result["times"]["servers up"] = time.monotonic() - start
        result["cgroups_while_running"] = {
            name: dslab_hub.LearnerCgroup(name, cgroup_parent).limits() for name in learners}

        for name, other in zip(learners, reversed(learners)):
            code = CHECK.format(kit=str(ROOT), other_home=str(base / "home" / other))
            out = _in_kernel(base_url, name, tokens[name], "dslab/notebooks/01_distributed_basics.ipynb", code)
            line = next((x for x in out.splitlines() if x.startswith("DSLAB-HUB-CHECK ")), None)
            assert line, f"{name}'s kernel printed no report:\n{out[-3000:]}"
            result["reports"][name] = json.loads(line.split(" ", 1)[1])
            result["zh_cwd"][name] = _in_kernel(base_url, name, tokens[name],
                                                "dslab/notebooks/zh/01_distributed_basics.ipynb",
                                                "import os; print(os.getcwd())").strip()
        result["times"]["kernels checked"] = time.monotonic() - start

        collect = subprocess.run([sys.executable, "-m", "dslab.cli", "progress", "--collect", str(base / "home")],
                                 cwd=ROOT, capture_output=True, text=True, timeout=120,
                                 env={**os.environ, "DSLAB_LANG": "en"})
        result["collect"] = collect.stdout + collect.stderr

        result["before_stop"] = _processes_of(uids)
        for name in learners:
            status, body = _api(f"{base_url}/hub/api/users/{name}/server", tokens[name], "DELETE")
            assert status in (202, 204), (name, status, body)
        for name in learners:
            _wait(f"{name}'s server to stop", lambda name=name: not _server_of(base_url, name, tokens[name]),
                  TIMEOUT_S, hub_proc, log)

        def left_after_stop():
            return {"cgroups": [n for n in learners if dslab_hub.LearnerCgroup(n, cgroup_parent).exists()],
                    "processes": _processes_of(uids)}
        deadline = time.monotonic() + 15      # a process SIGKILLed a moment ago may take a moment to go
        while any(left_after_stop().values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        result["after_stop"] = left_after_stop()
        result["times"]["servers stopped"] = time.monotonic() - start
    finally:
        result["log"] = _tail(log)
        try:
            result["hub_exit"] = _stop(hub_proc)
            # what the run left, before the clean-up below removes it
            result["left"] = {"processes": _processes_of(uids),
                              "hub": hub_proc is not None and _alive(hub_proc.pid),
                              "proxy": proxy_pid is not None and _alive(proxy_pid),
                              "cgroups": [n for n in learners if dslab_hub.LearnerCgroup(n, cgroup_parent).exists()]}
        finally:
            result["cleanup_errors"] = _clean_up(uids, learners, made, cgroup_parent, base, proxy_pid)
            result["after_cleanup"] = {
                "accounts": [n for n in learners if _account_exists(n)], "base": base.exists(),
                "cgroup_parent": any(p.exists() for p in dslab_hub.LearnerCgroup("x", cgroup_parent).parents.values())}
        result["times"]["all"] = time.monotonic() - start
        print("\n".join(f"{what}: {seconds:.1f} s" for what, seconds in result["times"].items()))
    return result


def _stop(hub_proc):
    """Stop the hub as a service manager would (SIGTERM: it stops the servers still running and the proxy); its exit
    status."""
    if hub_proc is None:
        return None
    if hub_proc.poll() is None:
        hub_proc.send_signal(signal.SIGTERM)
        try:
            hub_proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(hub_proc.pid, signal.SIGKILL)
            hub_proc.wait(timeout=30)
    return hub_proc.returncode


def _clean_up(uids, learners, accounts, cgroup_parent, base, proxy_pid):
    """Remove whatever the run made, each step whatever the others did; the errors met."""
    errors = []

    def attempt(step, *args):
        try:
            step(*args)
        except Exception as err:
            errors.append(f"{step.__name__}{args}: {err!r}")

    def remove_cgroup(name):
        dslab_hub.LearnerCgroup(name, cgroup_parent).remove()

    def remove_account(name):       # and its home; userdel's note that it had no mail spool is no error
        subprocess.run(["userdel", "--remove", name], capture_output=True, timeout=60)
        if _account_exists(name):
            raise RuntimeError(f"userdel left the account {name}")

    for pid in [*_processes_of(uids), *([proxy_pid] if proxy_pid and _alive(proxy_pid) else [])]:
        attempt(os.kill, pid, signal.SIGKILL)
    for name in learners:
        attempt(remove_cgroup, name)
    attempt(_remove_cgroup_parent, cgroup_parent)
    for name in accounts:
        attempt(remove_account, name)
    attempt(shutil.rmtree, base)
    return errors


def _account_exists(name):
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def _reports(hub):
    assert set(hub["reports"]) == set(hub["learners"]), hub["log"]
    return hub["reports"].items()


def test_each_learner_s_kernel_is_the_kit_s_venv_run_as_that_learner(hub):
    for name, report in _reports(hub):
        assert Path(report["prefix"]).resolve() == (ROOT / ".venv").resolve(), report["prefix"]
        assert report["user"] == report["hub_user"] == name
        assert report["home"] == str(hub["base"] / "home" / name)


def test_the_kernel_sees_the_learner_s_cpu_quota_and_memory_limit(hub):
    for name, limits in hub["cgroups_while_running"].items():
        assert limits == {"cpus": CPU_LIMIT, "memory": MEM_LIMIT_GIB * 2 ** 30}, (name, limits)
    for name, report in _reports(hub):
        assert f"learner-{name}" in report["cgroup"], report["cgroup"]
        cores = report["cores"]
        assert cores["quota"] == CPU_LIMIT and report["env_cpu"] == CPU_LIMIT, cores
        assert cores["usable"] == min(cores["affinity"], int(CPU_LIMIT)), cores
        assert report["memory_limit"] == str(MEM_LIMIT_GIB * 2 ** 30), report["memory_limit"]


def test_the_course_was_copied_into_each_home_and_kernels_start_beside_the_chapters(hub):
    for name, report in _reports(hub):
        home = Path(report["home"])
        assert report["copy"] == {"chapter": True, "mine": True, "venv": str(ROOT / ".venv")}, report["copy"]
        assert report["cwd"] == str(home / "dslab" / "notebooks")
        # a Chinese twin's kernel starts next to the English chapters (the kit's kernel manager, as in make lab-zh)
        assert hub["zh_cwd"][name] == str(home / "dslab" / "notebooks"), hub["zh_cwd"][name]


def test_a_check_records_its_verdict_in_the_learner_s_own_home_and_the_instructor_collects_them(hub):
    for name, report in _reports(hub):
        assert report["checks"] == [False, True]
        assert report["progress_env"] is None          # nothing of the hub's or the test's environment leaks in
        assert report["progress"] == [[name, "01.ring_gb", "mistake"], [name, "01.ring_gb", "passed"]]
    assert "2 progress file(s), 2 learner(s)" in hub["collect"], hub["collect"]
    for name in hub["learners"]:
        assert name in hub["collect"], hub["collect"]


def test_learners_can_write_neither_into_the_kit_nor_into_each_other_s_home(hub):
    for name, report in _reports(hub):
        assert report["write"] == {"kit": False, "kit_notebooks": False, "kit_file": False, "kit_venv": False,
                                   "other_home": False, "own_home": True}, (name, report["write"])


def test_each_kernel_s_traffic_is_encrypted_with_keys_only_its_learner_can_read(hub):
    for name, report in _reports(hub):
        assert report["connection"] == {"encrypted": True, "mode": "0o600"}, (name, report["connection"])


def test_nothing_is_left_behind(hub):
    assert hub.get("after_stop") == {"cgroups": [], "processes": {}}, (hub.get("after_stop"), hub["before_stop"])
    assert hub["left"] == {"processes": {}, "hub": False, "proxy": False, "cgroups": []}, (hub["left"], hub["log"])
    assert hub["hub_exit"] == 0, hub["log"]
    assert hub["after_cleanup"] == {"accounts": [], "base": False, "cgroup_parent": False}, hub["after_cleanup"]
    assert hub["cleanup_errors"] == []
