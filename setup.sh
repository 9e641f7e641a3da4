#!/usr/bin/env bash
# Installs everything arvdm needs on a fresh Debian/Ubuntu machine (or a container) into the active Python:
#   - Debian's libosmesa6: MuJoCo's software renderer, so Memory Maze renders on a CPU (MUJOCO_GL=osmesa)
#   - torch 2.14.1 + torchvision 0.29.1 (pinned: the release this project is tested with)
#   - this package in editable mode with the environments (memory-maze, crafter) and the test tools
# Use a virtual environment first if you want one:  python -m venv .venv && . .venv/bin/activate
set -euo pipefail
cd "$(dirname "$0")"

if ! ldconfig -p 2>/dev/null | grep -q libOSMesa; then
  echo "[setup] installing Debian's libosmesa6 (software OpenGL for MuJoCo)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libosmesa6 >/dev/null
fi

PY="${PYTHON:-python}"
echo "[setup] pip install torch==2.14.1 torchvision==0.29.1 -e .[envs,dev]"
"$PY" -m pip install -q torch==2.14.1 torchvision==0.29.1 -e ".[envs,dev]"
"$PY" - <<'PY'
import torch, diffusers, triton
print(f"[setup] ok: torch {torch.__version__}, diffusers {diffusers.__version__}, triton {triton.__version__}, "
      f"cuda={'yes' if torch.cuda.is_available() else 'no'}")
PY
