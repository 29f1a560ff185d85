#!/usr/bin/env bash
# Build Horovod 0.28.1 from its source distribution against the torch installed in the
# active Python environment, cache the wheel, install it and check the build.
#
# Horovod's last release asks for C++14, which current torch headers reject (they need
# C++17, and C++20 from torch 2.14 on). This script raises the standard to match the
# installed torch. It also fixes a Horovod bug where Gloo contexts of process sets ignore
# HOROVOD_GLOO_IFACE (they resolve the host name instead), which breaks multi-host Gloo
# jobs whose host names resolve to 127.0.0.1. And it lets Gloo add float16 with the CPU's
# F16C/AVX instructions wherever Horovod itself is compiled with them (Gloo's portable float16
# sum converts every element in software: a float16 allreduce took 3.4x as long as a float32
# one of the same elements on x86).
#
# A CUDA torch is fine for a CPU-ops build (HVD_GPU=none): Horovod's CMake would otherwise see
# the CUDA torch and insist on building its CUDA parts, so the script tells it torch has no CUDA.
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
#   HVD_SDIST=FILE             build from this horovod-0.28.1.tar.gz instead of downloading it
#                              (machines without a package index)
set -euo pipefail

HOROVOD_VERSION="0.28.1"
PATCH_LEVEL="p6"   # bump when the source patches below change
PYTHON="${PYTHON:-python}"
CACHE_DIR="${HVD_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd_plugins/wheels}"

log() { echo "[install_horovod] $*" >&2; }
die() { echo "[install_horovod] ERROR: $*" >&2; exit 1; }

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

KEY="horovod${HOROVOD_VERSION}-${PATCH_LEVEL}-torch${TORCH_VERSION}-${PY_TAG}-cxx${CXX_STD}-gpu_${GPU_MODE}-mpi_${MPI_MODE}"
[ "$GPU_MODE" = nccl ] && KEY="${KEY}-cc${CUDA_ARCHS//;/_}"
WHEEL_DIR="$CACHE_DIR/$KEY"

installed_matches() {
  [ -f "$WHEEL_DIR/.key" ] || return 1
  "$PYTHON" - "$WHEEL_DIR" <<'PY' 2>/dev/null
import pathlib, sys
import horovod, horovod.torch  # noqa: F401  (fails when the extension does not load)
marker = pathlib.Path(horovod.__file__).with_name(".hvd_plugins_build_key")
want = (pathlib.Path(sys.argv[1]) / ".key").read_text()
sys.exit(0 if marker.exists() and marker.read_text() == want else 1)
PY
}

if [ -z "${HVD_FORCE_BUILD:-}" ] && installed_matches; then
  log "Horovod $HOROVOD_VERSION for torch $TORCH_VERSION already installed ($KEY)"
else
  if [ -n "${HVD_FORCE_BUILD:-}" ] || ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
    log "building Horovod $HOROVOD_VERSION for torch $TORCH_VERSION (C++$CXX_STD, gpu=$GPU_MODE, mpi=$MPI_MODE); this takes several minutes"
    WORK=$(mktemp -d)
    trap 'rm -rf "$WORK"' EXIT
    if [ -n "${HVD_SDIST:-}" ]; then
      [ -f "$HVD_SDIST" ] || die "HVD_SDIST=$HVD_SDIST is not a file"
      cp "$HVD_SDIST" "$WORK/horovod-$HOROVOD_VERSION.tar.gz"
    else
      "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$WORK"
    fi
    tar -xzf "$WORK/horovod-$HOROVOD_VERSION.tar.gz" -C "$WORK"
    SRC="$WORK/horovod-$HOROVOD_VERSION"

    # C++ standard demanded by the torch headers.
    sed -i "s/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD $CXX_STD)/" \
      "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
    grep -q "CMAKE_CXX_STANDARD $CXX_STD" "$SRC/horovod/torch/CMakeLists.txt" \
      || die "could not raise the C++ standard in horovod/torch/CMakeLists.txt"

    if [ "$GPU_MODE" = none ]; then
      # Horovod adds its CUDA parts whenever torch is a CUDA build; a CPU-ops build must not
      # (no-op for a CPU torch, so CPU-torch wheels are unchanged).
      "$PYTHON" - "$SRC/cmake/Modules/FindPytorch.cmake" <<'PY'
import pathlib, sys
path = pathlib.Path(sys.argv[1])
text = path.read_text()
old = 'string(TOUPPER "${Pytorch_CUDA}" Pytorch_CUDA)\n'
if text.count(old) != 1:
    sys.exit("FindPytorch.cmake does not look as expected; cannot turn off torch's CUDA detection")
path.write_text(text.replace(old, old + "set(Pytorch_CUDA FALSE)  # CPU-ops build of a CUDA torch\n"))
PY
    fi

    # Gloo's vectorized float16 sum where Horovod already compiles with F16C and AVX (its own
    # check of the build machine's compiler, so never on other architectures): Gloo keeps it in
    # gloo/math.cc behind GLOO_USE_AVX, but Horovod's copy of Gloo leaves math.cc out of the
    # build and no source includes the config.h that would define the macro.
    "$PYTHON" - "$SRC" <<'PY'
import pathlib, sys
src = pathlib.Path(sys.argv[1])
edits = [
    (src / "CMakeLists.txt", 'set_build_arch_flags("${ARCH_FLAGS}")\n',
     'if("${HOROVOD_BUILD_ARCH_FLAGS}" MATCHES "-mf16c" AND "${HOROVOD_BUILD_ARCH_FLAGS}" MATCHES "-mavx")\n'
     '    add_definitions(-DGLOO_USE_AVX=1)  # read by gloo/math.h, in Gloo and in Horovod alike\n'
     'endif()\n'),
    (src / "third_party/gloo/gloo/CMakeLists.txt", '  "${CMAKE_CURRENT_SOURCE_DIR}/types.cc"\n',
     '  "${CMAKE_CURRENT_SOURCE_DIR}/math.cc"\n'),
]
for path, anchor, addition in edits:
    text = path.read_text()
    if text.count(anchor) != 1:
        sys.exit(f"{path.name} does not look as expected; cannot turn on Gloo's F16C float16 sum")
    path.write_text(text.replace(anchor, anchor + addition))
PY

    # An in-place allreduce of one tensor (what DistributedOptimizer's hooks send when a gradient
    # fills the fusion buffer alone) copied the tensor onto itself before reducing: one extra pass
    # over every byte, and memcpy's undefined behaviour for overlapping memory. Copy only when the
    # output is another tensor.
    "$PYTHON" - "$SRC/horovod/common/ops/gloo_operations.cc" <<'PY'
import pathlib, sys
path = pathlib.Path(sys.argv[1])
text = path.read_text()
old = """    buffer_data = (void*)first_entry.output->data();
    std::memcpy(buffer_data, first_entry.tensor->data(),
                (size_t)first_entry.tensor->size());
    fused_input_data = buffer_data;"""
new = """    buffer_data = (void*)first_entry.output->data();
    if (buffer_data != first_entry.tensor->data()) {
      std::memcpy(buffer_data, first_entry.tensor->data(),
                  (size_t)first_entry.tensor->size());
    }
    fused_input_data = buffer_data;"""
if text.count(old) != 1:
    sys.exit("gloo_operations.cc does not look as expected; cannot skip the in-place self-copy")
path.write_text(text.replace(old, new))
PY

    # hvd.synchronize (behind every blocking hvd.allreduce, broadcast, allgather, join and the
    # DistributedOptimizer's step) waited by spinning on std::this_thread::yield, so a waiting
    # worker kept a core busy; with more workers than cores the waiters took the CPU from the
    # workers still computing and from Horovod's background threads. The wait now sleeps on a
    # condition variable that MarkDone signals (no spin, no added latency), waking every 100 ms
    # to let Python handle signals: Ctrl-C now interrupts a collective that never completes.
    "$PYTHON" - "$SRC/horovod/torch" <<'PY'
import pathlib, sys
torch_dir = pathlib.Path(sys.argv[1])
header, source, ops = (torch_dir / name for name in ("handle_manager.h", "handle_manager.cc", "mpi_ops_v2.cc"))
missing = (
    '    throw std::invalid_argument("Handle " + std::to_string(handle) +\n'
    '                                " was not created or has been cleared.");\n'
)
edits = [
    (header, "#include <atomic>\n", "#include <atomic>\n#include <chrono>\n#include <condition_variable>\n"),
    (header, "  bool PollHandle(int handle);\n",
     "  bool PollHandle(int handle);\n"
     "  // Whether the handle is done, after waiting at most `timeout` for it.\n"
     "  bool WaitHandle(int handle, std::chrono::milliseconds timeout);\n"),
    (header, "  std::mutex mutex_;\n", "  std::mutex mutex_;\n  std::condition_variable done_;\n"),
    (source,
     "  std::lock_guard<std::mutex> guard(mutex_);\n  results_[handle] = std::make_shared<Status>(status);\n}\n",
     "  {\n    std::lock_guard<std::mutex> guard(mutex_);\n    results_[handle] = std::make_shared<Status>(status);\n"
     "  }\n  done_.notify_all();\n}\n"),
    (source, "bool HandleManager::PollHandle(int handle) {\n",
     "bool HandleManager::WaitHandle(int handle, std::chrono::milliseconds timeout) {\n"
     "  std::unique_lock<std::mutex> lock(mutex_);\n"
     "  auto found = results_.find(handle);\n"
     "  if (found != results_.end() && found->second == nullptr) {\n"
     "    done_.wait_for(lock, timeout);\n"
     "    found = results_.find(handle);  // Reset() may have cleared it meanwhile\n"
     "  }\n"
     "  if (found == results_.end()) {\n" + missing + "  }\n"
     "  return found->second != nullptr;\n"
     "}\n\n"
     "bool HandleManager::PollHandle(int handle) {\n"),
    (source, "  results_.clear();\n  last_handle_ = 0;\n}\n",
     "  results_.clear();\n  last_handle_ = 0;\n  done_.notify_all();  // waiters see their handle gone\n}\n"),
    (ops,
     "  while (true) {\n    if (handle_manager.PollHandle(handle)) break;\n    {\n"
     "      py::gil_scoped_release release_python_gil;\n      std::this_thread::yield();\n    }\n  }\n",
     "  while (!handle_manager.PollHandle(handle)) {\n"
     "    {\n"
     "      py::gil_scoped_release release_python_gil;\n"
     "      handle_manager.WaitHandle(handle, std::chrono::milliseconds(100));\n"
     "    }\n"
     "    if (PyErr_CheckSignals() != 0) throw py::error_already_set();  // e.g. KeyboardInterrupt\n"
     "  }\n"),
]
for path, old, new in edits:
    text = path.read_text()
    if text.count(old) != 1:
        sys.exit(f"{path.name} does not look as expected; cannot make hvd.synchronize wait without spinning")
    path.write_text(text.replace(old, new))
PY

    # GCC 13's standard headers no longer include <string> and <stdexcept> on the side; two
    # Horovod headers relied on that (std::string in group_table.h, std::logic_error in
    # common.h). Compilers whose headers still do see no difference.
    "$PYTHON" - "$SRC/horovod/common" <<'PY'
import pathlib, sys
common = pathlib.Path(sys.argv[1])
edits = [
    (common / "group_table.h", "#include <queue>\n", "#include <string>\n"),
    (common / "common.h", "#include <memory>\n", "#include <stdexcept>\n"),
]
for path, anchor, addition in edits:
    text = path.read_text()
    if text.count(anchor) != 1:
        sys.exit(f"{path.name} does not look as expected; cannot add the includes GCC 13 needs")
    path.write_text(text.replace(anchor, anchor + addition))
PY

    # Elastic jobs: a worker whose Horovod loop failed kept the sockets of its process-set Gloo
    # contexts open (GlooContext::Finalize returned early for contexts never "enabled", which is
    # every process set's, the global set's included), so its peers noticed nothing until Gloo's
    # 30 s timeout. Finalize now drops every context, and the peers see the connection close.
    "$PYTHON" - "$SRC/horovod/common/gloo/gloo_context.cc" <<'PY'
import pathlib, sys
path = pathlib.Path(sys.argv[1])
text = path.read_text()
old = """void GlooContext::Finalize() {
  if (!enabled_) {
    return;
  }

  global_ctx.reset();
  ctx.reset();
  cross_ctx.reset();
  local_ctx.reset();
  reset_ = true;
}"""
new = """void GlooContext::Finalize() {
  global_ctx.reset();
  ctx.reset();
  cross_ctx.reset();
  local_ctx.reset();
  if (enabled_) {
    reset_ = true;
  }
}"""
if text.count(old) != 1:
    sys.exit("gloo_context.cc does not look as expected; cannot make Finalize close process-set contexts")
path.write_text(text.replace(old, new))
PY

    # horovodrun's rendezvous server and each elastic worker's notification service listened on
    # every interface (unauthenticated HTTP for the rendezvous). They now listen on the address of
    # the interface the job uses: the driver's address on the common interface for the rendezvous
    # (the elastic launch finds that interface before it starts the server), the address of
    # HOROVOD_GLOO_IFACE for a worker's service. Services given several interfaces, or none (the
    # interface probes at start-up), still listen on all.
    "$PYTHON" - "$SRC/horovod/runner" <<'PY'
import pathlib, sys
runner = pathlib.Path(sys.argv[1])
edits = [
    (runner / "util/network.py", "def find_port(server_factory):\n", "def find_port(server_factory, address=''):\n"),
    (runner / "util/network.py", "            addr = ('', port)\n", "            addr = (address, port)\n"),
    (runner / "http/http_server.py",
     "    def start(self, handler_cls=RendezvousHandler):\n        self._httpd, port = find_port(\n"
     "            lambda addr: RendezvousHTTPServer(\n                addr, handler_cls, self._verbose))\n",
     "    def start(self, handler_cls=RendezvousHandler, address=''):\n        self._httpd, port = find_port(\n"
     "            lambda addr: RendezvousHTTPServer(\n                addr, handler_cls, self._verbose), address)\n"),
    (runner / "common/util/network.py", "class BasicService(object):\n",
     "def _bind_address(nics):\n"
     "    \"\"\"The IPv4 address of the one interface a service is given; '' (every interface) otherwise.\"\"\"\n"
     "    names = [nics] if isinstance(nics, str) else list(nics or [])\n"
     "    if len(names) != 1:\n"
     "        return ''\n"
     "    for addr in psutil.net_if_addrs().get(names[0], []):\n"
     "        if addr.family == socket.AF_INET:\n"
     "            return addr.address\n"
     "    return ''\n\n\n"
     "class BasicService(object):\n"),
    (runner / "common/util/network.py",
     "            lambda addr: socketserver.ThreadingTCPServer(\n                addr, self._make_handler()))\n",
     "            lambda addr: socketserver.ThreadingTCPServer(\n                addr, self._make_handler()),\n"
     "            _bind_address(nics))\n"),
    (runner / "gloo_run.py", "    global_rendezv_port = rendezvous.start()\n",
     "    global_rendezv_port = rendezvous.start(address=server_ip)\n"),
    (runner / "gloo_run.py",
     "    global_rendezv_port = rendezvous.start(handler)\n    driver.wait_for_available_slots(settings.num_proc)\n\n"
     "    nics = get_common_interfaces(driver)\n    server_ip = network.get_driver_ip(nics)\n",
     "    driver.wait_for_available_slots(settings.num_proc)\n\n"
     "    nics = get_common_interfaces(driver)\n    server_ip = network.get_driver_ip(nics)\n"
     "    global_rendezv_port = rendezvous.start(handler, address=server_ip)\n"),
]
for path, old, new in edits:
    text = path.read_text()
    if text.count(old) != 1:
        sys.exit(f"{path.name} does not look as expected; cannot make the runner listen on the job's interface")
    path.write_text(text.replace(old, new))
PY

    # Process-set Gloo contexts must use the network interface of the global context.
    GLOO_CC="$SRC/horovod/common/gloo/gloo_context.cc"
    "$PYTHON" - "$GLOO_CC" <<'PY'
import pathlib, sys
path = pathlib.Path(sys.argv[1])
text = path.read_text()
old = "  attr device_attr;\n  device_attr.iface = gloo_iface_;\n  device_attr.ai_family = AF_UNSPEC;\n  auto dev = CreateDevice(device_attr);\n\n  global_ctx = global_context.ctx;"
new = "  gloo_iface_ = global_context.gloo_iface_;\n" + old
if text.count(old) != 1:
    sys.exit("gloo_context.cc does not look as expected; cannot apply the interface fix")
path.write_text(text.replace(old, new))
PY

    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_GLOO=1
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
      # Horovod compiles its CUDA kernels as C++11, which the CUDA 13 headers no longer accept.
      sed -i "s/set(CMAKE_CUDA_STANDARD 11)/set(CMAKE_CUDA_STANDARD 17)/" "$SRC/horovod/common/ops/cuda/CMakeLists.txt"
      grep -q "CMAKE_CUDA_STANDARD 17" "$SRC/horovod/common/ops/cuda/CMakeLists.txt" \
        || die "could not raise the CUDA standard in horovod/common/ops/cuda/CMakeLists.txt"
      export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=SHARED \
        HOROVOD_NCCL_INCLUDE="$(dirname "$NCCL_HEADER")" HOROVOD_NCCL_LIB="$NCCL_LINKS" \
        HOROVOD_CUDA_HOME="$CUDA_ROOT" HOROVOD_BUILD_CUDA_CC_LIST="${CUDA_ARCHS//;/,}"
      export PATH="$CUDA_ROOT/bin:$PATH"   # Horovod asks the nvcc on PATH for its flags
    fi
    mkdir -p "$WHEEL_DIR"
    rm -f "$WHEEL_DIR"/horovod-*.whl
    "$PYTHON" -m pip wheel --no-build-isolation --no-deps -w "$WHEEL_DIR" "$SRC" \
      > "$WHEEL_DIR/build.log" 2>&1 || { tail -n 60 "$WHEEL_DIR/build.log" >&2; die "Horovod build failed (log above; all of it in $WHEEL_DIR/build.log)"; }
  else
    log "using cached wheel $WHEEL_DIR"
  fi
  echo "$KEY" > "$WHEEL_DIR/.key"
  "$PYTHON" -m pip install --quiet --no-deps --force-reinstall "$WHEEL_DIR"/horovod-*.whl
  # horovod's own run-time dependencies (its wheel is installed without them so pip never
  # tries to rebuild it from source)
  "$PYTHON" -m pip install --quiet cloudpickle psutil pyyaml packaging cffi
  "$PYTHON" - "$WHEEL_DIR" <<'PY'
import pathlib, sys
import horovod
key = (pathlib.Path(sys.argv[1]) / ".key").read_text()
pathlib.Path(horovod.__file__).with_name(".hvd_plugins_build_key").write_text(key)
PY
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
