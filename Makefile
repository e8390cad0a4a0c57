# Everything a newcomer needs, from a machine with nothing but Python 3.10+.
#   make run    set up .venv and run the main job on the embedded default (local Ray, tiny model, sample data)
#   make test   set up .venv and run the test suite
#   make bench-gpu    on a CUDA machine: GPU tests + benchmarks in < 9 min (tools/bench_gpu.py); Ray and
#                     DeepSpeed come from the wheels in .whl (tools/gpu_wheels.sh) where they are missing
#   make bench-smoke  the same steps on the CPU with every benchmark's --smoke
PYTHON ?= python3
VENV   ?= .venv
# Pinned so pip takes the CPU build where one is on disk; override for a CUDA machine.
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions

.PHONY: setup run test bench-gpu bench-smoke clean
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

# No setup for bench-gpu: the GPU machine has no network; it uses the venv where there is one.
BENCH_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
bench-gpu:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(BENCH_PYTHON) tools/bench_gpu.py

bench-smoke: setup
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(BIN)/python tools/bench_gpu.py --smoke

clean:
	rm -rf $(VENV) .cache
