#!/usr/bin/env bash
# Create or reuse .venv in the repository and install plait with what it needs.
# Sourced by run.sh and test.sh, so a fresh clone on a fresh machine needs nothing by hand.
set -euo pipefail
PLAIT_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PLAIT_TORCH_VERSION=2.13.0

# Which torch to install, as one pip argument; says which on stderr, in one line.
# PLAIT_TORCH picks one by hand (e.g. a CUDA wheel). With a GPU: PyPI's build (CUDA). Without
# one: the CPU build where a wheel of it lies on this disk, in PLAIT_WHEELS, PIP_FIND_LINKS or
# pip's find-links (root's pip configuration names it; another user's does not, and PyPI only
# has the CUDA build, several GB); else PyPI's build, and it says what that costs.
plait_torch_choice() {
  local py=$1 want="torch==$PLAIT_TORCH_VERSION" tag dir whl
  if [ -n "${PLAIT_TORCH:-}" ]; then
    echo "plait: installing torch as PLAIT_TORCH says: $PLAIT_TORCH" >&2
    echo "$PLAIT_TORCH"
    return
  fi
  if [ -e /dev/nvidia0 ] || { command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; }
  then
    echo "plait: a GPU is here: installing torch $PLAIT_TORCH_VERSION from PyPI (CUDA build)" >&2
    echo "$want"
    return
  fi
  tag=$("$py" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
  for dir in ${PLAIT_WHEELS:-} ${PIP_FIND_LINKS:-} \
             $("$py" -m pip config get global.find-links 2>/dev/null || true) /opt/wheels; do
    dir=${dir#file://}
    for whl in "$dir"/torch-"$PLAIT_TORCH_VERSION"+cpu-"$tag"-*.whl; do
      if [ -f "$whl" ]; then
        echo "plait: no GPU here: installing torch's CPU build from $whl" >&2
        echo "$whl"
        return
      fi
    done
  done
  echo "plait: no GPU here, but no CPU wheel of torch $PLAIT_TORCH_VERSION for $tag on this" \
       "disk (PLAIT_WHEELS=DIR names one): installing PyPI's build, CUDA, several GB" >&2
  echo "$want"
}

venv="$PLAIT_ROOT/.venv"
if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
py="$venv/bin/python"
stamp="$venv/.plait-installed"
want=$(cat "$PLAIT_ROOT/pyproject.toml" "$PLAIT_ROOT/scripts/env.sh" | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # torch first and pinned: a looser range would pull the newest CUDA build, several GB.
  if ! "$py" -c "import torch" 2>/dev/null; then
    torch=$(plait_torch_choice "$py")
    "$py" -m pip install -q "$torch" 2> >(grep -v "^WARNING: Location" >&2)
  fi
  "$py" -m pip install -q -e "$PLAIT_ROOT[test]" 2> >(grep -v "^WARNING: Location" >&2)
  echo "$want" > "$stamp"
fi
export PLAIT_ROOT
