#!/usr/bin/env bash
# Fresh machine to passing tests: set up .venv (Horovod build cached), lint, run the suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck disable=SC1091
source ci/setup_env.sh
ruff check hvd_plugins tests examples benchmarks docs setup.py
python -m pytest -q -p no:cacheprovider --timeout=900 --durations=15 "$@"
