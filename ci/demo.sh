#!/usr/bin/env bash
# Fresh machine to a real distributed run: 2 Horovod workers train a digits classifier with
# fp16 gradient compression and print the validation accuracy.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck disable=SC1091
source ci/setup_env.sh
horovodrun -np 2 -H localhost:2 --gloo python examples/digits.py --compression fp16 --epochs 15 "$@"
