# The README's two commands: `make demo` (main job) and `make test`; and `make lab`.
# All create .venv and install what they need: torch pinned to 2.13.0 first
# (a CPU wheel; letting pip choose would pull GB of CUDA packages), then the project
# with its test and demo extras (nbclient, nbconvert, jupyterlab, ...).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0

.PHONY: setup chromium demo lab test torch-versions clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[test,demo]'
	touch $@

# Runs notebooks/00_tour.ipynb headlessly in a Jupyter kernel and writes out/tour.html (one
# self-contained page: the panels' static views, plots embedded, nothing fetched); prints its path.
# The seed scenarios as text reports: `$(PY) -m backward_doctor.frontends.demo --text`.
demo: setup
	$(PY) -m backward_doctor.frontends.demo

# JupyterLab on notebooks/, opening the tour. LAB_ARGS=--no-browser on a machine without one.
# The venv's bin comes first on PATH, so the kernel builds the native recorder with the venv's ninja and
# compiler wrappers; --allow-root where make runs as root (a container); the classic Notebook's upgrade
# banner (its extension is installed for the browser test) is switched off: JupyterLab's lines come first.
LAB_ARGS ?=
LAB_ROOT := $(shell [ "$$(id -u)" = 0 ] && echo --allow-root)
lab: setup
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/jupyter lab notebooks/00_tour.ipynb \
	  --ServerApp.jpserver_extensions="nbclassic=False" $(LAB_ROOT) $(LAB_ARGS)

# The browser test drives Debian's chromium (Playwright's own browser download is not used).
# Idempotent; if it cannot be installed the browser test skips itself and says why.
chromium:
	@if [ ! -x /usr/bin/chromium ]; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  ( $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null ) \
	    || echo "could not install chromium: tests/test_browser.py will be skipped"; \
	fi

# Every tier, on the native recorder where it builds (conftest builds it once per torch version, 1-2 min); then the
# scenario suites again on the Python tier, which machines without a compiler use.
PYTHON_TIER_TESTS = tests/test_loop_trends.py tests/test_findings.py tests/test_silent.py tests/test_house_rules.py tests/test_tiers.py \
	tests/test_api.py tests/test_scenarios_plain.py tests/test_memory.py
test: setup chromium
	$(PY) -m pytest -q backward_doctor tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; \
	if [ $$rc -ne 0 ]; then exit $$rc; fi; \
	BACKWARD_DOCTOR_NATIVE=0 $(PY) -m pytest -q $(PYTHON_TIER_TESTS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# The core tiers against other torch versions, each in a venv of its own (.venv-torch-VERSION): the newest
# torch pip finds on PyPI and the oldest pyproject declares. Not in CI and not in `make test`: PyPI's torch
# pulls several GB of CUDA packages per venv. The native recorder is built once per torch version.
# tests/test_torch_versions.py pins an error wording PyTorch changed after 2.10: on 2.10 it fails by design.
TORCH_OLDEST ?= 2.10.0
CORE_TESTS = backward_doctor tests/unit tests/test_layers.py tests/test_api.py tests/test_findings.py \
	tests/test_scenarios_plain.py tests/test_memory.py tests/test_native.py tests/test_torch_versions.py
torch-versions:
	@rc=0; for v in newest $(TORCH_OLDEST); do \
	  venv=.venv-torch-$$v; spec=$$( [ $$v = newest ] && echo torch || echo torch==$$v ); \
	  echo "== $$venv: installing $$spec (GBs the first time)"; \
	  { [ -x $$venv/bin/python ] || $(PYTHON) -m venv $$venv; } && $$venv/bin/pip install -q --upgrade "$$spec" && \
	  $$venv/bin/python -c 'import torch; print("torch==" + torch.__version__.split("+")[0])' > $$venv/torch-pin.txt && \
	  $$venv/bin/pip install -q -e '.[test]' -c $$venv/torch-pin.txt || { rc=1; continue; }; \
	  echo "== torch $$($$venv/bin/python -c 'import torch; print(torch.__version__)') in $$venv"; \
	  $$venv/bin/python -m pytest -q -p no:cacheprovider $(CORE_TESTS) || rc=1; \
	done; exit $$rc

clean:
	rm -rf $(VENV) .venv-torch-* build *.egg-info .pytest_cache out
