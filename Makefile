# The two commands of the README: `make demo` and `make test` (and `make bench`, the
# benchmark). Each creates the venv, installs what it needs and builds the extension first,
# so a fresh clone needs nothing else.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.deps-installed
# benches/ may not exist yet on a fresh clone; ruff fails on a missing path.
PY_SOURCES := python tests $(wildcard benches)
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: venv build demo bench test cargo-test pytest lint fmt clean

venv: $(STAMP)

$(STAMP): requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $(STAMP)

# Release build: the demo and the benchmarks measure it, and the tests run fast on it.
build: $(STAMP)
	$(VENV)/bin/maturin develop --release --quiet

demo: build
	$(PY) -m gradstream demo

# The peer comparison suite (benches/suite/), the connection and TLS rows included; e.g.
# `make bench BENCH_ARGS="--quick --json b.json"`, then `python benches/readme_table.py b.json`.
BENCH_ARGS ?=
bench: build
	$(PY) benches/bench.py $(BENCH_ARGS)

# The core alone, without Python (no libpython linked): its unit tests, the original's API
# tests (crates/gradstream-core/tests/), and a build without the tokio feature.
cargo-test:
	cargo test --release -p gradstream-core
	cargo check -p gradstream-core --no-default-features --quiet

pytest: build
	$(PY) -m pytest -q

# lint runs last so that a formatting slip does not hide test results.
test: build cargo-test pytest lint

# mypy (strict, the files of pyproject.toml: the package and the bench suite) checks them
# against the extension's stubs; stubtest checks the stubs against the built extension (it
# imports it, hence `build`).
lint: build
	cargo fmt --check
	cargo clippy --workspace --all-targets -- -D warnings
	$(VENV)/bin/ruff check $(PY_SOURCES)
	$(VENV)/bin/ruff format --check $(PY_SOURCES)
	$(VENV)/bin/mypy --config-file pyproject.toml
	$(PY) -m mypy.stubtest --mypy-config-file pyproject.toml gradstream._native

fmt: $(STAMP)
	cargo fmt
	$(VENV)/bin/ruff format $(PY_SOURCES)

clean:
	rm -rf $(VENV) target
