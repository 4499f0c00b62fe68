#!/usr/bin/env bash
# Creates .venv at the repo root with a Python >= 3.12 and installs k3jax into it (editable).
# Idempotent: reinstalls only when setup.cfg changes. K3JAX_PYTHON overrides the interpreter,
# K3JAX_EXTRAS the extras (default: test, plus gpu when nvidia-smi is present).
set -euo pipefail
cd "$(dirname "$0")/.."

is_new_enough() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; }

find_python() {
  local c
  for c in "${K3JAX_PYTHON:-}" python3.13 python3.12 python3 python; do
    [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && is_new_enough "$c" && { command -v "$c"; return; }
  done
  local roots=()
  command -v pyenv >/dev/null 2>&1 && roots+=("$(pyenv root)")
  roots+=("$HOME/.pyenv" /root/.pyenv)
  for r in "${roots[@]}"; do
    for c in $(ls -d "$r"/versions/3.1[2-9]*/bin/python3 2>/dev/null | sort -rV); do
      is_new_enough "$c" && { echo "$c"; return; }
    done
  done
  return 1
}

if [ ! -x .venv/bin/python ] || ! is_new_enough .venv/bin/python; then
  py=$(find_python) || { echo "k3jax needs Python >= 3.12; none found (set K3JAX_PYTHON=/path/to/python3.12)" >&2; exit 1; }
  echo "[setup] creating .venv with $py ($("$py" --version))"
  rm -rf .venv
  "$py" -m venv .venv
fi

extras=${K3JAX_EXTRAS:-test}
if [ -z "${K3JAX_EXTRAS:-}" ] && command -v nvidia-smi >/dev/null 2>&1; then extras="test,gpu"; fi
stamp=".venv/.k3jax-installed"
want="$(cat setup.cfg | sha1sum | cut -c1-40) $extras"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing k3jax[$extras] into .venv"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[$extras]"
  echo "$want" > "$stamp"
fi
