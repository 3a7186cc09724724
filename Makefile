# Two commands do all the set-up on a fresh machine:
#   make run    start the dashboard (open the link it prints: it carries the start token)
#   make test   lint and run every test
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 8501
ADDRESS ?= 127.0.0.1

.PHONY: install run test lint bench clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The exact pin first: it is the CPU wheel on disk; a looser requirement pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/ddpdash ui --port $(PORT) --address $(ADDRESS)

lint: install
	$(VENV)/bin/ruff check .

test: install lint
	$(PY) -m pytest -q -ra --durations=15

bench: install
	$(PY) bench/run.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
