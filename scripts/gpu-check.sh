#!/usr/bin/env bash
# docent's GPU check: one script, one call on a GPU machine (H100/H200, CUDA 13 driver),
# every result as JSON under $OUT.
#
#   scripts/gpu-check.sh --prepare   here (no GPU needed): build the CUDA binaries and put
#                                    everything the GPU machine needs into .gpu-check/
#   scripts/gpu-check.sh             there: run the check from .gpu-check/ (GPU_CHECK_PAYLOAD)
#   scripts/gpu-check.sh --dry-run   here: the same steps on the CPU with the CPU build, small
#
# What travels (.gpu-check/, made by --prepare; ~50 MB): the CUDA builds of `docent` and of
# the integration test binary (stripped, xz), the llama.cpp peer as a wheel of the pinned
# llama-cpp-python sdist built with CUDA for sm_90 (built there from the sdist when no wheel
# is carried: minutes of the GPU machine's time), the layouts of the Qwen2.5-Coder 0.5B and
# 1.5B Q4_K_M files and of the MiniLM embedder (header, metadata, tensor table), stories260K,
# a prompt text and a small corpus. Nothing is rebuilt there but the synthetic model files.
#
# The models are synthetic on purpose: the GPU machines of this workplace take 64 MiB with a
# call and reach no network, and the GGUF files are 0.5 and 1.1 GB. scripts/synth_weights.py
# rebuilds each file from its layout with random, well-formed quantized blocks: same metadata,
# tensor names, types, shapes and bytes, so both engines do the same work as on the real file
# (speed), but the answers are noise and a draft model's proposals are almost all rejected
# (the speculative row is a lower bound). Correctness on the GPU is checked on stories260K,
# a real model, against llama2.c's greedy output. With real files, set GPU_CHECK_MODELS to a
# folder holding the two GGUF files (their catalog names) and they are used instead.
#
# Steps (each recorded in summary.json with its status and seconds; a failed step does not
# stop the next):
#   env       nvidia-smi, CPU, driver; the CUDA libraries the binaries link, found on the machine
#   models    synthetic Qwen files and embedder (or GPU_CHECK_MODELS)
#   tests     the generation tests on the GPU (DOCENT_TEST_DEVICE=cuda): stories260K greedy ==
#             llama2.c with no call into docent's CPU kernels; speculative == plain greedy;
#             prefix-cache reuse == no cache
#   peer      the llama.cpp peer installed (or built from the sdist)
#   generate  `docent bench generate` on the GPU, 0.5B and 1.5B, 600-token prompts, llama.cpp
#             beside it on the same files; speculative 1.5B + 0.5B draft against plain
#   dtypes    the same two models, plain decode, with f32, f16 and bf16 activations (issue 58
#             step 1: which dtype the GPU should run)
#   load      `docent bench load`: 64 clients of generated answers for 60 s against the
#             real server on the GPU; errors other than 429/503 counted
set -uo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
mode=run
case "${1:-}" in
--prepare) mode=prepare ;;
--dry-run) mode=dry-run ;;
"") ;;
*)
    echo "usage: scripts/gpu-check.sh [--prepare | --dry-run]" >&2
    exit 2
    ;;
esac

payload="${GPU_CHECK_PAYLOAD:-$here/.gpu-check}"
# Carried in parts (scripts/gpu_carry.py, when the payload and the tree exceed one call's
# 64 MiB): the payload as .gpu-check.tar and any real GGUF files, put together in
# .gpu-stage/files/ over earlier calls.
staged="$here/.gpu-stage/files"
if [[ $mode == run && ! -d "$payload" && -f "$staged/.gpu-check.tar" ]]; then
    mkdir -p "$payload" && tar -xf "$staged/.gpu-check.tar" -C "$payload" || exit 1
fi
if [[ -z "${GPU_CHECK_MODELS:-}" ]] && ls "$staged"/qwen2.5-coder-*.gguf >/dev/null 2>&1; then
    export GPU_CHECK_MODELS="$staged"
fi
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/docent-target}"
say() { echo "gpu-check: $*" >&2; }
die() {
    say "$*"
    exit 1
}

# ---------------------------------------------------------------------------------------
# --prepare: here, without a GPU
# ---------------------------------------------------------------------------------------
cargo_executables() { # cargo args...: prints "<kind> <name> <path>" of each built executable
    cargo "$@" --message-format=json-render-diagnostics |
        python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        t = m["target"]
        print(t["kind"][0], t["name"], m["executable"])
'
}

prepare() {
    command -v xz >/dev/null || die "xz is required (Debian: xz-utils)"
    rm -rf "$payload.tmp"
    mkdir -p "$payload.tmp"
    local out="$payload.tmp"
    say "building docent with --features cuda (CUDA from scripts/cuda-toolkit.sh)"
    local env
    env=$("$here/scripts/cuda-toolkit.sh") || die "scripts/cuda-toolkit.sh failed"
    eval "$env"
    # a target directory of its own: sharing the CPU build's made every switch between the
    # two rebuild the C dependencies (aws-lc-sys, ring, zstd-sys) and all that sits on them
    export CARGO_TARGET_DIR="${CUDA_TARGET_DIR:-$CARGO_TARGET_DIR-cuda}"
    local started=$SECONDS list
    list=$(cd "$here" && cargo_executables test --workspace --features docent/cuda --no-run) ||
        die "the CUDA build failed"
    say "CUDA build: $((SECONDS - started)) s"
    local docent integration
    docent=$(awk '$1 == "bin" && $2 == "docent" {print $3}' <<<"$list" | tail -1)
    integration=$(awk '$1 == "test" && $2 == "integration" {print $3}' <<<"$list" | tail -1)
    [[ -x "$docent" && -x "$integration" ]] || die "no docent or integration executable in the build"
    ldd "$docent" | grep -q 'libcublas.so' || die "$docent does not link cuBLAS: not a CUDA build"
    # stripped, in one archive with a dictionary larger than both: the two executables
    # share most of their code, so the second costs little (38 MB for both, 66 apart)
    mkdir -p "$out/bin"
    strip -o "$out/bin/docent" "$docent"
    strip -o "$out/bin/integration" "$integration"
    tar cf - -C "$out" bin | xz -9 --lzma2=preset=9,dict=600MiB -T1 >"$out/bin.tar.xz"
    say "binaries: $(du -h "$out/bin.tar.xz" | cut -f1) (from $(du -ch "$docent" "$integration" | tail -1 | cut -f1))"
    rm -rf "$out/bin"

    # the peer: a CUDA wheel of the pinned llama-cpp-python, when built (see --peer-wheel)
    local wheel
    wheel=$(ls "$HOME"/.cache/docent-cuda/peer/wheel-cu13-sm90/llama_cpp_python-0.3.36-*.whl 2>/dev/null | head -1)
    if [[ -n "$wheel" ]]; then
        # the wheel holds each library five times (copies for the symlinks a wheel cannot
        # hold): keep the package with one copy and soname links, 21 MB compressed
        local tmp
        tmp=$(mktemp -d)
        (cd "$tmp" && unzip -q "$wheel" && rm -rf lib include bin &&
            cd llama_cpp/lib && rm -f ./*.so.*.* &&
            for f in *.so; do if [[ -f "$f.0" ]]; then rm -f "$f.0" && ln -s "$f" "$f.0"; fi; done) ||
            die "repacking $wheel failed"
        tar cf - -C "$tmp" llama_cpp llama_cpp_python-0.3.36.dist-info | xz -9e -T1 >"$out/llama_cpp_python-0.3.36-cuda.tar.xz"
        rm -rf "$tmp"
    else
        say "no CUDA wheel of llama-cpp-python: the check will build it from the sdist there"
        trimmed_sdist "$out"
    fi
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$out" diskcache==5.6.3 ||
        die "pip download diskcache failed"

    # model layouts and the small real things
    local qwen
    for qwen in qwen2.5-coder-0.5b qwen2.5-coder-1.5b; do
        local f
        f=$(ls "$here"/models/$qwen/*.gguf 2>/dev/null | head -1)
        [[ -f "$f" ]] || die "models/$qwen has no GGUF file: run make setup"
        python3 "$here/scripts/synth_weights.py" layout "$f" "$out/$qwen.layout" >&2
        xz -9 "$out/$qwen.layout"
    done
    mkdir -p "$out/minilm"
    python3 "$here/scripts/synth_weights.py" st-layout \
        "$here/models/all-MiniLM-L6-v2/model.safetensors" "$out/minilm/model.layout" >&2
    cp "$here"/models/all-MiniLM-L6-v2/{config.json,tokenizer.json,tokenizer_config.json,special_tokens_map.json} "$out/minilm/"
    mkdir -p "$out/stories260K"
    cp "$here"/../shared/models/stories260K/{stories260K.gguf,greedy_reference.txt} "$out/stories260K/"
    cp "$here/models/stories260K/stories260K.q8_0.gguf" "$out/stories260K/"
    cp "$here/../shared/data/corpus/rust-book/src/ch04-01-what-is-ownership.md" "$out/text.md"
    mkdir -p "$out/corpus"
    ls "$here"/../shared/data/corpus/rust-book/src/ch0[3-4]*.md | head -12 | xargs -I{} cp {} "$out/corpus/"
    rm -rf "$payload"
    mv "$out" "$payload"
    say "ready: $payload ($(du -sh "$payload" | cut -f1)); carry it: run(carry=[\".gpu-check\"])"
    # the payload as one file too, for scripts/gpu_carry.py when tree + payload exceed a call
    tar -cf "$here/.gpu-check.tar" -C "$payload" .
    say "or in parts: python3 scripts/gpu_carry.py plan .gpu-check.tar (docs/gpu.md, \"Carrying\")"
    du -ab "$payload" | sort -n | tail -8 >&2
}

trimmed_sdist() { # the llama-cpp-python sdist without what a CUDA build never reads
    local out=$1 src="$HOME/.cache/docent-cuda/peer/llama_cpp_python-0.3.36.tar.gz"
    [[ -f "$src" ]] || die "$src missing (pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36)"
    local tmp
    tmp=$(mktemp -d)
    tar xzf "$src" -C "$tmp"
    local d="$tmp/llama_cpp_python-0.3.36"
    rm -rf "$d/.git" "$d/docs" "$d/examples" "$d/tests" "$d/vendor/llama.cpp/models" \
        "$d/vendor/llama.cpp/docs" "$d/vendor/llama.cpp/.github" "$d/vendor/llama.cpp/media" \
        "$d"/vendor/llama.cpp/ggml/src/ggml-{vulkan,sycl,metal,opencl,cann,musa,hip,kompute,webgpu,zdnn,rpc}
    tar cJf "$out/llama_cpp_python-0.3.36-trimmed.tar.xz" -C "$tmp" llama_cpp_python-0.3.36
    rm -rf "$tmp"
}

if [[ $mode == prepare ]]; then
    prepare
    exit
fi

# ---------------------------------------------------------------------------------------
# the check (on the GPU machine, or --dry-run here on the CPU)
# ---------------------------------------------------------------------------------------
OUT="${OUT:-$here/gpu-check-out}"
# The Python with numpy, onnx, onnxruntime and tokenizers (the GPU machine's python3 has them;
# here, the setup step's models/.venv).
py=${PYTHON:-python3}
[[ $mode == dry-run && -z "${PYTHON:-}" && -x "$here/models/.venv/bin/python" ]] && py="$here/models/.venv/bin/python"
mkdir -p "$OUT"
work=$(mktemp -d /tmp/gpu-check.XXXXXX)
steps="$OUT/steps.jsonl"
: >"$steps"
: >"$OUT/steps.log"
if [[ $mode == dry-run ]]; then
    device=cpu
    dtype=f32
    new_tokens=${NEW_TOKENS:-16}
    repeat=${REPEAT:-1}
    load_seconds=${LOAD_SECONDS:-10}
    load_clients=${LOAD_CLIENTS:-4}
    prompt_tokens=${PROMPT_TOKENS:-64}
else
    device=cuda
    dtype=auto
    new_tokens=${NEW_TOKENS:-128}
    repeat=${REPEAT:-3}
    load_seconds=${LOAD_SECONDS:-60}
    load_clients=${LOAD_CLIENTS:-64}
    prompt_tokens=${PROMPT_TOKENS:-600}
fi

step() { # name timeout_s command...: runs it, logs to $OUT/<name>.log, records the outcome
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    say "step $name (at most ${limit} s)"
    # a step is a function: bash -c runs it (exported below), so timeout can stop it
    timeout --signal=TERM --kill-after=10 "$limit" bash -c "$*" >"$work/$name.log" 2>&1
    local rc=$?
    # one log file for all steps: the device tool brings back at most 8 files
    { echo "===== $name (exit $rc, $((SECONDS - t0)) s)"; cat "$work/$name.log"; } >>"$OUT/steps.log"
    local status=ok
    [[ $rc == 0 ]] || status=failed
    [[ $rc == 124 ]] && status=timeout
    printf '{"step": "%s", "status": "%s", "exit": %d, "seconds": %d}\n' \
        "$name" "$status" "$rc" "$((SECONDS - t0))" >>"$steps"
    say "step $name: $status ($((SECONDS - t0)) s)"
    tail -n 5 "$work/$name.log" >&2
    return $rc
}

unxz_to() { # file.xz dest
    if command -v xz >/dev/null; then xz -dc "$1" >"$2"; else "$py" -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$1" "$2"; fi
}

env_step() {
    {
        echo "== date"; date -u
        echo "== nvidia-smi"; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
        echo "== lscpu"; lscpu 2>&1 | grep -E 'Model name|^CPU\(s\)|Flags' | cut -c1-200
        echo "== python"; python3 -V 2>&1
    }
    if [[ $mode == run ]]; then
        # the CUDA 13 libraries the binaries link, wherever this machine has them
        local dirs="" lib
        local roots="/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu"
        roots="$roots $("$py" -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null)"
        for lib in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13; do
            local found
            found=$(find $roots -name "$lib" 2>/dev/null | head -1)
            [[ -n "$found" ]] || { echo "missing: $lib"; return 1; }
            echo "$lib: $found"
            dirs="$dirs:$(dirname "$found")"
        done
        echo "export LD_LIBRARY_PATH=\"${dirs#:}:\${LD_LIBRARY_PATH:-}\"" >"$work/ld.sh"
        # shellcheck disable=SC1091
        . "$work/ld.sh"
    fi
    echo "== ldd docent"
    ldd "$docent" | grep -E 'cuda|cublas|curand|nvrtc|not found'
    ! ldd "$docent" | grep -q 'not found'
}

models_step() {
    mkdir -p "$work/models/minilm"
    local q
    for q in qwen2.5-coder-0.5b qwen2.5-coder-1.5b; do
        # a real file when one was carried (each model on its own: the 0.5B alone fits the
        # carrying budget of one session), else a synthetic one from the layout
        local real
        real=$(ls "${GPU_CHECK_MODELS:-/nonexistent}"/$q*.gguf 2>/dev/null | head -1)
        if [[ -n "$real" ]]; then
            ln -sf "$real" "$work/models/$q.gguf" || return 1
            echo "$q: the real file $real"
            continue
        fi
        unxz_to "$payload/$q.layout.xz" "$work/models/$q.layout" || return 1
        "$py" "$here/scripts/synth_weights.py" synth "$work/models/$q.layout" "$work/models/$q.gguf" 1 || return 1
    done
    if [[ ! -d "$payload/minilm" ]]; then
        echo "no embedder layout in the payload: the load step cannot run"
        return
    fi
    cp "$payload"/minilm/*.json "$work/models/minilm/"
    "$py" "$here/scripts/synth_weights.py" st-synth "$payload/minilm/model.layout" \
        "$work/models/minilm/model.safetensors" 1 || return 1
    "$py" "$here/scripts/export_minilm_onnx.py" --synthetic --model-dir "$work/models/minilm" \
        --out "$work/models/minilm/model.onnx" || return 1
    rm -f "$work/models/minilm/model.safetensors"
    ls -la "$work/models"
}

tests_step() {
    mkdir -p "$work/shared/models" "$work/testmodels/stories260K"
    ln -sfn "$payload/stories260K" "$work/shared/models/stories260K"
    ln -sf "$payload/stories260K/stories260K.q8_0.gguf" "$work/testmodels/stories260K/"
    DOCENT_TEST_DEVICE=$device DOCENT_SHARED_DIR="$work/shared" DOCENT_MODELS_DIR="$work/testmodels" \
        RUST_LOG=warn "$integration" --test-threads 1 \
        generation::stories260k_greedy_matches_llama2c \
        generation::speculative_output_equals_plain_greedy \
        generation::prefix_cache_reuse_gives_the_same_tokens
}

peer_step() {
    if [[ $mode == dry-run ]]; then
        "$peer_python" -c 'import llama_cpp; print("llama-cpp-python", llama_cpp.__version__)'
        return
    fi
    # the prebuilt peer (--prepare repacks the CUDA wheel), else the pinned sdist built here
    local wheels=("$payload"/diskcache-*.whl)
    if [[ -f "$payload/llama_cpp_python-0.3.36-cuda.tar.xz" ]]; then
        mkdir -p "$work/site"
        tar xJf "$payload/llama_cpp_python-0.3.36-cuda.tar.xz" -C "$work/site" || return 1
    else
        # CUDA, sm_90: the machine has nvcc and cmake
        local src="$payload/llama_cpp_python-0.3.36-trimmed.tar.xz"
        [[ -f "$src" ]] || { echo "no peer and no sdist in $payload"; return 1; }
        tar xJf "$src" -C "$work"
        command -v nvcc >/dev/null || export PATH="/usr/local/cuda/bin:$PATH"
        CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90-real -DGGML_NATIVE=OFF -DGGML_CUDA_NCCL=OFF -DLLAVA_BUILD=OFF" \
            CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$py" -m pip wheel --no-build-isolation --no-deps \
            -w "$work/wheel" "$work/llama_cpp_python-0.3.36" || return 1
        wheels+=("$work"/wheel/llama_cpp_python-*.whl)
    fi
    "$py" -m pip install -q --no-index --no-deps --no-compile --target "$work/site" \
        "${wheels[@]}" || return 1
    PYTHONPATH="$work/site" "$py" -c 'import llama_cpp; print("llama-cpp-python", llama_cpp.__version__, "GPU offload:", llama_cpp.llama_supports_gpu_offload())'
}

generate_step() {
    local m="$work/models"
    local peer=(--peer-python "$peer_python")
    [[ -n "$peer_python" ]] || peer=(--no-peer)
    PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}" RUST_LOG=warn "$docent" bench generate \
        --device "$device" --dtype "$dtype" \
        --model "$m/qwen2.5-coder-0.5b.gguf" --model "$m/qwen2.5-coder-1.5b.gguf" \
        --prompt-tokens "$prompt_tokens" --new-tokens "$new_tokens" --repeat "$repeat" \
        --text "$payload/text.md" \
        --speculative "$m/qwen2.5-coder-1.5b.gguf" "$m/qwen2.5-coder-0.5b.gguf" --gamma 4 \
        --no-load --clients 0 --memory 0 "${peer[@]}" --json >"$OUT/bench-generate.json"
}

dtypes_step() { # issue 58 step 1: the activation dtype on the device, plain decode, no peer
    local m="$work/models" d
    : >"$OUT/bench-dtypes.jsonl"
    for d in f32 f16 bf16; do
        RUST_LOG=warn "$docent" bench generate --device "$device" --dtype "$d" \
            --model "$m/qwen2.5-coder-0.5b.gguf" --model "$m/qwen2.5-coder-1.5b.gguf" \
            --prompt-tokens "$prompt_tokens" --new-tokens "$new_tokens" --repeat "$repeat" \
            --text "$payload/text.md" --no-speculative --no-load --clients 0 --memory 0 \
            --no-peer --json >"$work/dtype.json" || return 1
        "$py" -c 'import json, sys; g = json.load(open(sys.argv[1])); g["dtype"] = sys.argv[2]; print(json.dumps(g))' \
            "$work/dtype.json" "$d" >>"$OUT/bench-dtypes.jsonl" || return 1
        echo "$d: done"
    done
}

load_step() {
    local ort
    ort=${ORT_LIBRARY:-$("$py" -c 'import onnxruntime, glob, os; print(sorted(glob.glob(os.path.join(os.path.dirname(onnxruntime.__file__), "capi", "libonnxruntime.so*")))[0])' 2>/dev/null)}
    [[ -f "$ort" ]] || { echo "no libonnxruntime.so ($py -m pip show onnxruntime)"; return 1; }
    DOCENT_EMBEDDING__MODEL_DIR="$work/models/minilm" DOCENT_EMBEDDING__ORT_LIBRARY="$ort" \
        DOCENT_GENERATION__MODEL="$work/models/qwen2.5-coder-0.5b.gguf" \
        DOCENT_GENERATION__DEVICE="$device" DOCENT_GENERATION__DTYPE="$dtype" \
        RUST_LOG=warn "$docent" bench load --corpus "$payload/corpus" --clients "$load_clients" \
        --seconds "$load_seconds" --no-kill --mix generated=1
}

# The same two executables in both modes: the CUDA builds from the payload. A dry run here
# starts them with the toolkit's libraries and its link-time driver stub (the CPU device
# never calls the driver), so it runs exactly what travels.
[[ -d "$payload" ]] || die "$payload missing: make it with scripts/gpu-check.sh --prepare (and carry it)"
if command -v xz >/dev/null; then
    xz -dc "$payload/bin.tar.xz" | tar xf - -C "$work"
else
    "$py" -c 'import lzma, sys, tarfile; tarfile.open(fileobj=lzma.open(sys.argv[1])).extractall(sys.argv[2])' "$payload/bin.tar.xz" "$work"
fi || die "unpacking the binaries failed"
docent="$work/bin/docent"
integration="$work/bin/integration"
if [[ $mode == dry-run ]]; then
    eval "$("$here/scripts/cuda-toolkit.sh")"
    export LD_LIBRARY_PATH="$CUDA_ROOT/lib:$CUDA_ROOT/lib/stubs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    peer_python=""
    [[ -x "$here/models/.venv-llama/bin/python" ]] && peer_python="$here/models/.venv-llama/bin/python"
else
    peer_python=$(command -v "$py")
fi
cd "$here" || exit 1
export here work payload mode device dtype new_tokens repeat load_seconds load_clients \
    prompt_tokens docent integration peer_python py OUT
export -f say unxz_to env_step models_step tests_step peer_step generate_step dtypes_step \
    load_step

# GPU_CHECK_STEPS picks steps (default: all), e.g. a short first look without the peer
wanted=" ${GPU_CHECK_STEPS:-env models tests peer generate dtypes load} "
want() { [[ "$wanted" == *" $1 "* ]]; }
want env && step env 60 env_step
[[ -f "$work/ld.sh" ]] && . "$work/ld.sh"
want models && step models 240 models_step
want tests && step tests 180 tests_step
if ! want peer; then
    peer_python=""
elif [[ $mode == dry-run && -z "$peer_python" ]]; then
    say "dry run: no CPU peer (models/.venv-llama: scripts/bench-generate-venv.sh); bench without it"
else
    step peer 420 peer_step || peer_python=""
fi
want generate && step generate 420 generate_step
want dtypes && step dtypes 240 dtypes_step
want load && step load $((load_seconds + 150)) load_step

python3 - "$OUT" "$mode" <<'EOF'
import json, os, sys
out, mode = sys.argv[1], sys.argv[2]
steps = [json.loads(l) for l in open(os.path.join(out, "steps.jsonl"))]
summary = {"mode": mode, "steps": steps}
try:
    g = json.load(open(os.path.join(out, "bench-generate.json")))
    summary["device"] = g.get("device")
    summary["peer"] = g.get("peer")
    summary["models"] = [
        {"model": r["model"],
         "docent": r["docent"], "llama_cpp": r["llama_cpp"],
         "decode_vs_llama_cpp": [round(d["decode_tok_s"] / p["decode_tok_s"], 3)
                                 for d, p in zip(r["docent"], r["llama_cpp"])]}
        for r in g.get("models", [])]
    summary["speculative"] = g.get("speculative")
except (OSError, ValueError, KeyError) as e:
    summary["generate_error"] = str(e)
try:  # per dtype: prefill and decode tok/s of each model
    summary["dtypes"] = [
        {"dtype": g["dtype"],
         "models": [{"model": r["model"],
                     "prefill_tok_s": [d["prefill_tok_s"] for d in r["docent"]],
                     "decode_tok_s": [d["decode_tok_s"] for d in r["docent"]]}
                    for r in g.get("models", [])]}
        for g in map(json.loads, open(os.path.join(out, "bench-dtypes.jsonl")))]
except (OSError, ValueError, KeyError) as e:
    summary["dtypes_error"] = str(e)
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(f"gpu-check ({mode}): device {summary.get('device')}")
for s in steps:
    print(f"  {s['step']:9} {s['status']:8} {s['seconds']:4d} s")
for m in summary.get("models", []):
    for i, d in enumerate(m["docent"]):
        p = m["llama_cpp"][i] if i < len(m["llama_cpp"]) else None
        print(f"  {m['model']}: {d['prompt_tokens']} tok prompt: TTFT {d['ttft_ms']:.1f} ms, "
              f"prefill {d['prefill_tok_s']:.0f} tok/s, decode {d['decode_tok_s']:.1f} tok/s"
              + (f" | llama.cpp TTFT {p['ttft_ms']:.1f} ms, decode {p['decode_tok_s']:.1f} tok/s" if p else ""))
for s in summary.get("speculative") or []:
    print(f"  speculative {s['target']} + {s['draft']}: {s['speculative_decode_tok_s']:.1f} tok/s "
          f"vs plain {s['plain_decode_tok_s']:.1f}")
EOF
[[ -f "$work/load.log" ]] && grep -vE '^\s*$' "$work/load.log" | tail -n 20
rm -rf "$work"
! grep -q '"status": "\(failed\|timeout\)"' "$steps"
