# The two commands of the README: `make run` (the main job) and `make test` (the test suite).
# Both create .venv with a Python >= 3.12 and install k3jax first (scripts/setup.sh).
PY := .venv/bin/python

.PHONY: setup run test
setup:
	@scripts/setup.sh

run: setup
	$(PY) -m experiments.train --config=experiments/configs/tiny.py --workdir=runs/tiny

test: setup
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(PY) -m pytest -n 2 --dist loadgroup -q --durations=20 tests
