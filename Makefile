# Two commands do everything from a clean clone:  `make demo`  and  `make test`.
# Both create (idempotently) a virtual env in .venv and install what the project needs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-gpu setup clean runner
.DEFAULT_GOAL := test

setup: $(STAMP)

# the native library dsv4_ops._C (setup.py builds it where torch has CUDA and nvcc is found): a change of
# its sources reinstalls, and the in-place build recompiles what changed
NATIVE_SOURCES := $(wildcard csrc/kernels/*.cu csrc/kernels/*.cpp csrc/kernels/*.h)

# If the machine already has a torch (the GPU box), reuse it through --system-site-packages;
# otherwise install the CPU wheel torch==2.13.0 (a plain `torch` would pull a multi-GB CUDA build).
$(STAMP): requirements.txt setup.py $(NATIVE_SOURCES)
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

# two workers (CI has 2 cores): compiling is mostly single-threaded Python; a file's tests stay
# on one worker, so its module/session fixtures (one exported package, one compiled model) build once
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile tests

# GPU-only suite (run on the GPU box)
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu tests

clean:
	rm -rf $(VENV) build *.egg-info dsv4_ops/_C*.so dsv4_ops/_C.build-error

# C++ runner for exported .pt2 packages (csrc/runner): build/dsv4_run, against the libtorch of
# the venv's torch (set up first), or of RUNNER_PY's torch when given (`make runner RUNNER_PY=python3`
# on a machine whose torch is installed already, e.g. the GPU box). See csrc/runner/build.sh.
RUNNER_PY ?=
runner:
	@[ -n "$(RUNNER_PY)" ] || $(MAKE) --no-print-directory setup
	@bash csrc/runner/build.sh $(or $(RUNNER_PY),$(PY))
