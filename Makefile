# The two commands a learner needs: `make lab` (the course) and `make test` (everything checked).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.dslab-installed
# nvidia-smi answering means a GPU is here: then pip's default (CUDA) torch is the right one.
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)

# Idle OpenMP threads sleep rather than spin: several ranks share a few CPU cores in this course.
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: setup lab test test-unit test-notebooks test-browser slides bench chromium clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
ifeq ($(HAS_GPU),)
	# CPU machine: take the CPU wheel first so nothing pulls a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
endif
	$(BIN)/pip install --quiet -e '.[dev,browser]'
	$(BIN)/python -m dslab.cli prepare
	touch $(STAMP)

lab: setup
	$(BIN)/jupyter lab --notebook-dir=notebooks

test: setup test-unit test-notebooks

test-unit: setup
	$(BIN)/python -m pytest -q tests --ignore=tests/gpu --ignore=tests/browser

test-notebooks: setup
	$(BIN)/python -m pytest -q --nbval notebooks --nbval-current-env --nbval-sanitize-with tests/sanitize.cfg --nbval-cell-timeout=600

# Debian's chromium for the headless browser tests (slides, ZeRO widget); nothing is downloaded by a test tool.
chromium:
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium fonts-noto-cjk >/dev/null)

slides: setup
	$(BIN)/python -m dslab.slides build

test-browser: setup chromium slides
	$(BIN)/python -m pytest -q tests/browser

bench: setup
	$(BIN)/python benchmarks/course_bench.py

clean:
	rm -rf $(VENV)
