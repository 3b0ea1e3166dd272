# The two commands of the README: `make demo` and `make test` (and `make bench`, the
# benchmark; `make wheel`, the wheel of docs/contributing.md; `make docs`, the docs site). Each
# creates the venv, installs what it needs and builds the extension first, so a fresh clone
# needs nothing else.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.deps-installed
# benches/ may not exist yet on a fresh clone; ruff fails on a missing path.
PY_SOURCES := python tests $(wildcard benches) docs/hooks
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(abspath $(VENV))/bin:$(PATH)

# One build per profile. Every Rust command below (maturin's cargo included) uses the
# release profile and sees the same pyo3 settings, so each compiles only what the ones
# before it have not: pyo3's build script reruns, and pyo3, rust-numpy and the extension
# compile again, whenever a variable it reads differs from the last build's. The
# extension is built for the stable ABI (abi3-py311), which needs no interpreter to
# configure on Linux: PYO3_NO_PYTHON keeps the Python on PATH, the venv and maturin's
# choice of interpreter out of it. PYO3_BUILD_EXTENSION_MODULE (maturin sets it too):
# libpython is not linked.
export PYO3_NO_PYTHON := 1
export PYO3_BUILD_EXTENSION_MODULE := 1
# The wheel (`make wheel`), and the fresh venv `make smoke` installs it into; SMOKE_PYTHON
# is the interpreter of that venv (any CPython >= 3.11: the wheel is abi3).
DIST := dist
SMOKE_VENV := .venv-smoke
SMOKE_PYTHON ?= $(PYTHON)

.PHONY: venv build wheel smoke demo bench docs test cargo-test pytest lint fmt clean

venv: $(STAMP)

# requirements-dev.txt includes torch (tests/onray/test_receivers.py runs Ray with and
# without it; the next issue's blocking API takes its tensors): PyPI's wheel and the
# CUDA libraries it depends on, 5.3 GB, about 3 minutes of the first `make` on a fresh
# machine (PyTorch's CPU-only wheels are not on PyPI); later runs reuse the venv.
$(STAMP): requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $(STAMP)

# Release build: the demo and the benchmarks measure it, and the tests run fast on it.
# maturin develop and maturin build run the same cargo command: whichever runs second
# compiles nothing. It writes python/gradstream/_native.abi3.so; an extension left there by
# an older, version-specific build (_native.cpython-311-*.so) would shadow it, since
# Python tries that suffix first.
build: $(STAMP)
	rm -f python/gradstream/_native.cpython-*.so
	$(VENV)/bin/maturin develop --release --quiet

# The one Linux wheel, cp311-abi3 with the manylinux tag maturin's audit of its symbols
# gives (docs/contributing.md), alone in dist/.
wheel: $(STAMP)
	rm -f $(DIST)/gradstream-*.whl
	$(VENV)/bin/maturin build --release --quiet --out $(DIST)

# The wheel as a user gets it: installed into a new venv (its dependencies at the pinned
# versions of requirements-dev.txt), then tests/smoke/wheel_smoke.py run by that venv's
# Python from outside the source tree.
smoke: wheel
	rm -rf $(SMOKE_VENV)
	$(SMOKE_PYTHON) -m venv $(SMOKE_VENV)
	$(SMOKE_VENV)/bin/python -m pip install --quiet --constraint requirements-dev.txt \
		$(DIST)/gradstream-*.whl
	$(SMOKE_VENV)/bin/python tests/smoke/wheel_smoke.py

demo: build
	$(PY) -m gradstream demo

# The peer comparison suite (benches/suite/), the connection and TLS rows included; e.g.
# `make bench BENCH_ARGS="--quick --json b.json"`, then `python benches/perf_page.py b.json`
# (the tables of docs/performance.md; with --install, the run that page shows).
# Then, when torch imports, the torch.distributed backend against gloo
# (benches/torch_backend.py: all-reduce across 2 and 3 processes, DDP steps/s).
# Then, when Ray imports, the Ray rows (benches/ray_bench.py: its across-nodes rows need root
# for a network namespace, and are skipped with a note without it); it takes --quick from
# BENCH_ARGS, and RAY_BENCH_ARGS (e.g. "--json r.json") for itself.
BENCH_ARGS ?=
RAY_BENCH_ARGS ?=
bench: build
	$(PY) benches/bench.py $(BENCH_ARGS)
	$(PY) benches/wan.py $(if $(filter --quick,$(BENCH_ARGS)),--mib 256,)
	if $(PY) -c 'import torch' 2>/dev/null; then \
		$(PY) benches/torch_backend.py $(if $(filter --quick,$(BENCH_ARGS)),--mib 64 --rounds 2,); fi
	if $(PY) -c 'import ray' 2>/dev/null; then \
		$(PY) benches/ray_bench.py $(filter --quick,$(BENCH_ARGS)) $(RAY_BENCH_ARGS); fi

# The docs site (mkdocs.yml) into site/. It imports the package (the API reference is read
# from its sources and the extension's stubs, the CLI reference from its argparse parser),
# hence `build`. --strict: a warning (a broken link, an API name griffe cannot find) fails.
# NO_MKDOCS_2_WARNING: Material's notice about its successor is not about this site.
export NO_MKDOCS_2_WARNING := 1
docs: build
	$(VENV)/bin/mkdocs build --strict

# The core's tests without Python (its unit tests, the original's API tests in
# crates/gradstream-core/tests/; the extension has none, `test = false`), and a build of
# the core without the tokio feature. `--workspace`: the dependencies are resolved with the
# extension's features, as maturin resolves them, so the release build above is reused;
# `-p gradstream-core` alone would compile arrow again (rust-numpy turns on features of
# num-traits that arrow builds on). The build without tokio is a check in the release
# profile, beside clippy's.
cargo-test:
	cargo test --release --workspace
	cargo check --release -p gradstream-core --no-default-features --quiet

pytest: build
	$(PY) -m pytest -q

# lint runs last so that a formatting slip does not hide test results.
test: build cargo-test pytest smoke lint

# mypy (strict, the files of pyproject.toml: the package and the bench suite) checks them
# against the extension's stubs; stubtest checks the stubs against the built extension (it
# imports it, hence `build`). clippy checks in the release profile: its build scripts and
# proc-macros are the release build's. Last, the docs site is built strictly (`make docs`).
lint: build
	cargo fmt --check
	cargo clippy --release --workspace --all-targets -- -D warnings
	$(VENV)/bin/ruff check $(PY_SOURCES)
	$(VENV)/bin/ruff format --check $(PY_SOURCES)
	$(VENV)/bin/mypy --config-file pyproject.toml
	$(PY) -m mypy.stubtest --mypy-config-file pyproject.toml gradstream._native
	$(VENV)/bin/mkdocs build --strict --quiet

fmt: $(STAMP)
	cargo fmt
	$(VENV)/bin/ruff format $(PY_SOURCES)

clean:
	rm -rf $(VENV) $(SMOKE_VENV) $(DIST) target site
