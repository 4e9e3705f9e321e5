#!/usr/bin/env bash
# Creates a Python environment under models/ (or $DOCENT_MODELS_DIR) with pinned packages from
# PyPI, binary wheels only: the one recipe of scripts/bench-peer-venv.sh and
# scripts/openai-venv.sh, each environment separate so none can break another.
# Idempotent: does nothing when the venv exists and its stamp matches the pins and the Python version.
#
# Usage: bash scripts/pinned-venv.sh NAME MIN_PYTHON PIN...
#   e.g. bash scripts/pinned-venv.sh .venv-openai 3.9 openai==3.57.0   → models/.venv-openai
set -euo pipefail

[ $# -ge 3 ] || { echo "usage: $0 NAME MIN_PYTHON PIN..." >&2; exit 2; }
name=$1 min=$2
shift 2
root=$(cd "$(dirname "$0")/.." && pwd)
models=${DOCENT_MODELS_DIR:-$root/models}
py=${PYTHON:-python3}
venv=$models/$name
stamp=$venv/.docent-pins

die() { echo "$name: $*" >&2; exit 1; }

command -v "$py" >/dev/null 2>&1 || die "python3 is required"
"$py" -c "import sys; sys.exit(sys.version_info < tuple(map(int, '$min'.split('.'))))" \
  || die "Python $min or newer is required (found $("$py" -V 2>&1)); set PYTHON=/path/to/python3"

pins="$*"
want="$pins $("$py" -V 2>&1)"
if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi

echo "$name: creating $venv"
mkdir -p "$models"
"$py" -m venv --clear "$venv"
# shellcheck disable=SC2086
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --only-binary=:all: $pins \
  || die "installing $pins into $venv failed (is PyPI reachable?)"
echo "$want" > "$stamp"
echo "$name: ready: $venv/bin/python"
