# The two commands of the README:
#   make reproduce   set up .venv, then run every study notebook headless and write results/
#   make test        set up .venv, then run the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-10)

.PHONY: setup reproduce reproduce-quick test clean-cache

setup: $(STAMP)

$(STAMP):
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	# DeepSpeed builds against the installed torch, so without build isolation
	$(BIN)/python -m pip install -q --no-build-isolation deepspeed==0.19.8
	rm -f $(VENV)/.installed-*
	touch $@

reproduce: setup
	$(BIN)/workbench reproduce

reproduce-quick: setup
	$(BIN)/workbench reproduce --quick

test: setup
	$(BIN)/python -m pytest

clean-cache:
	rm -rf .cache
