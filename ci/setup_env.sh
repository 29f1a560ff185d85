#!/usr/bin/env bash
# Create (or reuse) .venv with torch, Horovod built for that torch, and this package.
# Source it or run it; on return .venv is active when sourced. Each step prints one line; what the
# steps print goes to $HVD_SETUP_LOG (default .venv/setup.log), whose last lines show when one fails.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HVD_VENV:-$ROOT/.venv}"
TORCH_SPEC="${HVD_TORCH_SPEC:-torch==2.13.0}"
LOG="${HVD_SETUP_LOG:-$VENV/setup.log}"
mkdir -p "$(dirname "$LOG")"
: >"$LOG"

# step "what it does" command...: one line here, the command's output in $LOG.
step() {
  local what="$1"
  shift
  echo "[setup] $what" >&2
  if ! "$@" >>"$LOG" 2>&1; then
    echo "[setup] failed: $what; the end of $LOG:" >&2
    tail -n 40 "$LOG" >&2
    return 1
  fi
}

if [ ! -x "$VENV/bin/python" ]; then
  step "creating $VENV" python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
step "torch ($TORCH_SPEC)" pip install "$TORCH_SPEC"
# OpenMPI gives Horovod its MPI controller (op="adasum", horovodrun --mpi, mpirun, srun --mpi=pmix);
# Slurm and munge run the batch-job tests on a one-node cluster. Both come from Debian when missing and
# this runs as root; HVD_MPI=no builds Horovod without MPI, HVD_SLURM=no leaves Slurm out (tests skip).
PACKAGES=()
if [ "${HVD_MPI:-auto}" != no ] && ! command -v mpicc >/dev/null 2>&1; then PACKAGES+=(openmpi-bin libopenmpi-dev); fi
if [ "${HVD_SLURM:-auto}" != no ] && ! command -v slurmctld >/dev/null 2>&1; then PACKAGES+=(slurm-wlm munge); fi
# The Horovod build applies its source patches with patch(1).
command -v patch >/dev/null 2>&1 || PACKAGES+=(patch)
apt_install() { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"; }
if [ "${#PACKAGES[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    step "Debian packages: ${PACKAGES[*]}" apt_install "${PACKAGES[@]}" \
      || echo "[setup] ${PACKAGES[*]} did not install: the MPI build and the MPI and Slurm tests are left out" >&2
  else
    echo "[setup] not root: ${PACKAGES[*]} not installed; the MPI build and the MPI and Slurm tests are left out" >&2
  fi
fi
# Build requirements of Horovod's setup.py (it is built without build isolation).
step "Horovod's build requirements" pip install setuptools wheel packaging numpy cloudpickle psutil pyyaml cffi
# The build takes minutes the first time; later runs install the cached wheel.
step "Horovod (a cached wheel, or a build of a few minutes)" bash "$ROOT/ci/install_horovod.sh"
grep "^\[install_horovod\] ok:" "$LOG" | tail -n 1 | sed 's/^\[install_horovod\] ok: /[setup]   /' >&2 || true
step "test and example requirements (ci/requirements.txt)" pip install -r "$ROOT/ci/requirements.txt"
# Another cell than CI's own: HVD_LIGHTNING_VERSION=2.1.4 (both Lightning packages at that version);
# torch before 2.3 was built against numpy 1 and hangs or warns with numpy 2.
EXTRA=()
# (pytorch_lightning before 2.2 imports requests without declaring it)
[ -n "${HVD_LIGHTNING_VERSION:-}" ] && EXTRA+=("lightning==$HVD_LIGHTNING_VERSION" "pytorch-lightning==$HVD_LIGHTNING_VERSION" requests)
python -c 'import sys, torch; v = torch.__version__.split("+")[0].split("."); sys.exit(0 if (int(v[0]), int(v[1])) < (2, 3) else 1)' \
  && EXTRA+=("numpy<2")
if [ "${#EXTRA[@]}" -gt 0 ]; then
  step "this cell: ${EXTRA[*]}" pip install "${EXTRA[@]}"
fi
# compat: a plain path entry (no import finder); setup.py writes the generated pytorch_lightning faces.
step "hvd_plugins (editable)" pip install --no-build-isolation -e "$ROOT" --config-settings editable_mode=compat
# One interpreter checks that everything imports and says what was set up.
python -c 'import sys, hvd_plugins, horovod, horovod.torch, lightning, numpy, sklearn, torch, torchmetrics
print(f"[setup] ready: torch {torch.__version__}, lightning {lightning.__version__}, numpy {numpy.__version__}, "
      f"horovod {horovod.__version__}", file=sys.stderr)' \
  || { echo "[setup] the environment is incomplete (log: $LOG)" >&2; exit 1; }
