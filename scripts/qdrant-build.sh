#!/usr/bin/env bash
# Builds a Qdrant server from a source folder you point at (a checkout or export of
# github.com/qdrant/qdrant at tag v1.18.3), for the server-mode tests and benchmarks:
#
#   bash scripts/qdrant-build.sh ~/src/qdrant-1.18.3
#
# Nothing of Qdrant's enters this repository. The source folder is copied, its few git
# dependencies are replaced by their crates.io releases (raft and raft-proto 0.7.0 for the
# pinned raft-rs commit, tonic 0.14 for Qdrant's fork; two calls into what only those forks
# have are replaced: the machines this is built on reach only the package registries), and
# it is built with Qdrant's own `perf` profile (release
# without fat LTO: about an hour on 2 cores instead of several). Needs protoc (Debian's
# protobuf-compiler). The binary lands in $QDRANT_HOME/bin/qdrant-<version>
# (QDRANT_HOME defaults to ~/.cache/docent-qdrant), where scripts/with-qdrant.sh finds it.
set -euo pipefail
src="${1:?usage: qdrant-build.sh QDRANT_SOURCE_DIR}"
home="${QDRANT_HOME:-$HOME/.cache/docent-qdrant}"
want="1.18.3"
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$src/Cargo.toml" | head -1)
if [ "$version" != "$want" ]; then
    echo "qdrant-build: $src is Qdrant $version; this script builds $want (the version the contract suite passed on; 1.19 needs rustc 1.97)" >&2
    exit 2
fi
command -v protoc >/dev/null || { echo "qdrant-build: protoc not found: apt-get install protobuf-compiler" >&2; exit 2; }
work="$home/src-$version"
mkdir -p "$home/bin"
if [ ! -f "$work/.docent-patched" ]; then
    rm -rf "$work"
    cp -r "$src" "$work"
    python3 - "$work/Cargo.toml" <<'PY'
import sys
p = sys.argv[1]
s = open(p).read()
raft = 'git = "https://github.com/tikv/raft-rs", rev = "aafb07c7bab439c6139926a77dfafc5b10e9bc84"'
assert s.count(raft) == 2, "raft-rs git dependencies not found where expected"
s = s.replace(raft + ",", 'version = "0.7.0",').replace(raft + " ,", 'version = "0.7.0",')
fork = 'tonic = { git = "https://github.com/qdrant/tonic", branch = "v0.14.6-qdrant" }'
assert fork in s, "the tonic fork patch not found"
s = s.replace(fork, "")
open(p, "w").write(s)
PY
    # the one call into the fork's API (an HTTP/2 reset-stream limit for internal channels
    # between cluster peers; a single node never opens them): dropped
    pool="$work/lib/api/src/grpc/dynamic_channel_pool.rs"
    grep -q '.http2_max_local_error_reset_streams(None);' "$pool"
    sed -i 's/\.connect_timeout(connection_timeout)$/.connect_timeout(connection_timeout);/; /\.http2_max_local_error_reset_streams(None);/d' "$pool"
    # raft-rs's pinned commit adds `protocompat` (one size helper over both codecs); the
    # 0.7.0 release lacks it: the entry's size is prost's encoded length (the same bytes)
    wal="$work/lib/storage/src/content_manager/consensus/consensus_wal.rs"
    grep -q 'use raft::protocompat::PbMessageExt as _;' "$wal"
    sed -i '/use raft::protocompat::PbMessageExt as _;/d; s/entry\.compute_size()\.into()/Message::encoded_len(\&entry) as u64/' "$wal"
    grep -q 'Message::encoded_len(&entry) as u64' "$wal"
    if grep -rn --include=Cargo.toml 'git *=' "$work" | grep -v '^\s*#'; then
        echo "qdrant-build: git dependencies left (above): this machine cannot fetch them" >&2
        exit 2
    fi
    touch "$work/.docent-patched"
fi
export CARGO_TARGET_DIR="$home/target"
(cd "$work" && cargo build --profile perf --bin qdrant)
cp "$CARGO_TARGET_DIR/perf/qdrant" "$home/bin/qdrant-$version.tmp"
mv "$home/bin/qdrant-$version.tmp" "$home/bin/qdrant-$version"
echo "qdrant-build: $home/bin/qdrant-$version"
