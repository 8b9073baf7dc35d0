#!/usr/bin/env bash
# Create or reuse .venv in the repository and install plait with what it needs.
# Sourced by run.sh and test.sh, so a fresh clone on a fresh machine needs nothing by hand.
set -euo pipefail
PLAIT_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$PLAIT_ROOT/.venv"
if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
py="$venv/bin/python"
stamp="$venv/.plait-installed"
want=$(cat "$PLAIT_ROOT/pyproject.toml" "$PLAIT_ROOT/scripts/env.sh" | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # torch first and pinned: 2.13.0 is the CPU build this machine carries on disk; a looser
  # range would pull a CUDA build of several GB. PLAIT_TORCH picks another (e.g. a CUDA wheel).
  if ! "$py" -c "import torch" 2>/dev/null; then
    "$py" -m pip install -q "${PLAIT_TORCH:-torch==2.13.0}" 2> >(grep -v "^WARNING: Location" >&2)
  fi
  "$py" -m pip install -q -e "$PLAIT_ROOT[test]" 2> >(grep -v "^WARNING: Location" >&2)
  echo "$want" > "$stamp"
fi
export PLAIT_ROOT
