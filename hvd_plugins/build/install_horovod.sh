#!/usr/bin/env bash
# Build Horovod 0.28.1 from its source distribution against the torch installed in the
# active Python environment, cache the wheel, install it and check the build.
#
# Horovod's source is changed only by the patch files in patches/ beside this script
# (NNNN-what-it-does.patch, applied in order with `patch -p1`; each one's header says what it
# does, why, its measured effect, whether it is upstreamable and whether it changes runtime
# behaviour). They raise the C++ standard to the one the installed torch needs (C++17, or C++20
# from torch 2.14 on: this script passes it as HOROVOD_CXX_STANDARD), fix Horovod bugs (Gloo
# process sets ignoring HOROVOD_GLOO_IFACE, Finalize leaving process-set contexts open), build
# Gloo's F16C float16 sum, skip an in-place self-copy, make hvd.synchronize sleep instead of
# spinning, and bind horovodrun's services to the job's interface. A patch whose header has
# "Applies-when: gpu=MODE" is applied only to builds of that GPU mode (HVD_GPU below).
#
# The cache key holds a hash of the patch files, so changing, adding or removing one rebuilds.
# Beside the installed horovod/__init__.py the script writes .hvd_plugins_build_key (the cache
# key) and .hvd_plugins_patches (the file names of the patches applied, one per line), which
# hvd_plugins.core.backend.build_marker reads.
#
# A CUDA torch is fine for a CPU-ops build (HVD_GPU=none): Horovod's CMake would otherwise see
# the CUDA torch and insist on building its CUDA parts, so a patch tells it torch has no CUDA.
# NCCL builds compile Horovod's CUDA kernels with nvcc, which must be of the CUDA major version
# torch was built with (CUDA 12 torch + nvcc 13 is refused; auto falls back to CPU ops then).
#
# Environment (all optional):
#   HVD_GPU=auto|nccl|none     NCCL GPU ops; auto = nccl when torch is a CUDA build, nvcc of the
#                              same CUDA major exists and the nvidia-nccl wheel is installed
#   HVD_MPI=auto|yes|no        MPI controller; auto = when mpicc is on PATH
#   HVD_CUDA_ARCHS=90          GPU architectures to compile for (default: 80;90)
#   CUDA_HOME=DIR              CUDA toolkit for NCCL builds (default /usr/local/cuda, else nvcc on PATH)
#   HVD_WHEEL_CACHE=DIR        where built wheels are kept (default ~/.cache/hvd_plugins/wheels)
#   HVD_FORCE_BUILD=1          ignore the cache
#   HVD_PATCHES=0001,0002      apply only these patches (by number); the default is all of them.
#                              A build that leaves some out is cached under its own key.
#   HVD_INSTALL_TARGET=DIR     install into DIR (pip --target) instead of this environment, e.g.
#                              to try a second build beside the first with PYTHONPATH=DIR
#   HVD_SDIST=FILE             build from this horovod-0.28.1.tar.gz instead of downloading it
#                              (machines without a package index); a downloaded one is kept in
#                              the wheel cache folder and used from there next time
set -euo pipefail

HOROVOD_VERSION="0.28.1"
PYTHON="${PYTHON:-python}"
CACHE_DIR="${HVD_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd_plugins/wheels}"
PATCH_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/patches"

log() { echo "[install_horovod] $*" >&2; }
die() { echo "[install_horovod] ERROR: $*" >&2; exit 1; }

ls "$PATCH_DIR"/*.patch >/dev/null 2>&1 || die "no Horovod patches in $PATCH_DIR (an incomplete install of hvd_plugins?)"
# The patches this build applies, in order: all of them, or those HVD_PATCHES names by number.
PATCHES=()
for patch in "$PATCH_DIR"/*.patch; do
  name=$(basename "$patch")
  [ -z "${HVD_PATCHES:-}" ] || [[ ",${HVD_PATCHES// /}," == *",${name%%-*},"* ]] && PATCHES+=("$name")
done
[ "${#PATCHES[@]}" -gt 0 ] || die "HVD_PATCHES=$HVD_PATCHES names none of the patches in $PATCH_DIR"
# The patch set in the cache key: a hash over the patch files' names and contents, in order.
PATCH_SET="patches-$(cd "$PATCH_DIR" && sha256sum -- "${PATCHES[@]}" | sha256sum | cut -c1-10)"
TARGET="${HVD_INSTALL_TARGET:-}"

# Apply the patches that fit this build to the source tree $1, in order, and print their file
# names. "Applies-when: gpu=MODE" in a patch's header limits it to builds of that GPU mode.
apply_patches() {
  local patch name when out
  for name in "${PATCHES[@]}"; do
    patch="$PATCH_DIR/$name"
    when=$(sed -n 's/^Applies-when: *//p' "$patch")
    case "$when" in
      "") ;;
      gpu=*) [ "${when#gpu=}" = "$GPU_MODE" ] || continue ;;
      *) die "$name: 'Applies-when: $when' is not of the form gpu=MODE" ;;
    esac
    out=$(patch -d "$1" -p1 --forward --batch --fuzz=0 --no-backup-if-mismatch -i "$patch" 2>&1) \
      || die "patch $name does not apply to Horovod $HOROVOD_VERSION's source:
$out"
    echo "$name"
  done
}

read -r TORCH_VERSION TORCH_CUDA PY_TAG < <("$PYTHON" - <<'PY'
import sys
try:
    import torch
except ImportError:
    sys.exit("torch is not installed in this environment; install it first (e.g. pip install torch==2.13.0)")
print(torch.__version__.replace("+", "_"), torch.version.cuda or "cpu", f"cp{sys.version_info[0]}{sys.version_info[1]}")
PY
) || die "could not read the torch version"

TORCH_MAJOR_MINOR=$("$PYTHON" -c 'import torch; v=torch.__version__.split("+")[0].split("."); print(int(v[0])*100+int(v[1]))')
if [ "$TORCH_MAJOR_MINOR" -ge 214 ]; then CXX_STD=20; else CXX_STD=17; fi

# --- which controllers and GPU ops --------------------------------------------------------
# The CUDA toolkit a GPU build would use: CUDA_HOME, else /usr/local/cuda, else nvcc's folder.
if [ -n "${CUDA_HOME:-}" ]; then CUDA_ROOT="$CUDA_HOME"
elif [ -x /usr/local/cuda/bin/nvcc ]; then CUDA_ROOT=/usr/local/cuda
elif command -v nvcc >/dev/null 2>&1; then CUDA_ROOT=$(dirname "$(dirname "$(command -v nvcc)")")
else CUDA_ROOT=""
fi
NVCC_CUDA=""
if [ -n "$CUDA_ROOT" ] && [ -x "$CUDA_ROOT/bin/nvcc" ]; then
  NVCC_CUDA=$("$CUDA_ROOT/bin/nvcc" --version | sed -n 's/.*release \([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p')
fi
HAVE_NCCL_WHEEL=no
"$PYTHON" -c 'import nvidia.nccl' 2>/dev/null && HAVE_NCCL_WHEEL=yes

# Why an NCCL build cannot be made here; empty when it can.
nccl_obstacle() {
  if [ "$TORCH_CUDA" = cpu ]; then echo "torch $TORCH_VERSION is a CPU-only build"
  elif [ -z "$NVCC_CUDA" ]; then echo "no nvcc found (set CUDA_HOME to a CUDA $TORCH_CUDA toolkit)"
  elif [ "${NVCC_CUDA%%.*}" != "${TORCH_CUDA%%.*}" ]; then
    echo "nvcc in $CUDA_ROOT is CUDA $NVCC_CUDA but torch $TORCH_VERSION was built with CUDA $TORCH_CUDA (majors differ; set CUDA_HOME to a CUDA ${TORCH_CUDA%%.*}.x toolkit)"
  elif [ "$HAVE_NCCL_WHEEL" = no ]; then echo "the nvidia-nccl wheel is not installed beside torch"
  fi
}

GPU_MODE="${HVD_GPU:-auto}"
case "$GPU_MODE" in
  auto)
    WHY_NOT=$(nccl_obstacle)
    if [ -z "$WHY_NOT" ]; then
      GPU_MODE=nccl
      log "HVD_GPU=auto: NCCL build (torch CUDA $TORCH_CUDA, nvcc CUDA $NVCC_CUDA)"
    else
      GPU_MODE=none
      log "HVD_GPU=auto: CPU-ops build because $WHY_NOT"
    fi ;;
  nccl)
    WHY_NOT=$(nccl_obstacle)
    [ -z "$WHY_NOT" ] || die "HVD_GPU=nccl cannot be built here: $WHY_NOT" ;;
  none) ;;
  *) die "HVD_GPU=$GPU_MODE is not one of: auto, nccl, none" ;;
esac
MPI_MODE="${HVD_MPI:-auto}"
case "$MPI_MODE" in
  auto) if command -v mpicc >/dev/null 2>&1; then MPI_MODE=yes; else MPI_MODE=no; fi ;;
  yes|no) ;;
  *) die "HVD_MPI=$MPI_MODE is not one of: auto, yes, no" ;;
esac
if [ "$MPI_MODE" = yes ] && ! command -v mpicc >/dev/null 2>&1; then
  die "HVD_MPI=yes asked for, but mpicc is not on PATH (install an MPI, e.g. libopenmpi-dev)"
fi
CUDA_ARCHS="${HVD_CUDA_ARCHS:-80;90}"

KEY="horovod${HOROVOD_VERSION}-${PATCH_SET}-torch${TORCH_VERSION}-${PY_TAG}-cxx${CXX_STD}-gpu_${GPU_MODE}-mpi_${MPI_MODE}"
[ "$GPU_MODE" = nccl ] && KEY="${KEY}-cc${CUDA_ARCHS//;/_}"
WHEEL_DIR="$CACHE_DIR/$KEY"

installed_matches() {
  [ -f "$WHEEL_DIR/.key" ] || return 1
  PYTHONPATH="${TARGET:+$TARGET:}${PYTHONPATH:-}" "$PYTHON" - "$WHEEL_DIR" <<'PY' 2>/dev/null
import pathlib, sys
import horovod, horovod.torch  # noqa: F401  (fails when the extension does not load)
here, cached = pathlib.Path(horovod.__file__).parent, pathlib.Path(sys.argv[1])
same = all(
    (here / marker).exists() and (here / marker).read_text() == (cached / record).read_text()
    for marker, record in ((".hvd_plugins_build_key", ".key"), (".hvd_plugins_patches", ".patches"))
)
sys.exit(0 if same else 1)
PY
}

if [ -z "${HVD_FORCE_BUILD:-}" ] && installed_matches; then
  log "Horovod $HOROVOD_VERSION for torch $TORCH_VERSION already installed ($KEY)"
else
  if [ -n "${HVD_FORCE_BUILD:-}" ] || ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1 \
      || [ ! -f "$WHEEL_DIR/.patches" ]; then
    log "building Horovod $HOROVOD_VERSION for torch $TORCH_VERSION (C++$CXX_STD, gpu=$GPU_MODE, mpi=$MPI_MODE); this takes several minutes"
    WORK=$(mktemp -d)
    trap 'rm -rf "$WORK"' EXIT
    command -v patch >/dev/null 2>&1 || die "the patch command is missing (e.g. apt-get install patch)"
    SDIST_CACHED="$CACHE_DIR/horovod-$HOROVOD_VERSION.tar.gz"
    SDIST_FROM="a download"
    if [ -n "${HVD_SDIST:-}" ]; then
      [ -f "$HVD_SDIST" ] || die "HVD_SDIST=$HVD_SDIST is not a file"
      cp "$HVD_SDIST" "$WORK/horovod-$HOROVOD_VERSION.tar.gz"; SDIST_FROM="$HVD_SDIST"
    elif [ -f "$SDIST_CACHED" ]; then
      cp "$SDIST_CACHED" "$WORK/horovod-$HOROVOD_VERSION.tar.gz"; SDIST_FROM="$SDIST_CACHED (delete it to download it again)"
    else
      "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$WORK"
      mkdir -p "$CACHE_DIR"
      cp "$WORK/horovod-$HOROVOD_VERSION.tar.gz" "$SDIST_CACHED.tmp$$" && mv "$SDIST_CACHED.tmp$$" "$SDIST_CACHED"
    fi
    tar -xzf "$WORK/horovod-$HOROVOD_VERSION.tar.gz" -C "$WORK" \
      || die "cannot extract Horovod's source from $SDIST_FROM"
    SRC="$WORK/horovod-$HOROVOD_VERSION"

    apply_patches "$SRC" > "$WORK/applied_patches"
    log "patched the source ($PATCH_SET): $(tr '\n' ' ' < "$WORK/applied_patches")"

    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_GLOO=1
    export HOROVOD_CXX_STANDARD="$CXX_STD"   # read by the CMakeLists.txt of patch 0001
    # CMake 4 refuses projects that ask for CMake < 3.5, as Horovod's copy of Gloo does
    # (cmake_minimum_required 2.8.12); this lets them configure with 3.5's policies. CMake 3
    # ignores the variable, so builds that worked there are unchanged.
    export CMAKE_POLICY_VERSION_MINIMUM="${CMAKE_POLICY_VERSION_MINIMUM:-3.5}"
    export MAKEFLAGS="-j$(nproc)" HOROVOD_BUILD_PARALLEL="$(nproc)"
    if [ "$MPI_MODE" = yes ]; then export HOROVOD_WITH_MPI=1; else export HOROVOD_WITHOUT_MPI=1; fi
    if [ "$GPU_MODE" = nccl ]; then
      # The nvidia-nccl wheel's header and library (their folders differ between CUDA 12 and 13 wheels).
      read -r NCCL_HEADER NCCL_LIBRARY < <("$PYTHON" - <<'PY'
import pathlib, nvidia.nccl
roots = [pathlib.Path(p) for p in nvidia.nccl.__path__]
def first(name):
    return next((str(f) for root in roots for f in sorted(root.rglob(name))), "")
print(first("nccl.h") or "-", first("libnccl.so.2") or "-")
PY
) || die "GPU build asked for but the nvidia-nccl wheel is not installed beside torch"
      [ "$NCCL_HEADER" != - ] && [ "$NCCL_LIBRARY" != - ] \
        || die "the nvidia-nccl wheel has no nccl.h or libnccl.so.2 (found: $NCCL_HEADER $NCCL_LIBRARY)"
      NCCL_LINKS="$WORK/nccl_lib"; mkdir -p "$NCCL_LINKS"
      ln -sf "$NCCL_LIBRARY" "$NCCL_LINKS/libnccl.so"
      export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=SHARED \
        HOROVOD_NCCL_INCLUDE="$(dirname "$NCCL_HEADER")" HOROVOD_NCCL_LIB="$NCCL_LINKS" \
        HOROVOD_CUDA_HOME="$CUDA_ROOT" HOROVOD_BUILD_CUDA_CC_LIST="${CUDA_ARCHS//;/,}"
      export PATH="$CUDA_ROOT/bin:$PATH"   # Horovod asks the nvcc on PATH for its flags
    fi
    mkdir -p "$WHEEL_DIR"
    rm -f "$WHEEL_DIR"/horovod-*.whl
    cp "$WORK/applied_patches" "$WHEEL_DIR/.patches"
    "$PYTHON" -m pip wheel --no-build-isolation --no-deps -w "$WHEEL_DIR" "$SRC" \
      > "$WHEEL_DIR/build.log" 2>&1 || { tail -n 60 "$WHEEL_DIR/build.log" >&2; die "Horovod build failed (log above; all of it in $WHEEL_DIR/build.log)"; }
  else
    log "using cached wheel $WHEEL_DIR"
  fi
  echo "$KEY" > "$WHEEL_DIR/.key"
  if [ -n "$TARGET" ]; then
    "$PYTHON" -m pip install --quiet --no-deps --upgrade --target "$TARGET" "$WHEEL_DIR"/horovod-*.whl
  else
    "$PYTHON" -m pip install --quiet --no-deps --force-reinstall "$WHEEL_DIR"/horovod-*.whl
  fi
  # horovod's own run-time dependencies (its wheel is installed without them so pip never
  # tries to rebuild it from source)
  "$PYTHON" -m pip install --quiet cloudpickle psutil pyyaml packaging cffi
  # What this build is, beside horovod/__init__.py: its cache key and the patches applied.
  PYTHONPATH="${TARGET:+$TARGET:}${PYTHONPATH:-}" "$PYTHON" - "$WHEEL_DIR" <<'PY'
import pathlib, sys
import horovod
here, cached = pathlib.Path(horovod.__file__).parent, pathlib.Path(sys.argv[1])
(here / ".hvd_plugins_build_key").write_text((cached / ".key").read_text())
(here / ".hvd_plugins_patches").write_text((cached / ".patches").read_text())
PY
fi

if [ -n "$TARGET" ]; then
  PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -c 'import horovod.torch' \
    || die "the Horovod installed in $TARGET does not load"
  log "ok: Horovod $HOROVOD_VERSION ($KEY) in $TARGET; use it with PYTHONPATH=$TARGET"
  exit 0
fi
# The horovodrun of this interpreter's environment (activated or not).
HOROVODRUN="$("$PYTHON" -c 'import os, sys; print(os.path.join(os.path.dirname(sys.executable), "horovodrun"))')"
[ -x "$HOROVODRUN" ] || HOROVODRUN=horovodrun
CHECK=$("$HOROVODRUN" --check-build 2>&1) || die "horovodrun --check-build failed: $CHECK"
echo "$CHECK" | grep -q "\[X\] PyTorch" || die "Horovod was built without PyTorch support:
$CHECK"
if [ "$GPU_MODE" = nccl ]; then
  echo "$CHECK" | grep -q "\[X\] NCCL" || die "Horovod was built without NCCL although it was asked for:
$CHECK"
fi
log "ok: $(echo "$CHECK" | tr '\n' ' ' | sed 's/  */ /g')"
