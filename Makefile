# The commands: `make demo`, `make test`, `make lint`, `make typecheck` and `make docs`. Each sets
# everything up from a machine that has nothing but Python.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is pinned here, in the install step, so pip never pulls a CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: setup abi demo test lint typecheck docs bench clean

# the Python side of the native ABI, generated from native/abi.h (standard library only: no venv needed);
# tests/native/test_abi_layout.py fails while the generated file is stale
ABI_LAYOUT := tensorscope/native/abi_layout.py
$(ABI_LAYOUT): tensorscope/native/abi.h tools/gen_abi.py
	$(PYTHON) tools/gen_abi.py

abi: $(ABI_LAYOUT)

$(VENV)/.installed: pyproject.toml Makefile $(ABI_LAYOUT)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test,dev,docs]" "$(TORCH_PIN)"
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	# compile the native hooks and recording engine now (cached per torch/python/source) rather than in the first traced cell;
	# a failed build is not fatal: tensorscope then uses, and says it uses, the pure-Python fallback
	-$(PY) -m tensorscope build-native
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) examples/run_demo.py

test: setup
	$(PY) -m pytest -q tests
	# the whole suite again with the fallback forced: python recording engine, pure-Python
	# warning/error capture (both implementations are tested; ~6 min a pass)
	TENSORSCOPE_FORCE_FALLBACK=1 $(PY) -m pytest -q tests

# ruff (pyflakes, bugbear, isort, pyupgrade, simplify, docstring presence; pyproject.toml [tool.ruff]) over
# everything that is Python
lint: setup
	$(PY) -m ruff check tensorscope tests benchmarks examples tools docs/conf.py docs/_ext

# mypy (pyproject.toml [tool.mypy]): strict on the leaf packages, the rest clean without strict
typecheck: setup
	$(PY) -m mypy

# the documentation site (Sphinx, MyST-NB, PyData theme; docs/conf.py) into docs/_build/html. -W: a warning
# (a broken reference, a page in no toctree, a docstring that does not parse) fails the build; the walkthrough
# notebooks execute during it (a cell that raises fails it too). --keep-going reports every warning at once.
DOCS_STAMP := $(VENV)/.docs-installed
$(DOCS_STAMP): $(VENV)/.installed pyproject.toml
	$(PY) -m pip install -q -e ".[docs]" "$(TORCH_PIN)"
	touch $@

docs: $(DOCS_STAMP)
	$(PY) -m sphinx -b html -W --keep-going -q docs docs/_build/html
	@echo "docs: open docs/_build/html/index.html"

bench: setup
	$(PY) benchmarks/overhead.py

clean:
	rm -rf $(VENV) runs build *.egg-info docs/_build docs/_generated docs/api/generated docs/jupyter_execute
