# The two commands of the README:
#   make reproduce   set up .venv, then run every study notebook headless and write results/
#   make test        set up .venv, then run the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-10)
TORCH_INDEX ?=

.PHONY: setup reproduce reproduce-quick test browser clean-cache gpu-check card-bundle

setup: $(STAMP)

$(STAMP):
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned (the CUDA model follows 2.13's kernel and allocator rules). From PyPI on
	# Linux it is the CUDA build (GBs); TORCH_INDEX=https://download.pytorch.org/whl/cpu takes the CPU one
	$(BIN)/python -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install -q -e '.[dev]'
	# DeepSpeed builds against the installed torch, so without build isolation
	$(BIN)/python -m pip install -q --no-build-isolation deepspeed==0.19.8
	rm -f $(VENV)/.installed-*
	touch $@

reproduce: setup
	$(BIN)/workbench reproduce

reproduce-quick: setup
	$(BIN)/workbench reproduce --quick

# The real-browser tests drive Debian's chromium; installed here when we may (root with apt),
# otherwise those tests skip and say why.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
	      echo "note: could not install chromium (no network?); the browser tests will skip"; \
	  else echo "note: chromium not installed (needs root and apt); the browser tests will skip"; fi; }

# Two workers (pytest-xdist), each a whole test file at a time (a file's fixtures are built once):
# 17-25 min from a fresh clone on 2026-12-02's 2-core machines, 27-46 min on 2026-12-01's (27.5 with a new .venv on one,
# 42-46 on another), 19 min on 2026-11-28's (14 against 22 in one process when the suite was smaller).
# TEST_WORKERS=0 runs in one process. DeepSpeed is installed by setup: a test that finds it cannot
# run fails here (WORKBENCH_TESTS_NEED), where a bare pytest skips it with the reason.
TEST_WORKERS ?= 2
test: setup browser
	WORKBENCH_TESTS_NEED=deepspeed $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

# Every GPU path on this card in minutes (results/gpu_check/); without CUDA: one line, exit 0.
gpu-check: setup
	@$(BIN)/workbench gpu-check

# What a lent GPU machine lacks for gpu-check, packed for it to carry: .whl/site.tar.xz (tools/card_bundle.py)
card-bundle: setup
	$(BIN)/python tools/card_bundle.py

clean-cache:
	rm -rf .cache
