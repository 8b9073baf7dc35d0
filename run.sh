#!/usr/bin/env bash
# The main job: ./run.sh [plait arguments]. Sets up .venv on first use.
source "$(dirname "$0")/scripts/env.sh"
cd "$PLAIT_ROOT"
if [ $# -eq 0 ]; then
  set -- demo
fi
exec "$PLAIT_ROOT/.venv/bin/python" -m plait "$@"
