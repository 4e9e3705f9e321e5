#!/usr/bin/env bash
# Creates models/.venv-peer, the Python environment of the Python peers of `docent bench`
# (scripts/bench_ingest_peer.py, scripts/bench_query_peer.py), from PyPI with pinned versions.
# Separate from models/.venv (the export environment of setup-models.sh) so neither can break
# the other.
# Idempotent: does nothing when the venv exists and its stamp matches the pins (scripts/pinned-venv.sh).
#
#   semantic-text-splitter 0.33.1 = Python bindings of text-splitter 0.33.1 (what docent-ingest uses)
#   onnxruntime / tokenizers / numpy: the versions setup-models.sh uses for the export
#   qdrant-client: local mode (pure Python, in-process), the ingest peer's vector store
#   qdrant-edge-py 0.7.2: the Python binding of the engine docent embeds (qdrant-edge 0.7.2), the
#     query peer's vector store (bench_query_peer.py), with fastapi + uvicorn as its web stack
#
# Usage: bash scripts/bench-peer-venv.sh      then: models/.venv-peer/bin/python scripts/bench_ingest_peer.py ...
set -euo pipefail
exec bash "$(dirname "$0")/pinned-venv.sh" .venv-peer 3.11 \
  onnxruntime==1.24.4 tokenizers==0.22.1 numpy==2.3.5 semantic-text-splitter==0.33.1 \
  qdrant-client==1.20.0 qdrant-edge-py==0.7.2 fastapi==0.165.0 uvicorn==0.54.0
