# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt

.PHONY: demo test test-fast lint docs install clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml constraints.txt | $(PY)
	$(PIP) -e .
	@touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) -e '.[dev,docs,hf,jpeg,mlflow,mlflow-server,tensorboard,timm,wandb]'
	@touch $@

install: $(VENV)/.installed

# The main job: DDP with 2 processes on the embedded dataset (GPUs if 2 are present, else CPU),
# trained afresh each time (train.resume=never).
demo: $(VENV)/.installed
	@devices=$$($(PY) -c "import torch; print('auto' if torch.cuda.device_count() >= 2 else 'cpu')"); \
	$(VENV)/bin/multicard train --config configs/demo.yaml --nproc-per-node 2 devices=$$devices train.resume=never

# Two test processes: most tests wait on subprocesses (torch imports, rendezvous, loaders) and leave
# a core idle; a file's tests stay in one process so its module fixtures are built once.
# compileall first: the suite starts ~500 Python processes, and where PYTHONDONTWRITEBYTECODE is set
# (as on our CI machines) each would otherwise compile multicard's modules afresh (~0.1 s apiece).
# The sdist and the wheel are built first (into dist/, the wheel from the sdist): tests/test_packaging.py
# installs that wheel into a fresh environment; tests/test_docs.py builds the site with --strict.
test: $(VENV)/.installed-dev
	$(PY) -m ruff check src tests scripts/docs_hooks.py
	$(PY) -m mypy
	$(PY) -m compileall -q src tests
	rm -rf dist && $(PY) -m build --no-isolation --quiet --outdir dist .
	MULTICARD_WHEEL=$$(ls $(CURDIR)/dist/multicard-*.whl) $(PY) -m pytest -n 2 --dist loadfile

# The unit tests alone (no multi-process or end-to-end runs): under a minute, for work in progress.
test-fast: $(VENV)/.installed-dev
	$(PY) -m compileall -q src tests
	$(PY) -m pytest -m "not distributed and not slow" -n 2 --dist loadfile

# The documentation site, from docs/ (mkdocs.yml): site/index.html. Any warning fails the build.
docs: $(VENV)/.installed-dev
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# ruff, then mypy over src/multicard ([tool.mypy] in pyproject.toml; ~20 s without its cache in .mypy_cache)
lint: $(VENV)/.installed-dev
	$(PY) -m ruff check src tests scripts/docs_hooks.py
	$(PY) -m mypy

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache site dist build
