# The two commands of the README: `make run` (the main job) and `make test` (the test suite).
# Both create .venv with a Python >= 3.12 and install k3jax first (scripts/setup.sh). `make gpu-test` runs the tests
# marked gpu on this machine's GPU; `make gpu-test PY=python3` uses an image's own Python instead of .venv.
VENV_PY := .venv/bin/python
PY := $(VENV_PY)

.PHONY: setup run test gpu-test
setup:
	@scripts/setup.sh

run: setup
	$(PY) -m experiments.train --config=experiments/configs/tiny.py --workdir=runs/tiny

test: setup
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(PY) -m pytest -n 2 --dist loadgroup -q --durations=20 tests

# The GPU tests are mostly compile time, which is CPU work: four processes (pytest-xdist, where installed) share the
# GPU, each allowed a fifth of its memory. The tests check values, not speed: XLA's GEMMs go to cuBLAS without
# autotuning (autotuning and XLA's own Triton GEMMs were most of each program's compile); the Pallas kernels are
# compiled as always.
GPU_WORKERS := 4
GPU_XLA_FLAGS := --xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false
gpu-test: $(if $(filter $(VENV_PY),$(PY)),setup)
	K3JAX_GPU_TESTS=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 XLA_FLAGS="$(GPU_XLA_FLAGS)" $(PY) -m pytest -m gpu -q \
	  --durations=15 $$($(PY) -c "import xdist" 2>/dev/null && echo "-n $(GPU_WORKERS)") $(GPU_TEST_ARGS) tests/gpu
