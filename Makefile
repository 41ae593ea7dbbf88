# Two commands do everything from a clean clone:  `make demo`  and  `make test`.
# Both create (idempotently) a virtual env in .venv and install what the project needs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-gpu setup clean
.DEFAULT_GOAL := test

setup: $(STAMP)

# If the machine already has a torch (the GPU box), reuse it through --system-site-packages;
# otherwise install the CPU wheel torch==2.13.0 (a plain `torch` would pull a multi-GB CUDA build).
$(STAMP): requirements.txt setup.py
	@if [ ! -x $(PY) ]; then \
	  if $(PYTHON) -c "import torch" 2>/dev/null; then \
	    echo "[setup] reusing the machine's torch: $$($(PYTHON) -c 'import torch; print(torch.__version__)')"; \
	    $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else \
	    $(PYTHON) -m venv $(VENV); \
	  fi; \
	fi
	@$(PY) -c "import torch" 2>/dev/null || { echo "[setup] installing torch==2.13.0 (CPU)"; $(PY) -m pip install -q torch==2.13.0; }
	@echo "[setup] installing requirements"
	@$(PY) -m pip install -q -r requirements.txt
	@$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m dsv4_ops demo

test: $(STAMP)
	$(PY) -m pytest -q tests

# GPU-only suite (run on the GPU box)
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu tests

clean:
	rm -rf $(VENV) build *.egg-info
