# Everything a newcomer needs, from a machine with nothing but Python 3.10+.
#   make run    set up .venv and run the main job on the embedded default (local Ray, tiny model, sample data)
#   make test   set up .venv and run the test suite
#   Both install exactly the versions in constraints.txt (the lock, shared with the cluster image).
#   make lock         regenerate constraints.txt after a change to pyproject.toml's dependencies
#   make test-latest  the suite on the newest versions pyproject.toml's ranges allow (.venv-latest;
#                     not in CI: it finds a dependency's new release before the lock moves to it)
#   make bench-gpu    on a CUDA machine: GPU tests + benchmarks in < 10 min (tools/bench_gpu.py); Ray and
#                     DeepSpeed come from the wheels in .whl (tools/gpu_wheels.sh) where they are missing
#   make bench-peers  on a CUDA machine: raypack against TRL's SFTTrainer, same GPU (benchmarks/peers.py), and
#                     where a train step's time goes (benchmarks/step_profile.py), < 10 min
#   make bench-smoke  the same steps on the CPU with every benchmark's --smoke
#   make bench-recompute  on a CUDA machine: each gradient checkpointing mode, eager, compiled and with
#                     Liger, against the memory estimate (benchmarks/recompute.py; torch and
#                     transformers only; not part of bench-gpu's 10 minutes)
#   make test-liger   Liger-Kernel's exactness tests on the CPU, in Triton's interpreter: installs
#                     liger-kernel and triton (1 GB, not in the lock) into .cache/liger, not .venv
PYTHON ?= python3
VENV   ?= .venv
# Pinned so pip takes the CPU build where one is on disk; override for a CUDA machine.
TORCH  ?= torch==2.13.0
LOCK   := constraints.txt
BIN    := $(VENV)/bin
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions

.PHONY: setup run test test-latest test-liger lock bench-gpu bench-peers bench-smoke bench-recompute clean
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

# The liger extra's version; triton: the newest, which Liger's kernels are checked with on the CPU.
LIGER_CPU ?= liger-kernel==0.8.5 triton==3.9.0
.cache/liger/.installed: | setup
	$(BIN)/pip install -q --no-deps --target .cache/liger $(LIGER_CPU)
	touch $@

test-liger: setup .cache/liger/.installed
	PYTHONPATH=$(CURDIR)/.cache/liger $(BIN)/pytest -q tests/unit/model/test_liger_interpreted.py

test-latest:
	rm -rf .venv-latest && $(PYTHON) -m venv .venv-latest
	.venv-latest/bin/pip install -q --upgrade pip "$(TORCH)"
	.venv-latest/bin/pip install -q --upgrade --upgrade-strategy eager -e ".[dev]"
	.venv-latest/bin/pip freeze --exclude-editable | diff $(LOCK) - | grep '^[<>]' || true
	.venv-latest/bin/pytest -q tests

lock:
	TORCH="$(TORCH)" PYTHON=$(PYTHON) tools/lock.sh

# No setup for bench-gpu: the GPU machine has no network; it uses the venv where there is one.
BENCH_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
bench-gpu:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(BENCH_PYTHON) tools/bench_gpu.py

bench-peers:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(BENCH_PYTHON) tools/bench_gpu.py --peers

bench-recompute:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(BENCH_PYTHON) benchmarks/recompute.py

bench-smoke: setup
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(BIN)/python tools/bench_gpu.py --smoke

clean:
	rm -rf $(VENV) .venv-latest .cache
