#!/usr/bin/env bash
# Runs a command with a real Qdrant server beside it when one is built:
#
#   bash scripts/with-qdrant.sh cargo test --workspace
#
# The binary: $QDRANT_BIN, else the newest $QDRANT_HOME/bin/qdrant-* (QDRANT_HOME defaults
# to ~/.cache/docent-qdrant; scripts/qdrant-build.sh puts it there). It is started on free
# loopback ports with a fresh storage folder, QDRANT_URL (its gRPC URL) is exported for
# the command (the store contract's server cases and the replica test read it), and the
# server is stopped afterwards. Without a binary the command runs alone and the server
# cases print SKIP. A QDRANT_URL already set is used as it is.
set -euo pipefail
if [ -n "${QDRANT_URL:-}" ]; then
    echo "with-qdrant: using the server at $QDRANT_URL"
    exec "$@"
fi
home="${QDRANT_HOME:-$HOME/.cache/docent-qdrant}"
bin="${QDRANT_BIN:-$(ls -1 "$home"/bin/qdrant-* 2>/dev/null | sort -V | tail -1 || true)}"
if [ -z "$bin" ] || [ ! -x "$bin" ]; then
    echo "with-qdrant: SKIP server cases: no Qdrant binary (scripts/qdrant-build.sh builds one from source)"
    exec "$@"
fi
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
http=$(free_port); grpc=$(free_port)
while [ "$grpc" = "$http" ]; do grpc=$(free_port); done
dir=$(mktemp -d)
QDRANT__SERVICE__HOST=127.0.0.1 QDRANT__SERVICE__HTTP_PORT=$http QDRANT__SERVICE__GRPC_PORT=$grpc \
QDRANT__STORAGE__STORAGE_PATH="$dir/storage" QDRANT__STORAGE__SNAPSHOTS_PATH="$dir/snapshots" \
QDRANT__TELEMETRY_DISABLED=true QDRANT__LOG_LEVEL=WARN \
    "$bin" > "$dir/qdrant.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 1 100); do
    if python3 -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$http/readyz', timeout=1)" 2>/dev/null; then
        break
    fi
    if ! kill -0 $pid 2>/dev/null; then
        echo "with-qdrant: the server did not start:" >&2; tail -20 "$dir/qdrant.log" >&2; exit 1
    fi
    sleep 0.2
done
version=$("$bin" --version 2>/dev/null | head -1 || echo "$bin")
export QDRANT_URL="http://127.0.0.1:$grpc"
echo "with-qdrant: $version at $QDRANT_URL (REST :$http)"
"$@"
