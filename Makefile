# Two set-up commands: `make demo` and `make test`. Both install what they need first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test lint docs bench gpu-check clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[examples,test,ray]'
	# fastai for tests/test_fastai_bridge.py: its dependencies (less torchvision and spacy, see
	# pyproject's fastai-core), then fastai alone; torch stays the pinned one.
	$(PY) -m pip install -q -c constraints.txt -e '.[fastai-core]'
	$(PY) -m pip install -q -c constraints.txt --no-deps fastai==2.8.12
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples benchmarks docs/*.py
	$(VENV)/bin/ruff format --check src tests examples benchmarks docs/*.py

# The manual (mkdocs.yml, docs/), strict: a broken link or reference, a page left out of the
# nav or a docstring the API reference cannot read fails the build.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir build/site

test: lint docs
	$(PY) -m pytest -q --durations=15

bench: $(STAMP)
	$(PY) benchmarks/run.py

# The CUDA paths CI cannot run (1 and 2 GPUs); says "skipped" and succeeds without CUDA.
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
