#!/usr/bin/env bash
# A CUDA toolkit from PyPI, for building docent's `cuda` feature on a machine without one.
#
#   scripts/cuda-toolkit.sh            install (once) and print the build environment
#   eval "$(scripts/cuda-toolkit.sh)"  ... and take it into this shell
#   CUDA_COMPUTE_CAP=90 cargo build --features cuda     (H100 / H200)
#
# The packages are NVIDIA's own wheels, pinned below, installed into a virtual environment
# outside the work tree (DOCENT_CUDA_HOME, default ~/.cache/docent-cuda). They hold nvcc,
# the headers, CCCL and the libraries candle links (cudart, cublas, cublasLt, curand, nvrtc)
# in one tree, nvidia/cu13/. Two things the wheels lack are added there, and nothing else:
#   - lib/stubs/libcuda.so: a link-time stub of the driver library (soname libcuda.so.1),
#     made here from the function names in cuda.h. It is never loaded: at run time the
#     driver's own libcuda.so.1 is. (A real toolkit ships the same kind of stub.)
#   - unversioned names (libcublas.so -> libcublas.so.13, ...), which `-lcublas` looks for.
#
# Why CUDA 13.0 and not 12: the binary links libcublas.so.13 & co. by soname, and the GPU
# machines this project can borrow run driver 580 (CUDA 13.0) with CUDA 13 libraries and no
# CUDA 12 ones; cublasLt alone is ~0.5 GB, too big to travel with the check. 13.0 exactly,
# because candle loads its kernels as PTX, and a driver JIT-compiles no PTX newer than
# itself. CUDA_MAJOR=12 installs the -cu12 packages (12.9) for machines with CUDA 12
# libraries (a driver >= 575); that path is written but no build was made with it.
set -euo pipefail

CUDA_MAJOR="${CUDA_MAJOR:-13}"
HOME_DIR="${DOCENT_CUDA_HOME:-$HOME/.cache/docent-cuda}"
VENV="$HOME_DIR/venv-cu$CUDA_MAJOR"
PYTHON="${PYTHON:-python3}"

case "$CUDA_MAJOR" in
13)
    PACKAGES=(
        nvidia-cuda-nvcc==13.0.88
        nvidia-cuda-crt==13.0.88
        nvidia-nvvm==13.0.88
        nvidia-cuda-runtime==13.0.96
        nvidia-cuda-cccl==13.0.85
        nvidia-cuda-nvrtc==13.0.88
        nvidia-cublas==13.1.0.3
        nvidia-curand==10.4.0.35
    )
    SUBDIR=nvidia/cu13
    ;;
12)
    PACKAGES=(
        nvidia-cuda-nvcc-cu12==12.9.86
        nvidia-cuda-runtime-cu12==12.9.79
        nvidia-cuda-cccl-cu12==12.9.27
        nvidia-cuda-nvrtc-cu12==12.9.86
        nvidia-cublas-cu12==12.9.1.4
        nvidia-curand-cu12==10.3.10.19
    )
    SUBDIR=nvidia/cuda_nvcc
    ;;
*)
    echo "cuda-toolkit.sh: CUDA_MAJOR must be 12 or 13, not '$CUDA_MAJOR'" >&2
    exit 2
    ;;
esac

log() { echo "cuda-toolkit.sh: $*" >&2; }

stamp="$VENV/.docent-packages"
wanted="$(printf '%s\n' "${PACKAGES[@]}")"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$wanted" ]]; then
    log "installing ${#PACKAGES[@]} pinned packages into $VENV"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "${PACKAGES[@]}" >&2
    printf '%s\n' "${PACKAGES[@]}" >"$stamp"
fi

site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if [[ "$CUDA_MAJOR" == 13 ]]; then
    ROOT="$site/$SUBDIR"
else
    # CUDA 12 wheels put each package in a folder of its own: gather them into one tree.
    ROOT="$HOME_DIR/root-cu12"
    mkdir -p "$ROOT/bin" "$ROOT/include" "$ROOT/lib"
    for pkg in "$site"/nvidia/*/; do
        for sub in bin include lib nvvm; do
            [[ -d "$pkg$sub" ]] || continue
            if [[ "$sub" == nvvm ]]; then
                ln -sfn "$pkg$sub" "$ROOT/nvvm"
            else
                for f in "$pkg$sub"/*; do ln -sfn "$f" "$ROOT/$sub/"; done
            fi
        done
    done
fi
[[ -x "$ROOT/bin/nvcc" ]] || { log "no nvcc under $ROOT"; exit 1; }

# Unversioned names for the linker.
for lib in "$ROOT"/lib/lib*.so.*; do
    base="$(basename "$lib")"
    name="${base%%.so.*}.so"
    [[ -e "$ROOT/lib/$name" ]] || ln -sfn "$base" "$ROOT/lib/$name"
done

# The driver stub: every cu* function cuda.h declares (after its _v2/_v3 renames), as an
# empty function, so that `-lcuda` links. Never loaded at run time.
stub="$ROOT/lib/stubs/libcuda.so"
if [[ ! -f "$stub" || "$ROOT/include/cuda.h" -nt "$stub" ]]; then
    mkdir -p "$ROOT/lib/stubs"
    src="$(mktemp --suffix=.c)"
    {
        # Declared names, then the names their #define renames point to.
        grep -oE 'CUDAAPI[[:space:]]+cu[A-Za-z0-9_]+[[:space:]]*\(' "$ROOT/include/cuda.h" |
            sed -E 's/CUDAAPI[[:space:]]+//; s/[[:space:]]*\($//'
        grep -oE '^#define[[:space:]]+cu[A-Za-z0-9_]+[[:space:]]+__CUDA_API_[A-Z0-9_]+\(cu[A-Za-z0-9_]+\)' \
            "$ROOT/include/cuda.h" | sed -E 's/.*\((cu[A-Za-z0-9_]+)\)$/\1/'
        grep -oE '^#define[[:space:]]+cu[A-Za-z0-9_]+[[:space:]]+cu[A-Za-z0-9_]+[[:space:]]*$' \
            "$ROOT/include/cuda.h" | awk '{print $3}'
    } | sort -u | sed -E 's/^(.*)$/int \1(void) { return 999; }/' >"$src"
    cc -shared -fPIC -o "$stub" -Wl,-soname,libcuda.so.1 "$src"
    ln -sfn libcuda.so "$ROOT/lib/stubs/libcuda.so.1"
    log "wrote the link-time driver stub $stub ($(grep -c . "$src") functions)"
    rm -f "$src"
fi

cat <<EOF
export CUDA_ROOT="$ROOT"
export CUDA_PATH="$ROOT"
export CUDA_HOME="$ROOT"
export PATH="$ROOT/bin:\$PATH"
export CPATH="$ROOT/include:$ROOT/include/cccl\${CPATH:+:\$CPATH}"
export LIBRARY_PATH="$ROOT/lib:$ROOT/lib/stubs\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
export CUDA_COMPUTE_CAP="\${CUDA_COMPUTE_CAP:-90}"
# At run time, on a machine with a GPU: the driver's libcuda.so.1 from the system, and the
# CUDA $CUDA_MAJOR libraries from here or from the machine's own toolkit:
#   export LD_LIBRARY_PATH="$ROOT/lib:\$LD_LIBRARY_PATH"
EOF
