#!/usr/bin/env bash
# Fresh machine to passing tests: set up .venv (Horovod build cached), lint, type-check, run the suite.
# Arguments go to pytest: `bash ci/test.sh -m unit` runs the in-process tier only.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck disable=SC1091
source ci/setup_env.sh
ruff check hvd_plugins tests examples benchmarks docs setup.py
python hvd_plugins/mirror.py --check   # the generated pytorch_lightning faces match their source
mypy                                   # pyproject.toml: hvd_plugins, the generated faces included
python -m pytest -q -p no:cacheprovider --timeout=900 --durations=15 "$@"
