#!/usr/bin/env bash
# Creates models/.venv-openai: the official `openai` Python client from PyPI (pinned), which
# tests/integration/openai.rs drives against the real server (tests/openai/client.py).
# Idempotent and fast when the venv is there (scripts/pinned-venv.sh).
#
# Usage: bash scripts/openai-venv.sh      then: models/.venv-openai/bin/python tests/openai/client.py URL [KEY]
set -euo pipefail
exec bash "$(dirname "$0")/pinned-venv.sh" .venv-openai 3.9 openai==3.57.0
