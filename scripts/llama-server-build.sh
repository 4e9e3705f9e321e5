#!/usr/bin/env bash
# Builds llama.cpp's llama-server from the llama.cpp source inside the pinned
# llama-cpp-python sdist on PyPI (the same llama.cpp as the generation benchmark's Python
# peer, scripts/bench-generate-venv.sh), for `docent bench generate --llama-server BIN`.
#
#   bash scripts/llama-server-build.sh            # prints the binary's path when done
#
# CPU only, -march=native like the Python peer (a native build must not be reused on another
# CPU: the output folder is keyed by the CPU flags). cmake and ninja come from PyPI into a
# venv beside the build. Outside the work tree: ${XDG_CACHE_HOME:-$HOME/.cache}/docent-llama-server.
# About 10 minutes on 2 cores (8 on the Zen 4 machine); runs under nice. Only the sdist is
# taken as source: its build tools (cmake, scikit-build-core) come as wheels (with
# `--no-binary :all:` pip compiled cmake itself first, another 10+ minutes).
set -euo pipefail
version=0.3.36
home=${XDG_CACHE_HOME:-$HOME/.cache}/docent-llama-server
flags=$(grep -m1 '^flags' /proc/cpuinfo | sha256sum | cut -c1-12)
out=$home/build-$flags
bin=$out/bin/llama-server
if [ -x "$bin" ]; then echo "$bin"; exit 0; fi
mkdir -p "$home"
cd "$home"
if [ ! -d venv ]; then python3 -m venv venv; fi
venv/bin/pip install -q cmake ninja
if [ ! -d "llama_cpp_python-$version" ]; then
    venv/bin/pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" -d sdist
    tar xzf "sdist/llama_cpp_python-$version.tar.gz"
fi
export PATH=$home/venv/bin:$PATH
nice -n 10 cmake -S "llama_cpp_python-$version/vendor/llama.cpp" -B "$out" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >&2
nice -n 10 cmake --build "$out" --target llama-server -j "${BUILD_JOBS:-$(nproc)}" >&2
echo "$bin"
