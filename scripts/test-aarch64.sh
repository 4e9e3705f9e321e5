#!/usr/bin/env bash
# Runs the docent-kernels tests for aarch64 (NEON) under qemu-user, on an x86-64 Debian 12
# machine. A developer script, not part of CI. Needs root (apt) the first time.
#
# What it does (idempotent):
#   1. adds the arm64 architecture and installs Debian's rustc-web/cargo-web with the arm64
#      standard library, the aarch64 cross linker and qemu-user (if missing);
#   2. builds a scratch crate in $WORK whose src/ and benches/ are symlinks to kernels/ (the
#      source stays in this repository), with Debian's /usr/bin/cargo (rustup has no aarch64
#      std here), and runs clippy on it for aarch64 (`-D warnings`, all targets);
#   3. runs the tests under qemu-aarch64 twice: `-cpu max` (NEON + dotprod) and
#      `-cpu cortex-a53` (NEON without dotprod, so the smull/sadalp fallback is dispatched).
#
# The binaries run against the multiarch libc6:arm64 (/lib/ld-linux-aarch64.so.1), not with
# `qemu-aarch64 -L /usr/aarch64-linux-gnu`: that cross loader (libc6-arm64-cross) is another
# build of glibc than the libc6:arm64 that libstd-rust-web-dev:arm64 pulls in, and the pair
# hangs in pthread_create (the test harness never gets past spawning its first thread).
#
# Usage: scripts/test-aarch64.sh [extra cargo test args, e.g. a test name filter]
# Environment: WORK (scratch dir, default /tmp/docent-kernels-aarch64), JOBS (default 1).
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
work="${WORK:-/tmp/docent-kernels-aarch64}"
jobs="${JOBS:-1}"
cargo=/usr/bin/cargo

need=()
dpkg --print-foreign-architectures | grep -qx arm64 || need+=(arch)
pkgs=(rustc-web cargo-web rust-web-clippy libstd-rust-web-dev:arm64 libc6:arm64
    libgcc-s1:arm64 gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user)
for p in "${pkgs[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
if ((${#need[@]})); then
    echo "installing: ${need[*]}"
    dpkg --add-architecture arm64
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${pkgs[@]}"
fi
# Debian's compiler and its arm64 std must be the same version.
host_v="$(dpkg-query -W -f='${Version}' rustc-web)"
std_v="$(dpkg-query -W -f='${Version}' libstd-rust-web-dev:arm64)"
[[ "$host_v" == "$std_v" ]] || {
    echo "rustc-web $host_v and libstd-rust-web-dev:arm64 $std_v differ" >&2
    exit 1
}

# The scratch crate: kernels' manifest without the workspace inheritance, the workspace's
# lock file (same dependency versions), src/ and benches/ linked to the repository.
mkdir -p "$work"
cat >"$work/Cargo.toml" <<'EOF'
[package]
name = "docent-kernels"
version = "0.1.0"
edition = "2021"
publish = false

[lib]
doctest = false

[[bench]]
name = "kernels"
harness = false

[dependencies]
half = "2"
rayon = "1"

# As the workspace builds the kernels: optimised, no debug assertions or overflow checks.
[profile.dev]
opt-level = 3
debug = false
debug-assertions = false
overflow-checks = false

[workspace]
EOF
ln -sfn "$repo/kernels/src" "$work/src"
ln -sfn "$repo/kernels/benches" "$work/benches"
[[ -f "$work/Cargo.lock" ]] || cp "$repo/Cargo.lock" "$work/Cargo.lock"

export CARGO_TARGET_DIR="$work/target"
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
# Use the Debian toolchain (and its cargo-clippy) even when rustup's proxies are in PATH.
export PATH="/usr/bin:$PATH" RUSTC=/usr/bin/rustc RUSTDOC=/usr/bin/rustdoc
unset RUSTUP_TOOLCHAIN QEMU_LD_PREFIX

cd "$work"
nice -n 10 "$cargo" clippy --target aarch64-unknown-linux-gnu --all-targets -j "$jobs" -- -D warnings
status=0
for cpu in max cortex-a53; do
    echo "=== qemu-aarch64 -cpu $cpu"
    export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -cpu $cpu"
    nice -n 10 "$cargo" test --target aarch64-unknown-linux-gnu -j "$jobs" "$@" || status=1
done
exit "$status"
