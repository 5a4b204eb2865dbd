# The two commands a learner needs: `make lab` (the course) and `make test` (everything checked).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.dslab-installed
# nvidia-smi answering means a GPU is here: then pip's default (CUDA) torch is the right one.
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)

# The venv's tools first on PATH, for every command and every process they start: DeepSpeed JIT-builds its ops with the
# first `ninja` on PATH, and the one installed with dslab must be it (dslab.machine.ensure_build_tools_on_path).
export PATH := $(abspath $(BIN)):$(PATH)

# Idle OpenMP threads sleep rather than spin: several ranks share a few CPU cores in this course.
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: setup lab lab-zh test test-fast test-unit test-notebooks test-notebooks-portable test-browser test-gpu \
        test-unit-lane test-notebooks-00-07 test-notebooks-08-14 test-notebooks-00-07-lane test-notebooks-08-14-lane \
        test-browser-exercises-lane test-browser-if-chromium \
        test-workshop test-jupyterhub slides bench chromium clean swift llamafactory framework-venvs test-frameworks \
        test-latest

setup: $(STAMP)

# What DeepSpeed's JIT ops are built with, at pyproject.toml's pins: installed first, so that the ops build (`dslab
# prepare`, about 100 s on 2 cores) runs while pip installs the rest, which changes none of these.
OPS_PINS := $(shell grep -oE '"(torch|deepspeed|ninja|numpy|psutil|tqdm)==[^"]+"' pyproject.toml | tr -d '"')

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
ifeq ($(HAS_GPU),)
	# CPU machine: take the CPU wheel first so nothing pulls a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
endif
	$(BIN)/pip install --quiet $(OPS_PINS)
	$(BIN)/python -m dslab.cli prepare > $(VENV)/prepare.log 2>&1 & ops=$$!; \
	$(BIN)/pip install --quiet -e '.[dev,browser]'; installed=$$?; \
	wait $$ops; built=$$?; cat $(VENV)/prepare.log; test $$installed = 0 && test $$built = 0
	touch $(STAMP)

# In a Chinese locale (LANG=zh_CN.UTF-8 make lab) `make lab` is `make lab-zh`.
lab: setup
	@case "$(LC_ALL)$(LANG)" in zh*) exec $(BIN)/python -m tools.zh_lab ;; esac; \
	$(BIN)/jupyter lab --notebook-dir=notebooks

# The Chinese edition: notebooks/zh, JupyterLab in Chinese, kernels started in notebooks/ (see tools/zh_lab.py).
lab-zh: setup
	$(BIN)/python -m tools.zh_lab

# Everything: unit tests (tests/gpu skips itself on a CPU machine), the notebooks, and the browser tests when
# chromium is here (`make chromium` installs it; .ci/run does).
# Four lanes side by side, each one's output shown when it ends (--output-sync), not interleaved: the unit tests but
# the exercise checkers', those that mostly wait and those that make other checkpoints (TRAINING: the take-away
# script copied alone, `dslab build-base` and the kit's model, other model families); chapters 00-07 then the
# take-away script and the kit's model; chapters 08-14 then the model families; the browser tests, the waiting
# tests (ranks killed, hangs timed, kernels stopped), then the exercise checkers' tests (their answers run on ranks,
# one launch per world size). On 2 cores the lanes fill each other's waits (process starts, ranks joining a group,
# timeouts) and, split so, end at about the same time.
UNIT_SKIPS     := --ignore=tests/browser --ignore=tests/workshop --ignore=tests/jupyterhub \
                  --ignore=tests/test_frameworks_runs.py
RANK_EXERCISES := tests/test_exercises.py tests/test_exercises_parallel.py tests/test_redteam_ranks_a.py \
                  tests/test_redteam_ranks_b.py tests/test_redteam_ranks_c.py tests/test_on_ranks_batch.py
WAITING        := tests/test_faults.py tests/test_hang.py tests/test_live.py
TRAINING       := tests/test_takeaway.py tests/test_models.py tests/test_architectures.py

test: setup
	@echo "four lanes side by side (about 23 minutes on 2 cores with setup); each lane's output comes when it ends"
	$(MAKE) --no-print-directory -j4 --output-sync=target test-unit-lane test-notebooks-00-07-lane test-notebooks-08-14-lane \
		test-browser-exercises-lane

test-unit-lane: setup
	$(BIN)/python -m pytest -q --durations=25 tests $(UNIT_SKIPS) $(addprefix --ignore=,$(RANK_EXERCISES) $(WAITING) $(TRAINING))

test-notebooks-00-07-lane: test-notebooks-00-07
	$(BIN)/python -m pytest -q tests/test_takeaway.py tests/test_models.py

test-notebooks-08-14-lane: test-notebooks-08-14
	$(BIN)/python -m pytest -q tests/test_architectures.py

test-browser-exercises-lane: setup test-browser-if-chromium
	$(BIN)/python -m pytest -q --durations=10 $(WAITING) $(RANK_EXERCISES)

# The quick loop while editing: no multi-rank or otherwise slow test (markers set in conftest.py).
test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" tests $(UNIT_SKIPS)

# tests/test_frameworks_runs.py runs in the frameworks' venvs: `make test-frameworks`.
test-unit: setup
	$(BIN)/python -m pytest -q --durations=25 tests $(UNIT_SKIPS)

# Three learners on one server at once (tests/workshop): each with a copy of the course and a home of their own, the
# venv shared, chapters 00 and 01 under nbval side by side; nothing written outside their folders; their progress
# collected into one view. Several minutes on 2 cores: .ci/run runs it after make test.
test-workshop: setup
	$(BIN)/python -m pytest -q tests/workshop

# The JupyterHub recipe for a shared server (deploy/jupyterhub; docs/instructor_guide.md, "Running it on JupyterHub"),
# run for real: the hub's own venv (JupyterHub, JupyterLab, pinned, from PyPI) and configurable-http-proxy (npm,
# pinned by its package-lock.json) installed into build/jupyterhub by the recipe's own install.sh, then two learners'
# servers started through the hub, checked in their kernels, stopped, and nothing left (tests/jupyterhub). Needs root
# and cgroups (skipped with the reason elsewhere). 55 s in all on 2 cores from empty pip and npm caches, the test ~20 s.
HUB_DIR := build/jupyterhub

$(HUB_DIR)/.installed: $(STAMP) deploy/jupyterhub/install.sh deploy/jupyterhub/requirements.txt \
		deploy/jupyterhub/package.json deploy/jupyterhub/package-lock.json
	PYTHON=$(PY) bash deploy/jupyterhub/install.sh . $(HUB_DIR)
	touch $@

test-jupyterhub: setup $(HUB_DIR)/.installed
	$(BIN)/python -m pytest -q -rs --durations=3 tests/jupyterhub

# The GPU checks (fp16 loss scaling, nccl, kernel injection, the notebooks on a GPU); each skips on a CPU machine.
test-gpu: setup
	$(BIN)/python -m pytest -q -rs tests/gpu

# notebooks/zh is left out: its code and stored outputs are the English chapters' (tests/test_zh_edition.py checks
# that), so the English run covers them, and running them again would double the notebooks' CI time.
# A cell may take 30 minutes: on a CPU without AVX-512 BF16 / AMX, oneDNN emulates bf16 and chapter 05's training
# takes about 18 minutes (measured with ONEDNN_MAX_CPU_ISA=AVX2); a hung cell still fails, later.
NBVAL := $(BIN)/python -m pytest -q --nbval-current-env --nbval-sanitize-with tests/sanitize.cfg --nbval-cell-timeout=1800
test-notebooks: setup
	$(NBVAL) --nbval notebooks --ignore=notebooks/zh

# make test's two notebook lanes: about the same CPU time each (chapters 05 and 06 against 08 and 09).
test-notebooks-00-07: setup
	$(NBVAL) --nbval $(wildcard notebooks/0[0-7]_*.ipynb)

test-notebooks-08-14: setup
	$(NBVAL) --nbval $(wildcard notebooks/0[89]_*.ipynb notebooks/1[0-9]_*.ipynb)

# The notebooks again on a bf16 kernel path below this CPU's own, nothing re-recorded: what a lesser CPU's kernels
# do to the stored outputs, compared by the rule of tests/nbval_numbers.py. CI runs it after `make test`. The path:
# oneDNN capped below the CPU's best (ONEDNN_MAX_CPU_ISA=AVX512_CORE on an AVX512-BF16 or AMX CPU, AVX2 on plain
# AVX-512), or torch's plain kernels where no cap changes bf16 (tests/nbval_numbers.py --portable-path says which).
# torch.compile (DeepSpeed's Muon kernels, chapter 13) gets a cache of its own here: torch's graph cache does not tell
# kernel paths apart, so a kernel compiled natively was once reused under another path and failed to build.
test-notebooks-portable: setup
	env $$($(BIN)/python tests/nbval_numbers.py --portable-path) TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/build/inductor-portable \
		$(MAKE) --no-print-directory test-notebooks

# Debian's chromium for the headless browser tests (slides, ZeRO widget); nothing is downloaded by a test tool.
chromium:
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium fonts-noto-cjk >/dev/null)

# Course tooling, not part of the dslab package (`dslab slides` became `make slides`).
slides: setup
	$(BIN)/python -m tools.slides build

# The browser tests build the decks themselves (strictly, into a temporary folder): no `slides` prerequisite.
test-browser: setup chromium
	$(BIN)/python -m pytest -q tests/browser

# Without chromium the browser tests are skipped with a one-line note (make chromium installs it).
test-browser-if-chromium: setup
	@if command -v chromium >/dev/null; then $(BIN)/python -m pytest -q tests/browser; \
	else echo "browser tests skipped: no chromium here (make chromium installs Debian's, or run make test-browser)"; fi

# The training frameworks of chapter 14, each in a venv of its own: their pins cannot share dslab's (ms-swift 4.6.0
# needs transformers<5.20 and peft<0.21; LLaMA-Factory 0.9.5 transformers<=5.6, peft<=0.18.1, accelerate<=1.11). Same
# torch and deepspeed as dslab; everything else exactly as frameworks/*.txt pins it. The course works without them:
# chapter 14's framework cells then say how to build them, and `make test` compares only what ran.
SWIFT_VENV := .venv-swift
LF_VENV    := .venv-llamafactory

# DeepSpeed JIT-builds its ops into ~/.cache/torch_extensions, keyed by op name: builds from two venvs' copies of
# DeepSpeed would replace each other there on every switch (a minute of compiling each time). So each framework venv
# gets its own folder, set for every Python process of the venv by a sitecustomize.py (activated or not, torchrun's
# children too), and its shared-memory all-reduce is built now, so that no training waits for the compiler.
define build-shm-op
	echo 'import os, sys; os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))' \
	    > "$$($(1)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/sitecustomize.py"
	PATH=$(abspath $(1))/bin:$$PATH $(1)/bin/python -c "from deepspeed.accelerator import get_accelerator as a; b = a().create_op_builder('ShareMemCommBuilder'); b is None or not b.is_compatible(False) or b.load()"
endef

swift: $(SWIFT_VENV)/.installed
llamafactory: $(LF_VENV)/.installed
framework-venvs: swift llamafactory

$(SWIFT_VENV)/.installed: frameworks/ms-swift.txt
	test -x $(SWIFT_VENV)/bin/python || $(PY) -m venv $(SWIFT_VENV)
	$(SWIFT_VENV)/bin/pip install --quiet --upgrade pip
	$(SWIFT_VENV)/bin/pip install --quiet torch==2.13.0
	$(SWIFT_VENV)/bin/pip install --quiet --no-deps -r frameworks/ms-swift.txt
	$(call build-shm-op,$(SWIFT_VENV))
	touch $@

$(LF_VENV)/.installed: frameworks/llamafactory.txt
	test -x $(LF_VENV)/bin/python || $(PY) -m venv $(LF_VENV)
	$(LF_VENV)/bin/pip install --quiet --upgrade pip
	$(LF_VENV)/bin/pip install --quiet torch==2.13.0
	$(LF_VENV)/bin/pip install --quiet --no-deps -r frameworks/llamafactory.txt
ifeq ($(HAS_GPU),)
	# llamafactory/data/mm_plugin.py imports torchaudio at start-up; the registry's torchaudio is a CUDA build whose
	# libraries need libc10_cuda.so. Without them torchaudio imports as pure Python (torchaudio/_extension/utils.py:
	# _load_lib returns False when no library file is there), which is all text SFT needs.
	rm -f $(LF_VENV)/lib/python*/site-packages/torchaudio/lib/*.so
endif
	$(call build-shm-op,$(LF_VENV))
	touch $@

# Chapter 14 and the --print-equivalent runs, with both frameworks' venvs built (3:50 to build both here; chapter 14
# alone then runs 11:30, its eight trainings included).
test-frameworks: setup framework-venvs
	$(BIN)/python -m pytest -q tests/test_frameworks_runs.py
	$(BIN)/python -m pytest -q --nbval notebooks/14_swift_and_llamafactory.ipynb --nbval-current-env --nbval-sanitize-with tests/sanitize.cfg --nbval-cell-timeout=1800

# dslab.compat's checks (tests/test_compat.py) against the newest DeepSpeed on PyPI: a scratch venv with the kit's
# other pins, then `pip install --upgrade deepspeed`, so that a release that breaks a private name dslab relies on is
# seen the day it ships. Not part of `make test` (it downloads); a CI job can run it every day.
LATEST_VENV := build/latest-deepspeed
# Every pin of pyproject.toml's dependencies and dev extra but deepspeed's (read when the target runs).
LATEST_PINS = $(shell $(PY) -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
	print(" ".join(d for d in p["dependencies"] + p["optional-dependencies"]["dev"] if not d.startswith("deepspeed")))')

# The tests run with the scratch venv's tools first on PATH, not .venv's: DeepSpeed takes the first `ninja` there.
test-latest:
	test -x $(LATEST_VENV)/bin/python || $(PY) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/pip install --quiet --upgrade pip
ifeq ($(HAS_GPU),)
	# CPU machine: the CPU wheel first, as `make setup` does
	$(LATEST_VENV)/bin/pip install --quiet torch==2.13.0
endif
	$(LATEST_VENV)/bin/pip install --quiet $(LATEST_PINS)
	$(LATEST_VENV)/bin/pip install --quiet --upgrade deepspeed
	$(LATEST_VENV)/bin/pip install --quiet --no-deps -e .
	$(LATEST_VENV)/bin/python -c "import deepspeed; print('DeepSpeed', deepspeed.__version__)"
	PATH=$(abspath $(LATEST_VENV))/bin:$$PATH $(LATEST_VENV)/bin/python -m pytest -q tests/test_compat.py

bench: setup
	$(BIN)/python benchmarks/course_bench.py

clean:
	rm -rf $(VENV) $(SWIFT_VENV) $(LF_VENV) $(HUB_DIR)
