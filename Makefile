# The README's two commands: `make demo` (main job) and `make test`.
# Both create .venv and install what they need: torch pinned to 2.13.0 first
# (a CPU wheel; letting pip choose would pull GB of CUDA packages), then the project.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0

.PHONY: setup demo test clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: setup
	$(PY) -m backward_doctor.demo

test: setup
	$(PY) -m pytest -q backward_doctor tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
