"""JupyterLab for the Chinese edition: `make lab-zh` (= `python -m tools.zh_lab`), or `make lab` when LANG is zh_*.

It serves notebooks/ and opens in notebooks/zh. Three things differ from the English lab, all set here, on the
command line (see lab_argv) or in this process's environment (see LAB_ENV), so nothing in the learner's home
(~/.jupyter) is read differently or written:

- The UI language. The language pack (jupyterlab-language-pack-zh-cn, a dev dependency) only makes Chinese
  available; what switches it on is the `locale` setting of `@jupyterlab/translation-extension:plugin`. The kit's
  tools/zh_lab_settings/overrides.json sets it to zh_CN as a default, and `--LabApp.app_settings_dir` points
  there. A default, not a user setting: a learner who picks another language in the Settings menu keeps it.
- The kernel's working directory. The chapters' code finds its files relative to notebooks/ (`runs/05`,
  `../data/...`, `../pyproject.toml`), which is where Jupyter starts a kernel for notebooks/NN_topic.ipynb. A twin
  in notebooks/zh/ would start in notebooks/zh/ and miss them; the twins' code must stay the English code, so
  instead the server starts kernels for notebooks in a `zh` folder in the folder above, next to their English
  chapters (`--ServerApp.kernel_manager_class=tools.zh_lab.KernelManager`). The server runs in this process, so it
  can import this module without anything added to PYTHONPATH (which every kernel would inherit).
- dslab's own language. dslab.messages speaks Chinese when DSLAB_LANG is zh, else it follows the locale (LANG,
  LC_*), which on many machines is English or C even for a learner who reads Chinese. The server sets DSLAB_LANG=zh
  in its own environment before it starts, and every kernel and terminal it starts inherits it: config checks,
  refusals and launch errors in the Chinese chapters are in Chinese, whatever the OS locale.
Another Jupyter front end (VS Code, nbclient) must likewise run a zh chapter with notebooks/ as its working folder.
"""
import os
import sys
from pathlib import Path

from jupyter_server.services.kernels.kernelmanager import AsyncMappingKernelManager

from dslab import messages

ROOT = Path(__file__).resolve().parent.parent
SETTINGS_DIR = ROOT / "tools" / "zh_lab_settings"  # overrides.json: the translation plugin's locale
LOCALE = "zh_CN"
LAB_ENV = {messages.LANG_ENV: "zh"}  # DSLAB_LANG: kernels and terminals inherit the server's environment


def english_folder(folder):
    """The folder a zh chapter's code runs in: the parent of a `zh` folder that sits beside English chapters."""
    folder = Path(folder)
    if folder.name == "zh" and any(folder.parent.glob("[0-9][0-9]_*.ipynb")):
        return folder.parent
    return folder


class KernelManager(AsyncMappingKernelManager):
    """Jupyter's kernel manager, except that kernels of notebooks in notebooks/zh start in notebooks/."""

    def cwd_for_path(self, path, **kwargs):
        return os.fspath(english_folder(super().cwd_for_path(path, **kwargs)))


def lab_argv(extra=()):
    """The `jupyter lab` arguments of the Chinese lab; extra ones (say --port 9999) go last."""
    return [f"--notebook-dir={ROOT / 'notebooks'}", "--ContentsManager.preferred_dir=zh",
            f"--LabApp.app_settings_dir={SETTINGS_DIR}",
            "--ServerApp.kernel_manager_class=tools.zh_lab.KernelManager",
            *extra]


def main(argv=None):
    """Start JupyterLab in Chinese on notebooks/zh (blocks until the server stops)."""
    from jupyterlab.labapp import LabApp

    if str(ROOT) not in sys.path:  # run as a script: the server imports tools.zh_lab.KernelManager
        sys.path.insert(0, str(ROOT))
    os.environ.update(LAB_ENV)  # before the server starts: every kernel it starts copies this environment
    LabApp.launch_instance(argv=lab_argv(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
