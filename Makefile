# Everything a newcomer needs, from a machine with nothing but Python 3.10+.
#   make run    set up .venv and run the main job on the embedded default (local Ray, tiny model, sample data)
#   make test   set up .venv and run the test suite
PYTHON ?= python3
VENV   ?= .venv
# Pinned so pip takes the CPU build where one is on disk; override for a CUDA machine.
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions

.PHONY: setup run test bench clean
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

run: setup
	$(BIN)/raypack train --config jobs/configs/quickstart.yaml

test: setup
	$(BIN)/pytest -q tests

clean:
	rm -rf $(VENV) .cache
