#!/usr/bin/env bash
# The main job: ./run.sh [plait arguments]. Sets up .venv on first use.
source "$(dirname "$0")/scripts/env.sh"
cd "$PLAIT_ROOT"
if [ $# -eq 0 ]; then
  set -- bench collectives --hosts 2 --link 1gbit --quick \
    --json reports/bench/collectives.json --plot reports/bench/collectives.png
fi
exec "$PLAIT_ROOT/.venv/bin/python" -m plait "$@"
