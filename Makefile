# Every target bootstraps its own virtual environment on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-slow test-peers proofs bench bench-net bench-gpu bench-e2e bench-elastic lint format figures readme-table docs clean

# Python writes the bytecode of the modules it imports as it first imports them, rather than
# pip compiling every installed module up front (half of a fresh install's 40 s).
unexport PYTHONDONTWRITEBYTECODE

# The environment is made without a pip of its own (ensurepip takes 7 s) and installed into by
# the interpreter's pip (--python); where that interpreter has no pip, the environment gets one.
PIP = $(shell $(PYTHON) -m pip --version >/dev/null 2>&1 \
	&& echo "$(PYTHON) -m pip --python $(PY)" || echo "$(PY) -m pip")

$(STAMP): pyproject.toml
	$(PYTHON) -m venv --without-pip $(VENV)
	$(PYTHON) -m pip --version >/dev/null 2>&1 || $(PY) -m ensurepip -q
	$(PIP) install -q --no-compile -e '.[dev,experiments,elastic]'
	touch $(STAMP)

# Sphinx and its theme, for make docs and the docs build of make test-slow.
DOCS_STAMP := $(VENV)/.installed-docs
$(DOCS_STAMP): $(STAMP)
	$(PIP) install -q --no-compile -e '.[docs]'
	touch $(DOCS_STAMP)

## make test: lint, then the fast test suite (CI runs this).  Each test file stays on one
## pytest worker (--dist loadfile), so its compiled programs and module fixtures are built
## once.  Three workers on this 2-core machine finish the fast suite 30-36 s sooner than two
## (pytest 3m55-4m19 against 4m25-4m55 in back-to-back runs): a worker waiting on the
## processes a test launched, or on a device thread, leaves its core to another.
JOBS ?= 3
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q -n $(JOBS) --dist loadfile -m "not slow"

## make test-slow: the long statistical and training tests.
test-slow: $(DOCS_STAMP)
	$(PY) -m pytest -q -n $(JOBS) --dist loadfile -m slow

## make test-peers: install the CPU PyTorch build and run the cross-checks against it.
test-peers: $(STAMP)
	$(PIP) install -q torch==2.13.0
	$(PY) -m pytest -q -m peers

## make proofs: check every theorem the library relies on; writes proofs_checks/REPORT.md.
proofs: $(STAMP)
	$(PY) -m proofs_checks

## make bench-net: measured training steps of 2 and 4 jax.distributed processes on a loopback
## limited to 0.1/1/10 Gbit/s (needs root for ip netns and tc; says why and exits 0 otherwise);
## writes results/bench_net.{json,md,png}.  ARGS=--quick: 1 Gbit/s only.
bench-net: $(STAMP)
	$(PY) -m experiments.net.run $(ARGS)

## make bench-gpu: the codecs on an accelerator as a fraction of its memory bandwidth (run it on
## a GPU; on a CPU it reports ratios to the copy only); writes results/bench_gpu.{json,md}.
bench-gpu: $(STAMP)
	$(PY) -m experiments.gpu.run $(ARGS)

## make bench-e2e: time to a validation-loss target on the rate-limited loopback (as root);
## writes results/bench_e2e.{json,md,png}.  ARGS=--sweep: the learning-rate sweep and the
## target, in simulation (writes experiments/e2e/sweep.json); ARGS=--quick: 1 Gbit/s,
## dense bf16 and two methods, one seed; ARGS=--resume: reuse the timed runs results/ holds.
bench-e2e: $(STAMP)
	$(PY) -m experiments.e2e.run $(ARGS)

## make bench-elastic: elastic DiLoCo on Ray (4 islands) under a kill with restart, a 3x
## straggler, a poisoned island and a killed synchronizer, against lock-step compjax.diloco
## under jax.distributed with the same kill, on a loopback limited to 0.1 Gbit/s (as root);
## writes results/bench_elastic.{json,md,png}.  ARGS=--quick: 8 rounds, clean and the kill;
## ARGS=--resume: reuse the runs results/bench_elastic_runs/ holds.
bench-elastic: $(STAMP)
	$(PY) -m experiments.elastic.run $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

## make figures: reproduce the figures under paper_figs/out/ (FULL=1: the longer runs).
figures: $(STAMP)
	MPLBACKEND=Agg FULL=$(FULL) $(PY) -m paper_figs

## make bench: the speed benchmarks (installs the CPU PyTorch build); writes results/bench.{json,md}.
bench: $(STAMP)
	$(PIP) install -q torch==2.13.0
	$(PY) -m experiments.bench.run

## make docs: the documentation (guides and the API reference from the docstrings) into
## docs/_build/html; every warning is an error.  make test-slow builds it too (tests/test_docs.py).
docs: $(DOCS_STAMP)
	$(PY) -m sphinx -W --keep-going -j 1 -b html docs docs/_build/html

## make readme-table: regenerate the compressor tables of README.md and docs/compressors.md from the code.
readme-table: $(STAMP)
	$(PY) -m compjax.table --update README.md docs/compressors.md

## make clean: what the targets generated; the committed figures and reports under paper_figs/out
## stay (only the files git ignores there go), as they take hours to remake.
clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache results docs/_build docs/api/generated
	git clean -qfX paper_figs/out
