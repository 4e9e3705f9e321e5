#!/usr/bin/env bash
# Creates models/.venv-llama, the Python environment of the llama.cpp peer of the generation
# benchmark (scripts/bench_generate_peer.py), from PyPI with pinned versions.
# Separate from models/.venv-peer (bench-peer-venv.sh) so neither can break the other.
# Idempotent: does nothing when the venv exists and its stamp matches the pins, the build
# flags and the Python version.
#
#   llama-cpp-python 0.3.36: PyPI has only an sdist, so this compiles its vendored llama.cpp
#     (CPU only, -march=native: the wheel runs where it is built). Needs gcc/g++; cmake and
#     ninja come from PyPI through the build isolation of scikit-build-core.
#   The build (10-20 min on 2 cores) runs once per machine: the wheel is built with `pip wheel`
#   into a cache outside the work tree, ${XDG_CACHE_HOME:-$HOME/.cache}/docent-wheels/<key>/,
#   where <key> hashes the version, CMAKE_ARGS, compiler, glibc and CPU flags (a native build
#   must not be reused on another CPU). Fresh clones and venv rebuilds install from it.
#   LLAVA_BUILD=OFF skips the multimodal library (mtmd), which the benchmark does not use and
#   llama_cpp only imports lazily (llava chat handlers); it saves a good part of the build.
#
# Environment: PYTHON (python3.11+), DOCENT_MODELS_DIR, DOCENT_WHEEL_CACHE (cache directory),
#   BUILD_JOBS (parallel compile jobs, default: all cores; the build runs under nice -n 10),
#   PEER_ISA: `native` (default: -march=native, models/.venv-llama) or `avx2` (AVX2, FMA,
#   F16C, BMI2 and nothing newer, as llama.cpp builds natively on an AVX2 machine without
#   AVX-512: models/.venv-llama-avx2), the peer of `docent bench generate --isa avx2` on an
#   AVX-512 machine.
#
# Usage: bash scripts/bench-generate-venv.sh
#   then: models/.venv-llama/bin/python scripts/bench_generate_peer.py --model FILE.gguf ...
#   PEER_ISA=avx2 bash scripts/bench-generate-venv.sh
#   then: docent bench generate --isa avx2 --peer-python models/.venv-llama-avx2/bin/python ...
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
models=${DOCENT_MODELS_DIR:-$root/models}
py=${PYTHON:-python3}
case ${PEER_ISA:-native} in
  native) venv=$models/.venv-llama
          isa_args="-DGGML_NATIVE=ON" ;;
  avx2)   venv=$models/.venv-llama-avx2
          isa_args="-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF" ;;
  *) echo "bench-generate-venv: PEER_ISA must be native or avx2, got ${PEER_ISA}" >&2; exit 2 ;;
esac
stamp=$venv/.docent-pins
cache_root=${DOCENT_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/docent-wheels}

die() { echo "bench-generate-venv: $*" >&2; exit 1; }
say() { echo "bench-generate-venv: $*"; }

command -v "$py" >/dev/null 2>&1 || die "python3 is required"
"$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || die "Python 3.11 or newer is required (found $("$py" -V 2>&1)); set PYTHON=/path/to/python3.11"
"$py" -c 'import venv, ensurepip' >/dev/null 2>&1 || die "the venv module is required (Debian: apt-get install python3-venv)"
command -v gcc >/dev/null 2>&1 && command -v g++ >/dev/null 2>&1 \
  || die "gcc and g++ are required to compile llama.cpp (Debian: apt-get install build-essential)"
command -v sha256sum >/dev/null 2>&1 || die "sha256sum is required (coreutils)"

lcp=llama-cpp-python==0.3.36
# llama-cpp-python's runtime dependencies, pinned (numpy as in the other venvs).
deps="numpy==2.3.5 typing-extensions==4.16.0 diskcache==5.6.3 jinja2==3.1.6 markupsafe==3.0.4"
cmake_args="$isa_args -DGGML_BLAS=OFF -DGGML_CUDA=OFF -DLLAVA_BUILD=OFF"

# Cache key of the wheel: everything that changes the compiled code. (sed -n 1p, not head:
# head would close the pipe early and ldd's SIGPIPE would fail the script under pipefail.)
cpu_flags=$(grep -m1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null || true)
key_src="$lcp|$cmake_args|$(uname -m)|$(gcc -dumpfullversion 2>/dev/null || gcc -dumpversion)|$(ldd --version 2>&1 | sed -n 1p)|$cpu_flags"
key=$(printf '%s' "$key_src" | sha256sum | cut -c1-16)
wheels=$cache_root/llama-cpp-python-0.3.36-$key

want="$lcp $deps $cmake_args key=$key $("$py" -V 2>&1)"
if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi

# 1. The wheel, built once per machine into the cache (atomically: temp dir + rename).
if ! ls "$wheels"/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1; then
  mkdir -p "$cache_root"
  tmp=$(mktemp -d "$cache_root/.build-XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  log=$cache_root/llama-cpp-python-0.3.36-$key.build.log
  say "compiling $lcp (CPU, ${PEER_ISA:-native}; 10-20 min on 2 cores; log: $log)"
  # --no-binary: PyPI has only the sdist anyway; this makes sure nothing else is picked up.
  # --no-cache-dir: pip's own wheel cache is keyed by the sdist, not by CMAKE_ARGS, and would
  # hand back a wheel compiled with other flags (seen: the AVX2 build came back with AVX-512).
  # nice: leave the CPU to interactive work and other builds on a small machine.
  if ! CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL="${BUILD_JOBS:-$(nproc)}" \
      nice -n 10 "$py" -m pip wheel --no-deps --no-binary=llama-cpp-python --disable-pip-version-check --no-cache-dir \
      --verbose --wheel-dir "$tmp" "$lcp" >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    die "building $lcp failed (full log: $log)"
  fi
  ls "$tmp"/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1 || die "pip wheel produced no wheel (log: $log)"
  rm -rf "$wheels"
  mv "$tmp" "$wheels"
  trap - EXIT
  say "cached $(ls "$wheels"/*.whl)"
fi

# 2. The venv, from the cached wheel (--only-binary: never falls back to compiling the sdist).
say "creating $venv"
mkdir -p "$models"
"$py" -m venv --clear "$venv"
# shellcheck disable=SC2086
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --only-binary=:all: \
  --find-links "$wheels" "$lcp" $deps \
  || die "installing $lcp (from $wheels) and $deps into $venv failed (is PyPI reachable?)"
"$venv/bin/python" -c 'import llama_cpp; assert llama_cpp.__version__ == "0.3.36", llama_cpp.__version__' \
  || die "import llama_cpp failed in $venv (delete $wheels to rebuild the wheel)"
echo "$want" > "$stamp"
say "ready: $venv/bin/python"
