# Two set-up commands: `make demo` and `make test`. Both install what they need first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The vision tier's environment (see $(VSTAMP) below)
VVENV  := .venv-vision
VPY    := $(VVENV)/bin/python
VSTAMP := $(VVENV)/.installed

.PHONY: install slurm-deps demo test lint typecheck docs bench gpu-check clean

# fastai 2.8.12's own dependencies less torchvision and spacy, which fastai.basics and
# fastai.tabular never import: the install step installs these, then fastai with --no-deps,
# because PyPI's torchvision may not import beside the pinned CPU torch
# (`operator torchvision::nms does not exist`). A user's `pip install 'unison[fastai]'` takes
# fastai with all of its dependencies.
FASTAI_DEPS := 'fastcore>=2.2.22' 'fasttransform>=0.0.3' 'fastprogress>=0.2.4' 'fastdownload>=0.0.8,<2' \
	'plum-dispatch<2.10' pandas requests pyyaml 'pillow>=9.0.0' scipy scikit-learn matplotlib \
	packaging cloudpickle

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[examples,test,ray]'
	# fastai for tests/test_fastai_bridge.py, beside the pinned torch: its dependencies less
	# torchvision and spacy (FASTAI_DEPS), then fastai alone (--no-deps).
	$(PY) -m pip install -q -c constraints.txt $(FASTAI_DEPS)
	$(PY) -m pip install -q -c constraints.txt --no-deps fastai==2.8.12
	touch $(STAMP)

install: $(STAMP) $(VSTAMP)

# The vision tier (tests/vision) runs in a second environment. PyPI's torchvision imports only
# beside PyPI's torch of the same release (a CUDA build, which runs on the CPU); beside the pinned
# CPU wheel it fails (`operator torchvision::nms does not exist`). That torch costs about 1 CPU-s
# more to import per process, and the main suite starts hundreds of processes, so only the vision
# tier pays it. The same torch release as the pin; the local wheel folder is left out so that pip
# takes PyPI's build instead of the CPU file (`2.13.0+cpu` sorts above `2.13.0`).
$(VSTAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VVENV)
	env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null $(VPY) -m pip install -q \
	    --extra-index-url file:///opt/pypi-more/simple --extra-index-url file:///opt/pypi/simple \
	    torch==2.13.0 torchvision==0.28.0 timm
	$(VPY) -m pip install -q -e '.[vision]' pytest pytest-timeout pytest-xdist psutil scikit-learn
	touch $(VSTAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# ruff, and mypy over src/unison ([tool.mypy] in pyproject.toml).
lint: $(STAMP) typecheck
	$(VENV)/bin/ruff check src tests examples benchmarks docs/*.py
	$(VENV)/bin/ruff format --check src tests examples benchmarks docs/*.py

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The manual (mkdocs.yml, docs/), strict: a broken link or reference, a page left out of the
# nav or a docstring the API reference cannot read fails the build.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir build/site

# Debian's SLURM for tests/distributed/test_slurm.py, which runs a private cluster of its own
# (munged, slurmctld, slurmd; files in a temporary folder, free ports, stopped after the tests).
# Installed once with apt-get as root (CI); silent when already there. Without root or apt-get
# it says so in one line and the SLURM tests are skipped, saying why.
SLURM_BINS := munged slurmctld slurmd sbatch srun scontrol scancel squeue sinfo
slurm-deps:
	@missing=; for b in $(SLURM_BINS); do \
	    PATH="$$PATH:/usr/sbin:/sbin" command -v $$b >/dev/null 2>&1 || missing="$$missing $$b"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "slurm-deps: installing Debian's slurmctld slurmd slurm-client munge (missing:$$missing)"; \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	        slurmctld slurmd slurm-client munge; } >/dev/null \
	    || echo "slurm-deps: apt-get failed: the SLURM tests will be skipped"; \
	else echo "slurm-deps: missing$$missing, and no apt-get as root: the SLURM tests will be skipped"; fi

# The tests, in tiers by what they start (CONTRIBUTING.md, tests/tiers.py).
# `make test` (what CI runs): lint, the strict docs build, then every tier on TEST_JOBS parallel
# workers (pytest-xdist; tests that share a fixture, a fixed name or a port stay on one worker),
# and prints its wall time. `make test-fast`: the in-process tier alone, to run while editing.
TEST_JOBS ?= 3
.PHONY: test-fast test-clock bytecode
test: $(STAMP) $(VSTAMP) slurm-deps test-clock lint docs bytecode
	@$(PY) -m pytest -q -n $(TEST_JOBS) --durations=15; status=$$?; \
	$(VPY) -m pytest -q -n $(TEST_JOBS) tests/vision || status=1; \
	echo "make test: $$(( $$(date +%s) - $$(cat build/.test-start) )) s wall, install excluded ($(TEST_JOBS) workers; load average $$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null))"; \
	exit $$status

# The suite starts hundreds of Python processes; where PYTHONDONTWRITEBYTECODE is set (as on this
# machine) each would compile unison's modules from source again (about 0.14 CPU-s a process).
bytecode:
	@$(PY) -m compileall -q -j 0 src tests examples benchmarks

test-clock:  # when `make test` began, after the installs: lint and docs count, the installs do not
	@mkdir -p build && date +%s > build/.test-start

test-fast: $(STAMP) bytecode
	@start=$$(date +%s); \
	$(PY) -m pytest -q -m "not slow" -n 2 --tier-check=fail --durations=5; status=$$?; \
	echo "make test-fast: $$(( $$(date +%s) - start )) s wall (load average $$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null))"; \
	exit $$status

bench: $(STAMP)
	$(PY) benchmarks/run.py

# The CUDA paths CI cannot run (1 and 2 GPUs); says "skipped" and succeeds without CUDA.
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
