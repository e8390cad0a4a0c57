# Everything a newcomer needs, from a machine with nothing but Python 3.10+.
#   make run    set up .venv and run the main job on the embedded default (local Ray, tiny model, sample data)
#   make test   set up .venv and run the test suite
#   make docs         build the docs site (docs/, mkdocs.yml) into site/ with --strict: a broken link fails
#   make docs-serve   serve it on http://127.0.0.1:8000, rebuilt as pages change
#   Both install exactly the versions in constraints.txt (the lock, shared with the cluster image).
#   make test-compat  the Ray tier of the suite on the oldest and newest Ray pyproject.toml allows,
#                     each in its own venv (.venv-ray<version>; tools/test_compat.sh; not in CI)
#   make lock         regenerate constraints.txt after a change to pyproject.toml's dependencies
#   make test-latest  the suite on the newest versions pyproject.toml's ranges allow (.venv-latest;
#                     not in CI: it finds a dependency's new release before the lock moves to it)
#   make gpu-wheels   gather into .whl the wheels a bare GPU machine needs beside its image (tools/gpu_wheels.sh:
#                     worked out from the lock and tools/gpu_image_packages.txt; wheels + repo <= 60 MiB)
#   make gpu-check    on a CUDA machine: all of raypack's GPU evidence in <= 9 min, most valuable first (GPU
#                     tests, raypack against TRL, step profiles, the other benchmarks); installs .whl first
#   make bench-peers  on a CUDA machine: only raypack against TRL and the step profiles
#   make bench-smoke  the gpu-check steps on the CPU with every benchmark's --smoke
#   make gpu-rehearsal  gpu-check as the GPU machine runs it, on the CPU: a Python 3.12 venv holding only the
#                     image's packages, the wheels as gathered, offline (tools/gpu_rehearsal.sh; root, ~5 GB, ~25 min on 2 cores)
#   make bench-recompute  on a CUDA machine: each gradient checkpointing mode, eager, compiled and with
#                     Liger, against the memory estimate (benchmarks/recompute.py; torch and
#                     transformers only; not part of gpu-check)
#   make test-liger   Liger-Kernel's exactness tests on the CPU, in Triton's interpreter: installs
#                     liger-kernel and triton (1 GB, not in the lock) into .cache/liger, not .venv
PYTHON ?= python3
VENV   ?= .venv
# Pinned so pip takes the CPU build where one is on disk; override for a CUDA machine.
TORCH  ?= torch==2.13.0
LOCK   := constraints.txt
BIN    := $(VENV)/bin
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions

.PHONY: setup run test docs docs-serve test-latest test-compat test-liger lock gpu-wheels gpu-check gpu-rehearsal bench-peers bench-smoke bench-recompute clean
setup: $(VENV)/.installed

# torch first, from $(TORCH) (another version on a CUDA box: the lock's torch pin is left out of
# the constraints then), then raypack and everything else at the lock's versions.
$(VENV)/.installed: pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	mkdir -p .cache && grep -v '^torch==' $(LOCK) > .cache/constraints-without-torch.txt
	$(BIN)/pip install -q -c .cache/constraints-without-torch.txt -e ".[dev]"
	touch $@

run: setup
	$(BIN)/raypack train --config jobs/configs/quickstart.yaml

test: setup
	$(BIN)/pytest -q tests

# The configuration and command-line references, the error list and the benchmark index are
# generated from the code at build time (tools/docs_hooks.py).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr 127.0.0.1:8000

# The liger extra's version; triton: the newest, which Liger's kernels are checked with on the CPU.
LIGER_CPU ?= liger-kernel==0.8.5 triton==3.9.0
.cache/liger/.installed: | setup
	$(BIN)/pip install -q --no-deps --target .cache/liger $(LIGER_CPU)
	touch $@

test-liger: setup .cache/liger/.installed
	PYTHONPATH=$(CURDIR)/.cache/liger $(BIN)/pytest -q tests/unit/model/test_liger_interpreted.py

test-latest:
	PYTHON=$(PYTHON) TORCH="$(TORCH)" tools/test_latest.sh

test-compat:
	PYTHON=$(PYTHON) TORCH="$(TORCH)" tools/test_compat.sh

lock:
	TORCH="$(TORCH)" PYTHON=$(PYTHON) tools/lock.sh

gpu-wheels: setup
	tools/gpu_wheels.sh

gpu-rehearsal: setup
	tools/gpu_rehearsal.sh

# No setup for gpu-check: the GPU machine has no network; it uses the venv where there is one.
BENCH_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
gpu-check:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(BENCH_PYTHON) tools/bench_gpu.py

bench-peers:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(BENCH_PYTHON) tools/bench_gpu.py --peers

bench-recompute:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(BENCH_PYTHON) benchmarks/recompute.py

bench-smoke: setup
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(BIN)/python tools/bench_gpu.py --smoke

clean:
	rm -rf $(VENV) .venv-latest .venv-ray* .cache site
