# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test install bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# torch is pinned to the CPU build when none is present: a plain `torch` would pull CUDA (gigabytes).
$(STAMP): $(PY) pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[test,torchrec]"
	# torchrec's metadata names the CUDA fbgemm-gpu: its CPU build and deps come from the extra above.
	$(PY) -m pip install --quiet --no-deps "torchrec==1.8.0"
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
