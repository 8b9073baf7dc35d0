#!/usr/bin/env bash
# The test suite: ./test.sh [pytest arguments]. Sets up .venv on first use.
source "$(dirname "$0")/scripts/env.sh"
cd "$PLAIT_ROOT"
exec "$PLAIT_ROOT/.venv/bin/python" -m pytest -q "$@"
