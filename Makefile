# The two commands of the README: `make demo` and `make test`. Each creates the venv,
# installs what it needs and builds the extension first, so a fresh clone needs nothing else.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.deps-installed
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: venv build demo test cargo-test pytest stubtest lint fmt clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "maturin>=1.9,<2" "numpy>=1.26" "pyarrow>=14" \
		"pytest>=8" "hypothesis>=6.100" "mypy>=1.10" "ruff>=0.6"
	touch $(STAMP)

# Release build: the demo and the benchmarks measure it, and the tests run fast on it.
build: $(STAMP)
	$(VENV)/bin/maturin develop --release --quiet

demo: build
	$(PY) -m gradstream.demo

cargo-test:
	cargo test --release

stubtest: build
	$(PY) -m mypy.stubtest gradstream._native

pytest: build
	$(PY) -m pytest -q

test: build cargo-test pytest

lint: $(STAMP)
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings
	$(VENV)/bin/ruff check python tests benches
	$(VENV)/bin/ruff format --check python tests benches

fmt: $(STAMP)
	cargo fmt
	$(VENV)/bin/ruff format python tests benches

clean:
	rm -rf $(VENV) target
