"""The course's spawner: JupyterHub's LocalProcessSpawner (each learner's server runs as their own account on this
server) with what a shared server needs for the course (docs/instructor_guide.md, "Running it on JupyterHub"):

- the learner's own copy of the course in ~/dslab, made on their first start, as the learner (dslab_hub.copy_course;
  the kit and its venv stay installed once, read-only);
- Spawner.cpu_limit and Spawner.mem_limit enforced, which LocalProcessSpawner alone does not do: each server starts in
  a cgroup of its own (dslab_hub.LearnerCgroup), and everything it starts (kernels, ranks, terminals) is born in it.
  dslab reads the quota from there and gives the learner's ranks that many threads;
- the kit's venv first on PATH, so that `dslab`, `deepspeed` and `python` in a terminal or a `!` line are the kit's;
  the kernels are the kit's venv through the "python3" kernel that install.sh puts in the hub's venv;
- when the server stops, whatever is left in its cgroup is ended and the cgroup removed.
"""
import asyncio
import os
import pwd
import sys
from asyncio.subprocess import PIPE, STDOUT
from pathlib import Path

import dslab_hub
from jupyterhub.spawner import LocalProcessSpawner, set_user_setuid
from jupyterhub.utils import maybe_future
from traitlets import Bool, Unicode, default

HERE = Path(__file__).resolve().parent


class DslabSpawner(LocalProcessSpawner):
    """LocalProcessSpawner with each learner's copy of the course and their CPU and memory limits."""

    kit = Unicode(str(HERE.parents[1]), config=True,
                  help="The kit, installed once for every learner (its venv in .venv): the folder this file is in, "
                       "two levels up.")
    course_folder = Unicode("dslab", config=True,
                            help="The learner's copy of the course, in their home folder; made on the first start.")
    cgroup_root = Unicode(dslab_hub.CGROUP_ROOT, config=True, help="Where the cgroup filesystem is mounted.")
    cgroup_parent = Unicode("dslab-learners", config=True,
                            help="The cgroup, under cgroup_root, that holds one cgroup per learner.")
    require_limits = Bool(True, config=True,
                          help="Refuse to start a server whose CPU and memory limits cannot be set (no cgroup "
                               "controllers, no permission). False: start it without limits, with a warning.")

    @default("cmd")
    def _cmd_default(self):
        # the single-user server of the hub's own venv, wherever that is installed
        return [str(Path(sys.executable).parent / "jupyterhub-singleuser")]

    @default("env_keep")
    def _env_keep_default(self):
        # not the hub's PATH, PYTHONPATH or VIRTUAL_ENV: the learner gets the kit's (get_env)
        return ["LANG", "LC_ALL", "JUPYTERHUB_SINGLEUSER_APP"]

    def cgroup(self):
        return dslab_hub.LearnerCgroup(self.user.name, self.cgroup_parent, self.cgroup_root)

    def limits_wanted(self):
        return bool(self.cpu_limit or self.mem_limit)

    def get_env(self):
        env = super().get_env()
        venv = Path(self.kit) / ".venv"
        ours = {"PATH": os.pathsep.join([str(venv / "bin"), "/usr/local/bin", "/usr/bin", "/bin"]),
                "VIRTUAL_ENV": str(venv),
                # the single-user server's own settings (singleuser/jupyter_server_config.py): kernels of the Chinese
                # chapters start next to the English ones, as in `make lab-zh`
                "JUPYTER_CONFIG_PATH": str(HERE / "singleuser"),
                # idle OpenMP threads sleep rather than spin (as the kit's Makefile sets for `make lab`)
                "OMP_WAIT_POLICY": "PASSIVE"}
        for key, value in ours.items():
            if key not in self.environment:      # the site's own Spawner.environment wins
                env[key] = value
        return env

    async def copy_course(self):
        """The learner's copy of the course, made as the learner on their first start (kept as it is afterwards)."""
        home = pwd.getpwnam(self.user.name).pw_dir
        dest = Path(home) / self.course_folder
        if dest.exists() or dest.is_symlink():
            return
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-B", str(HERE / "dslab_hub.py"), "copy-course", self.kit, str(dest),
            preexec_fn=set_user_setuid(self.user.name), stdout=PIPE, stderr=STDOUT,
            env={"PATH": "/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8"})
        output = (await proc.communicate())[0].decode(errors="replace")
        if proc.returncode:
            raise RuntimeError(f"could not copy the course from {self.kit} into {dest} as {self.user.name}:\n"
                               f"{output[-2000:]}")
        self.log.info("%s: %s", self.user.name, output.strip())

    def make_cgroup(self):
        """The learner's cgroup with their limits, made fresh (what a crashed server left in it is ended first); the
        cgroup.procs files the server joins. [] where no limit is set, or where they cannot be set and
        require_limits is False."""
        if not self.limits_wanted():
            return []
        try:
            cgroup = self.cgroup()
            cgroup.remove()
            cgroup.create(cpus=self.cpu_limit, memory=self.mem_limit)
        except (dslab_hub.CgroupError, OSError) as err:
            if self.require_limits:
                raise RuntimeError(f"cannot set {self.user.name}'s CPU and memory limits: {err}. Run the hub as root "
                                   "on a server with cgroups, or set c.DslabSpawner.require_limits = False to "
                                   "start servers without limits") from err
            self.log.warning("%s's server starts without CPU and memory limits: %s", self.user.name, err)
            return []
        self.log.info("%s: cgroup %s, %s", self.user.name, cgroup.version, cgroup.limits())
        return cgroup.procs_files()

    async def start(self):
        await self.copy_course()
        self._procs_files = await asyncio.to_thread(self.make_cgroup)
        return await super().start()

    def make_preexec_fn(self, name):
        become_learner = super().make_preexec_fn(name)
        procs_files = list(getattr(self, "_procs_files", []))

        def preexec():          # in the server's process, before it runs: into the cgroup as root, then the learner
            dslab_hub.join(procs_files)
            become_learner()
        return preexec

    async def run_post_stop_hook(self):
        """After the server stopped (or died): end what it left running and remove the learner's cgroup."""
        if self.limits_wanted():
            try:
                cgroup = self.cgroup()
                left = await asyncio.to_thread(cgroup.remove)
                if left:
                    self.log.warning("%s: could not remove %s", self.user.name, ", ".join(left))
            except dslab_hub.CgroupError as err:
                self.log.warning("%s: %s", self.user.name, err)
        return await maybe_future(super().run_post_stop_hook())
