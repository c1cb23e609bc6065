# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# pip does not compile the environment's 13,000 modules (half the install time, most never
# imported): each module's bytecode is written at its first import instead, which needs
# Python free to write it.
PIP    := $(PY) -m pip install --quiet --no-compile
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test install bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# torch is pinned to the CPU build when none is present: a plain `torch` would pull CUDA (gigabytes).
$(STAMP): $(PY) pyproject.toml
	torch=$$($(PY) -c "import torch" 2>/dev/null || echo "torch==2.13.0"); $(PIP) $$torch -e ".[test,torchrec]"
	# torchrec's metadata names the CUDA fbgemm-gpu: its CPU build and deps come from the extra above.
	$(PIP) --no-deps "torchrec==1.8.0"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m remoteloader.tools.demo --data data/demo

test: $(STAMP)
	$(VENV)/bin/lint-imports --no-logo
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) -m benchmarks.loader

clean:
	rm -rf $(VENV) data/demo
