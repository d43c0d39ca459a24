# `make demo` and `make test` set everything up on a fresh machine (Python 3.12 venv + install)
# and then run the demo or the test suite. The venv lives outside the checkout and is rebuilt
# whenever setup.py or the checkout's path changes.
SHELL := /bin/bash
PYTHON312 ?= $(shell for p in $(HOME)/.pyenv/versions/3.12*/bin/python3.12 python3.12 python3; do \
	$$p -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null && { echo $$p; break; }; done)
VENV_KEY := $(shell cat setup.py | sha1sum | cut -c1-10)-$(shell echo $(CURDIR) | sha1sum | cut -c1-6)
VENV ?= $(HOME)/.cache/megatron_lorafusion/venv-$(VENV_KEY)
BIN := $(VENV)/bin

.PHONY: setup demo test lint
setup: $(VENV)/.installed

$(VENV)/.installed: setup.py
	@test -n "$(PYTHON312)" || { echo "error: Python 3.12 not found (try: pyenv install 3.12)"; exit 1; }
	rm -rf $(VENV)
	$(PYTHON312) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

demo: setup
	$(BIN)/lorafusion synth-data --out-dir runs/demo/data --num 2000
	$(BIN)/lorafusion train configs/demo.yaml

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest -q -n 2 --dist worksteal
