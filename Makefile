# The commands CI and the README use. Each target creates or reuses .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# what training needs only (torch and the project, no extras): `make train`
TRAIN_STAMP := $(VENV)/.installed-train

.PHONY: setup check test typecheck stubs docs train bench clean

# Every pip call below, and the isolated environments pip builds sdists in (DeepSpeed is one: its
# build imports torch), sees torch pinned to the local CPU wheel: nothing replaces it with a CUDA
# build (GBs). A caller's own PIP_CONSTRAINT wins.
PIP_CONSTRAINT ?= $(abspath .ci/constraints.txt)
export PIP_CONSTRAINT

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: 2.13.0 is the local CPU wheel; the project's range (torch>=2.4)
	# is then already satisfied and pulls no CUDA packages.
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test,docs]'
	touch $(STAMP) $(TRAIN_STAMP)

# `make train` on a fresh machine installs only what training needs (no test or docs extra:
# DeepSpeed's sdist build and transformers took minutes); `make setup` / `make test` later add
# the extras to the same .venv.
$(TRAIN_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e .
	touch $(TRAIN_STAMP)

setup: $(STAMP)

typecheck: $(STAMP)
	$(BIN)/ruff check fnaccel tests benchmarks examples
	$(BIN)/ruff format --check fnaccel tests benchmarks examples
	$(BIN)/mypy

# The facades' type stubs (fnaccel/__init__.pyi, fnaccel/utils/__init__.pyi), from their tables of
# public names: run after adding or moving a public name (tests/test_exported_members.py checks).
stubs: $(STAMP)
	$(BIN)/python -c 'import pathlib, fnaccel, fnaccel.utils, fnaccel._lazy as lazy; \
		[pathlib.Path(m.__file__).with_suffix(".pyi").write_text(lazy.stub(m)) for m in (fnaccel, fnaccel.utils)]'

# The suite runs on 2 pytest-xdist workers; --dist loadfile keeps a file's tests in one worker (its
# module fixtures, some of which launch, are set up once), and each worker starts its own shared
# gloo worlds (tests/conftest.py).
XDIST := -n 2 --dist loadfile

# The fast loop (README, "Contributing"): lint, types, and the tests that start no process group
# (`multiprocess`) and run no script or new interpreter for seconds (`slow`); under 2 minutes on 2 cores.
check: typecheck
	$(BIN)/python -m pytest -q $(XDIST) -m "not multiprocess and not slow" tests

test: typecheck
	$(BIN)/python -m pytest -q $(XDIST) --durations=30 tests
	$(BIN)/python -m pytest -q --doctest-modules fnaccel

# The documentation site in build/site: the guide (docs/*.md) and the API reference generated from
# the docstrings, built strictly (a broken link or anchor, or a public name without a docstring,
# fails). `make test` builds it too, through tests/test_docs_build.py.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict

# The main job: train the example classifier on 2 gloo processes.
train: $(TRAIN_STAMP)
	$(BIN)/fnaccel launch --cpu --num_processes 2 --num_cpu_threads_per_process 1 \
		examples/train_classifier.py

# Every ratio of docs/benchmarks.md in one table, Accelerate and Lightning Fabric measured beside
# (the bench extra, installed with torch pinned so that no other torch is pulled).
bench: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[bench]'
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/bench.py

clean:
	rm -rf $(VENV) runs
