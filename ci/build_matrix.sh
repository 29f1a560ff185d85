#!/usr/bin/env bash
# Build Horovod with ci/install_horovod.sh for several (torch, Python, GPU mode, Lightning)
# combinations, train the digits example on 2 Gloo workers and run the suite's core multi-process
# jobs with each; print one table row per combination.
#
# Each row gets a throw-away venv and a throw-away wheel cache, so every build is a cold one:
#   1. venv from the requested Python, torch==VERSION, the packages of ci/requirements.txt
#   2. build + install Horovod (timed: "build min"), with HVD_GPU set to the row's GPU mode
#   3. uninstall Horovod and install it again from the row's wheel cache (timed: "cached min")
#   4. horovodrun -np 2 --gloo examples/digits.py for a few epochs ("smoke"), then the core
#      multi-process tests (tests/test_strategy_multiprocess.py and tests/test_fabric.py)
# Rows run one after another (a build uses every core), and the venv is deleted after its row.
# This takes 10-15 minutes per row on 2 cores; it is run by hand, not by CI.
#
#   bash ci/build_matrix.sh                          # the default rows (several hours)
#   bash ci/build_matrix.sh 2.4.1:3.10:none 2.15.0:3.12:auto
#   bash ci/build_matrix.sh --workdir /scratch/m --keep 2.11.0:3.11:none
#
# A row is TORCH:PYTHON:GPU[:LIGHTNING]. TORCH is an exact torch version ("latest" = the newest the
# package index offers); PYTHON is a major.minor found as pythonX.Y on PATH or under pyenv; GPU is
# none, nccl or auto (what ci/install_horovod.sh picks by itself; the table shows the result);
# LIGHTNING an exact version of both Lightning packages (default: ci/requirements.txt's pin).
# torch before 2.3 gets numpy<2 (it was built against numpy 1).
# Options: --workdir DIR (default: a new folder under /tmp), --keep (keep venvs and wheels; a
# later run with the same --workdir reuses a row's venv when its torch matches),
# --row-timeout MIN (default 40: a row taking longer is stopped and reported as failed).
# Results are also appended to <workdir>/matrix.tsv; per-row logs are in <workdir>/<row>/.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The rows import the package from the tree (PYTHONPATH), not from an install: write its generated
# pytorch_lightning faces there first (hvd_plugins/mirror.py needs only the standard library).
python3 "$ROOT/hvd_plugins/mirror.py" >/dev/null || { echo "hvd_plugins/mirror.py failed" >&2; exit 1; }
DEFAULT_TORCH=(2.1.2 2.2.2 2.3.1 2.4.1 2.5.1 2.6.0 2.7.1 2.8.0 2.9.1 2.10.0 2.11.0 2.12.0 2.13.0 2.14.1 latest)
DEFAULT_PYTHON=(3.10 3.11 3.12)
DEFAULT_GPU=(none auto)
SMOKE_EPOCHS=2

WORKDIR=""
KEEP=0
ROW_TIMEOUT_MIN=40
ROWS=()

die() { echo "[build_matrix] ERROR: $*" >&2; exit 2; }
log() { echo "[build_matrix] $*" >&2; }

RUN_ROW=""
while [ $# -gt 0 ]; do
  case "$1" in
    --run-row) RUN_ROW="$2"; shift 2 ;;   # internal: one row, in its own process group
    --workdir) [ $# -ge 2 ] || die "--workdir needs a folder"; WORKDIR="$2"; shift 2 ;;
    --keep) KEEP=1; shift ;;
    --row-timeout)
      [[ "${2:-}" =~ ^[1-9][0-9]*$ ]] || die "--row-timeout needs whole minutes > 0, got '${2:-}'"
      ROW_TIMEOUT_MIN="$2"; shift 2 ;;
    -h|--help) sed -n '2,/^set -uo/{/^set/!p}' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option '$1' (allowed: --workdir DIR, --keep, --row-timeout MIN)" ;;
    *)
      [[ "$1" =~ ^(latest|[0-9]+\.[0-9]+\.[0-9]+(\+[a-z0-9]+)?):3\.[0-9]+:(none|nccl|auto)(:[0-9]+\.[0-9]+\.[0-9]+)?$ ]] \
        || die "row '$1' is not TORCH:PYTHON:GPU[:LIGHTNING] (e.g. 2.4.1:3.10:none:2.3.3; GPU one of none, nccl, auto)"
      ROWS+=("$1"); shift ;;
  esac
done
if [ ${#ROWS[@]} -eq 0 ]; then
  for t in "${DEFAULT_TORCH[@]}"; do for p in "${DEFAULT_PYTHON[@]}"; do for g in "${DEFAULT_GPU[@]}"; do
    ROWS+=("$t:$p:$g")
  done; done; done
fi
[ -n "$WORKDIR" ] || WORKDIR=$(mktemp -d /tmp/hvd_build_matrix.XXXXXX)
mkdir -p "$WORKDIR" || die "cannot create --workdir $WORKDIR"
WORKDIR="$(cd "$WORKDIR" && pwd)"
TABLE="$WORKDIR/matrix.tsv"

# The interpreter for a major.minor: pythonX.Y on PATH, else the newest pyenv install of it.
find_python() {
  local want="$1" found
  found=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}/versions/$want".*/bin/python 2>/dev/null | sort -V | tail -n 1)
  [ -n "$found" ] || found=$(command -v "python$want" 2>/dev/null)
  # a pyenv shim exists for every version but runs only the selected ones
  [ -n "$found" ] && "$found" -c 'import sys' >/dev/null 2>&1 && echo "$found"
}

# The newest torch release the package index offers to this Python.
latest_torch() {
  "$1" -m pip index versions torch 2>/dev/null | sed -n 's/^torch (\([^)]*\)).*/\1/p'
}

minutes() { awk -v s="$1" 'BEGIN { printf "%.1f", s / 60 }'; }

# Last line of a log that says what went wrong, shortened for the table.
reason_from() {
  grep -E "ERROR|Error|error:|FAILED|Traceback|No matching" "$1" 2>/dev/null | grep -v "^WARNING" \
    | tail -n 1 | sed 's/^\[[a-z_]*\] //' | cut -c 1-160
}

print_row() {  # torch python gpu build cached smoke reason (LIGHTNING is set by run_row)
  printf "%-16s %-7s %-12s %-9s %-9s %-10s %-6s %s\n" "$1" "$2" "$3" "${LIGHTNING:-pin}" "$4" "$5" "$6" "$7"
}

# One row; prints its table line. Runs in a subshell so a failure never stops the matrix.
run_row() {
  local spec="$1" torch py gpu name dir venv python_bin t0 build_s cached_s picked reason cell=()
  IFS=: read -r torch py gpu LIGHTNING <<<"$spec"
  python_bin=$(find_python "$py") || true
  if [ -z "$python_bin" ]; then print_row "$torch" "$py" "$gpu" - - fail "no python$py on PATH or under pyenv"; return; fi
  if [ "$torch" = latest ]; then
    torch=$(latest_torch "$python_bin")
    [ -n "$torch" ] || { print_row latest "$py" "$gpu" - - fail "could not ask the package index for torch versions"; return; }
  fi
  name="torch${torch}-py${py}-${gpu}${LIGHTNING:+-lightning$LIGHTNING}"
  [ -n "$LIGHTNING" ] && cell+=("lightning==$LIGHTNING" "pytorch-lightning==$LIGHTNING" requests)
  [[ "$torch" =~ ^2\.[12]\. ]] && cell+=("numpy<2")
  dir="$WORKDIR/$name"; venv="$dir/venv"
  # 1. environment (Lightning 2.6 from ci/requirements.txt supports torch >= 2.1); a venv kept by
  # --keep with the same torch is reused, without Horovod, to skip the multi-GB download
  if [ "$("$venv/bin/python" -c 'import torch, lightning; print(torch.__version__)' 2>/dev/null)" = "$torch" ] \
     || [ "$("$venv/bin/python" -c 'import torch, lightning; print(torch.__version__.split("+")[0])' 2>/dev/null)" = "$torch" ]; then
    log "row $name: reusing $venv"
    "$venv/bin/pip" uninstall --quiet --yes horovod > /dev/null 2>&1
    find "$dir" -mindepth 1 -maxdepth 1 ! -name venv -exec rm -rf {} +
  else
    rm -rf "$dir"; mkdir -p "$dir"
    log "row $name: venv + torch==$torch"
  fi
  if ! { "$python_bin" -m venv "$venv" \
        && "$venv/bin/pip" install --quiet --disable-pip-version-check "torch==$torch" \
             setuptools wheel packaging numpy cloudpickle psutil pyyaml cffi \
        && "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$ROOT/ci/requirements.txt" \
             "torch==$torch" \
        && { [ ${#cell[@]} -eq 0 ] || "$venv/bin/pip" install --quiet --disable-pip-version-check "${cell[@]}" \
             "torch==$torch"; }; } > "$dir/env.log" 2>&1; then
    print_row "$torch" "$py" "$gpu" - - fail "environment: $(reason_from "$dir/env.log")"; return
  fi

  # 2. cold build into this row's own wheel cache
  export PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv" HVD_WHEEL_CACHE="$dir/wheels" HVD_GPU="$gpu"
  unset HVD_FORCE_BUILD
  t0=$(date +%s)
  if ! nice -n 19 bash "$ROOT/ci/install_horovod.sh" > "$dir/build.log" 2>&1; then
    print_row "$torch" "$py" "$gpu" "$(minutes $(( $(date +%s) - t0 )))" - fail "build: $(reason_from "$dir/build.log")"
    return
  fi
  build_s=$(( $(date +%s) - t0 ))
  picked=$(sed -n 's/.*HVD_GPU=auto: \(NCCL\|CPU-ops\) build.*/\1/p' "$dir/build.log" | head -n 1)
  [ "$gpu" = auto ] && gpu="auto:$( [ "$picked" = NCCL ] && echo nccl || echo none)"

  # 3. reinstall from the cache, as a second venv with the same torch would
  pip uninstall --quiet --yes horovod > /dev/null 2>&1
  t0=$(date +%s)
  if ! nice -n 19 bash "$ROOT/ci/install_horovod.sh" > "$dir/cached.log" 2>&1 \
       || ! grep -q "using cached wheel" "$dir/cached.log"; then
    print_row "$torch" "$py" "$gpu" "$(minutes "$build_s")" - fail "cached reinstall: $(reason_from "$dir/cached.log")"
    return
  fi
  cached_s=$(( $(date +%s) - t0 ))

  # 4. two Gloo workers train the digits classifier
  if (cd "$dir" && PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" nice -n 19 timeout 600 \
        horovodrun -np 2 -H localhost:2 --gloo python "$ROOT/examples/digits.py" \
        --epochs "$SMOKE_EPOCHS" --no-progress-bar --out-dir "$dir/run") > "$dir/smoke.log" 2>&1 \
     && grep -q "validation accuracy:" "$dir/smoke.log"; then
    reason="$(grep -o "validation accuracy: [0-9.]*" "$dir/smoke.log" | tail -n 1)"
  else
    print_row "$torch" "$py" "$gpu" "$(minutes "$build_s")" "$(minutes "$cached_s")" fail "smoke: $(reason_from "$dir/smoke.log")"
    return
  fi
  # 5. the suite's core multi-process jobs
  if (cd "$ROOT" && PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" nice -n 19 timeout 1800 \
        python -m pytest -q -p no:cacheprovider --timeout=900 tests/test_strategy_multiprocess.py tests/test_fabric.py) \
        > "$dir/core.log" 2>&1; then
    print_row "$torch" "$py" "$gpu" "$(minutes "$build_s")" "$(minutes "$cached_s")" pass \
      "$reason; $(tail -n 1 "$dir/core.log" | sed 's/=//g; s/^ *//')"
  else
    print_row "$torch" "$py" "$gpu" "$(minutes "$build_s")" "$(minutes "$cached_s")" fail "core jobs: $(reason_from "$dir/core.log")"
  fi
}

if [ -n "$RUN_ROW" ]; then run_row "$RUN_ROW"; exit 0; fi

log "workdir $WORKDIR, ${#ROWS[@]} row(s), at most $ROW_TIMEOUT_MIN min each"
HEADER=$(LIGHTNING=lightning print_row torch python gpu "build min" "cached min" result "digits accuracy; core jobs / failure reason")
echo "$HEADER"
[ -f "$TABLE" ] || echo "$HEADER" > "$TABLE"
FAILED=0
for spec in "${ROWS[@]}"; do
  ROW_OUT="$WORKDIR/.row_out"
  # timeout runs the row in a process group of its own and stops all of it (pip, cmake, workers)
  timeout --kill-after=30 "$(( ROW_TIMEOUT_MIN * 60 ))" bash "${BASH_SOURCE[0]}" --run-row "$spec" \
    --workdir "$WORKDIR" > "$ROW_OUT"
  rc=$?
  if [ ! -s "$ROW_OUT" ]; then
    IFS=: read -r t p g <<<"$spec"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then why="stopped after $ROW_TIMEOUT_MIN min (--row-timeout)"; else why="row script exited with $rc"; fi
    print_row "$t" "$p" "$g" - - fail "$why" > "$ROW_OUT"
  fi
  cat "$ROW_OUT" | tee -a "$TABLE"
  grep -q " pass " "$ROW_OUT" || FAILED=$((FAILED + 1))
  if [ "$KEEP" -eq 0 ]; then
    find "$WORKDIR" -mindepth 2 -maxdepth 2 -name venv -type d -exec rm -rf {} + 2>/dev/null
    find "$WORKDIR" -mindepth 2 -maxdepth 2 -name wheels -type d -exec rm -rf {} + 2>/dev/null
  fi
done
rm -f "$WORKDIR/.row_out"
log "table: $TABLE (logs per row beside it); $FAILED of ${#ROWS[@]} row(s) failed"
[ "$FAILED" -eq 0 ]
