#!/usr/bin/env bash
# `make compose-test`: the demo stack of docker-compose.yml built and run for real, then checked
# through its published port as a user uses it (docs/docker.md says what was run and what it
# showed):
#
#   bash scripts/compose-test.sh              # the images as a user builds them (cargo in Docker)
#   bash scripts/compose-test.sh --prebuilt   # the runtime stage over `cargo build --release` here
#   bash scripts/compose-test.sh --images     # only the engine and the base images
#
# 1. A Docker engine: the one running, else Debian's docker.io started here as root
#    (`dockerd --storage-driver=vfs --iptables=false`, with one NAT rule of its own so that
#    builds reach the package registries), stopped again at the end. Compose v2 and buildx
#    come from Debian's packages (pinned and checked) when the client has none.
# 2. Base images made locally, for machines that cannot reach Docker Hub:
#    debian:bookworm-slim (mmdebstrap), rust:1.95.0-slim-bookworm (that image plus this
#    machine's Rust 1.95 toolchain), qdrant/qdrant:v1.18.3 (that image plus the server
#    scripts/qdrant-build.sh builds from source). An image already present is kept.
# 3. `docker compose build` and `up`, then: Qdrant and docent healthy, ingest-demo exit 0; a
#    question over the Rust Book answered with citations that resolve to stored chunks, JSON
#    and streamed; an upload answerable afterwards; every document kept across `restart
#    docent` and `down` + `up`; `down -v` removes them; the web page in a real browser; no
#    error in docent's logs. Image sizes and each step's time are printed at the end.
#
# The compose file and the Dockerfile are used as they are: the test sets only build
# arguments (--prebuilt), the project name (docent-compose-test, so a user's own `docent`
# stack is left alone) and the published port.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
MODE=build
for a in "$@"; do
    case "$a" in
        --prebuilt) MODE=prebuilt ;;
        --images) MODE=images ;;
        *) echo "usage: $0 [--prebuilt | --images]" >&2; exit 2 ;;
    esac
done

KEY=docent-demo-key-change-me
PROJECT=docent-compose-test
STATE=$(mktemp -d /tmp/compose-test.XXXXXX)
TIMES=$STATE/times
QDRANT_TAG=v1.18.3
RUST_TAG=1.95.0-slim-bookworm
STARTED_ENGINE=0
NAT_RULE=(-t nat -s 172.16.0.0/12 ! -o docker0 -j MASQUERADE)
NAT_ADDED=0
# Debian trixie's Compose v2 and buildx (the client plugins; bookworm has Compose v1 only,
# which cannot read the compose specification's `name` and bind options)
COMPOSE_DEB=pool/main/d/docker-compose/docker-compose_2.26.1-4_amd64.deb
COMPOSE_SHA=47681197cb2b1ab88206b42a1a92fc75f50d9530a6322d03494a473eed0408ea
BUILDX_DEB=pool/main/d/docker-buildx/docker-buildx_0.13.1+ds1-3_amd64.deb
BUILDX_SHA=fcf8c48204d1603c8f209451d7827eb91bf30759578baf7704e9e1a87e5f1d7f
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

log() { printf '[compose-test %s] %s\n' "$(date +%T)" "$*"; }
die() { log "FAIL: $*"; exit 1; }
# step NAME COMMAND...: runs it and records its time
step() {
    local name=$1 t0
    shift
    t0=$(date +%s)
    log "$name"
    "$@"
    printf '%-58s %5d s\n' "$name" $(($(date +%s) - t0)) >>"$TIMES"
}
compose() { docker compose -p "$PROJECT" "$@"; }

cleanup() {
    local rc=$?
    if [ "$MODE" != images ] && docker info >/dev/null 2>&1; then
        compose logs --no-color >"$STATE/compose.log" 2>&1 || true
        compose down -v --remove-orphans >/dev/null 2>&1 || true
    fi
    if [ "$NAT_ADDED" = 1 ]; then iptables -D POSTROUTING "${NAT_RULE[@]}" 2>/dev/null || true; fi
    if [ "$STARTED_ENGINE" = 1 ] && [ -f "$STATE/dockerd.pid" ]; then
        kill "$(cat "$STATE/dockerd.pid")" 2>/dev/null || true
        sleep 3
    fi
    if [ -f "$TIMES" ]; then
        echo
        echo "step times:"
        cat "$TIMES"
    fi
    echo "logs and state: $STATE"
    exit $rc
}
trap cleanup EXIT

need_root() { [ "$(id -u)" = 0 ] || die "$1 needs root (or a running Docker engine)"; }

install_plugin() { # NAME DEB SHA
    local dir=/usr/local/lib/docker/cli-plugins
    [ -x "$dir/docker-$1" ] && return 0
    need_root "installing docker $1"
    curl -fsS --max-time 300 -o "$STATE/$1.deb" "$DEBIAN_MIRROR/$2"
    echo "$3  $STATE/$1.deb" | sha256sum -c --quiet
    rm -rf "$STATE/$1" && dpkg -x "$STATE/$1.deb" "$STATE/$1"
    install -D -m 0755 "$STATE/$1/usr/libexec/docker/cli-plugins/docker-$1" "$dir/docker-$1"
}

engine() {
    if ! docker info >/dev/null 2>&1; then
        need_root "starting a Docker engine"
        if ! command -v dockerd >/dev/null || ! command -v mmdebstrap >/dev/null; then
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io mmdebstrap >"$STATE/apt.log" 2>&1 ||
                die "apt-get install docker.io mmdebstrap (see $STATE/apt.log)"
        fi
        dockerd --storage-driver=vfs --iptables=false --pidfile "$STATE/dockerd.pid" \
            >"$STATE/dockerd.log" 2>&1 &
        STARTED_ENGINE=1
        for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
        docker info >/dev/null 2>&1 || die "dockerd did not start (see $STATE/dockerd.log)"
        # without its own iptables rules the engine gives containers no way out: one NAT rule
        # for Docker's address pools, so that builds reach the registries
        sysctl -qw net.ipv4.ip_forward=1
        if ! iptables -C POSTROUTING "${NAT_RULE[@]}" 2>/dev/null; then
            iptables -A POSTROUTING "${NAT_RULE[@]}" && NAT_ADDED=1
        fi
    fi
    docker compose version >/dev/null 2>&1 || install_plugin compose "$COMPOSE_DEB" "$COMPOSE_SHA"
    docker buildx version >/dev/null 2>&1 || install_plugin buildx "$BUILDX_DEB" "$BUILDX_SHA"
    log "engine: $(docker version --format '{{.Server.Version}}'), $(docker compose version --short 2>/dev/null || docker compose version)"
}

has_image() { docker image inspect "$1" >/dev/null 2>&1; }

debian_image() {
    has_image debian:bookworm-slim && return 0
    command -v mmdebstrap >/dev/null || die "mmdebstrap is missing (apt-get install mmdebstrap)"
    # the CAs this machine adds to Debian's (/usr/local/share/ca-certificates) are trusted
    # in the image too, so that builds behind a TLS-inspecting proxy reach the registries
    local hooks=()
    if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
        hooks=(--customize-hook='copy-in /usr/local/share/ca-certificates /usr/local/share'
            --customize-hook='chroot "$1" update-ca-certificates')
    fi
    mmdebstrap --variant=minbase --include=ca-certificates "${hooks[@]}" bookworm "$STATE/bookworm.tar" \
        "deb $DEBIAN_MIRROR bookworm main" "deb $DEBIAN_MIRROR bookworm-updates main" \
        "deb ${DEBIAN_MIRROR%/debian}/debian-security bookworm-security main" >"$STATE/mmdebstrap.log" 2>&1 ||
        die "mmdebstrap (see $STATE/mmdebstrap.log)"
    docker import -c 'CMD ["bash"]' \
        -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        "$STATE/bookworm.tar" debian:bookworm-slim >/dev/null
    rm -f "$STATE/bookworm.tar"
}

# the Rust image's layout (RUSTUP_HOME, CARGO_HOME, cargo on PATH), with this machine's
# toolchain in place of rustup's download
rust_image() {
    has_image "rust:$RUST_TAG" && return 0
    local sysroot ctx
    sysroot=$(rustc +1.95.0 --print sysroot 2>/dev/null || rustc --print sysroot)
    "$sysroot/bin/rustc" --version | grep -q '^rustc 1\.95\.' || die "no Rust 1.95 toolchain here ($sysroot)"
    ctx=$STATE/rust-image
    mkdir -p "$ctx"
    cp -al "$sysroot" "$ctx/toolchain" 2>/dev/null || cp -a "$sysroot" "$ctx/toolchain"
    rm -rf "$ctx/toolchain/share/doc"
    cat >"$ctx/Dockerfile" <<'EOF'
FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
COPY toolchain/ /usr/local/rustup/toolchains/1.95.0-x86_64-unknown-linux-gnu/
ENV RUSTUP_HOME=/usr/local/rustup CARGO_HOME=/usr/local/cargo \
    PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
RUN mkdir -p /usr/local/cargo/bin \
 && for b in /usr/local/rustup/toolchains/1.95.0-x86_64-unknown-linux-gnu/bin/*; do \
      ln -s "$b" /usr/local/cargo/bin/; done \
 && cargo --version && rustc --version
EOF
    docker build -q -t "rust:$RUST_TAG" "$ctx" >/dev/null
    rm -rf "$ctx"
}

qdrant_image() {
    has_image "qdrant/qdrant:$QDRANT_TAG" && return 0
    local bin=${QDRANT_BIN:-${QDRANT_HOME:-$HOME/.cache/docent-qdrant}/bin/qdrant-${QDRANT_TAG#v}}
    if [ ! -x "$bin" ]; then
        [ -n "${QDRANT_SRC:-}" ] ||
            die "no Qdrant $QDRANT_TAG server at $bin: set QDRANT_SRC to its source (github.com/qdrant/qdrant at $QDRANT_TAG) to build it, or QDRANT_BIN"
        bash scripts/qdrant-build.sh "$QDRANT_SRC"
    fi
    local ctx=$STATE/qdrant-image
    mkdir -p "$ctx"
    cp "$bin" "$ctx/qdrant"
    # the official image's layout: /qdrant/qdrant, storage in /qdrant/storage
    cat >"$ctx/Dockerfile" <<'EOF'
FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates libunwind8 tzdata \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /qdrant
COPY qdrant /qdrant/qdrant
RUN mkdir -p /qdrant/storage /qdrant/snapshots && /qdrant/qdrant --version
ENV RUN_MODE=production TZ=Etc/UTC
EXPOSE 6333 6334
CMD ["./qdrant"]
EOF
    docker build -q -t "qdrant/qdrant:$QDRANT_TAG" "$ctx" >/dev/null
    rm -rf "$ctx"
}

build() {
    if [ "$MODE" = prebuilt ]; then
        cargo build --release --locked --bin docent
        install -D -m 0755 "${CARGO_TARGET_DIR:-target}/release/docent" .docker-prebuilt/docent
        compose build --build-arg DOCENT_BINARY_FROM=prebuilt docent
    else
        compose build docent
    fi
}

# NAME STATE: waits until the service's container reports STATE (healthy / exited)
wait_for() {
    local id s
    for _ in $(seq 1 600); do
        id=$(compose ps -a -q "$1" 2>/dev/null | head -1)
        if [ -n "$id" ]; then
            s=$(docker inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}' "$id")
            [ "$s" = "$2" ] && return 0
            [ "$2" = healthy ] && [ "$s" = exited ] && die "$1 exited ($(docker inspect -f '{{.State.ExitCode}}' "$id"))"
        fi
        sleep 1
    done
    die "$1 not $2 after 10 minutes"
}

ingest_done() {
    wait_for ingest-demo exited
    local code
    code=$(docker inspect -f '{{.State.ExitCode}}' "$(compose ps -a -q ingest-demo | head -1)")
    [ "$code" = 0 ] || die "ingest-demo exited $code"
    compose logs --no-color ingest-demo | tail -3
}

up_all() {
    compose up -d
    wait_for qdrant healthy
    wait_for docent healthy
}

check() { python3 scripts/compose_check.py "$URL" "$KEY" "$@"; }

web_page() {
    if [ ! -d tests/web/node_modules/playwright-core ]; then
        bash scripts/web-test-deps.sh
    fi
    node tests/web/e2e.mjs "$URL" keys --key "$KEY" --out "$STATE"
}

# docent's logs so far (a `down` removes the container and its logs)
save_logs() { compose logs --no-color docent >>"$STATE/docent.log" 2>&1 || true; }

no_errors() {
    save_logs
    local n
    n=$(grep -cE '"level":"ERROR"| ERROR ' "$STATE/docent.log" || true)
    [ "$n" = 0 ] || { grep -E '"level":"ERROR"| ERROR ' "$STATE/docent.log" | head -5; die "$n error line(s) in docent's logs"; }
    log "ok: no error in docent's logs ($(wc -l <"$STATE/docent.log") lines)"
}

# vfs (the storage driver an engine started here uses) copies every layer and container in
# full: the images and build cache take about 10 GB, the running stack about 6 GB more
disk_space() {
    local root free
    root=$(docker info --format '{{.DockerRootDir}}' 2>/dev/null || echo /var/lib/docker)
    free=$(df -Pk "$root" | awk 'NR==2 {print int($4 / 1048576)}')
    [ "$free" -ge "${COMPOSE_TEST_MIN_GB:-10}" ] ||
        die "only $free GB free under $root; the stack needs about 10 GB more with vfs once its images exist (about 20 GB from nothing) (COMPOSE_TEST_MIN_GB)"
    log "disk: $free GB free under $root"
}

step "engine" engine
disk_space
step "base image debian:bookworm-slim" debian_image
[ "$MODE" = prebuilt ] || step "base image rust:$RUST_TAG" rust_image
step "image qdrant/qdrant:$QDRANT_TAG" qdrant_image
if [ "$MODE" = images ]; then
    docker image ls
    exit 0
fi

PORT=${DOCENT_PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
export DOCENT_PORT=$PORT
URL=http://127.0.0.1:$PORT
compose down -v --remove-orphans >/dev/null 2>&1 || true
step "docker compose build ($MODE)" build
step "compose up: qdrant and docent healthy" up_all
step "ingest-demo: the demo corpus ingested (exit 0)" ingest_done
step "a question over the Rust Book, JSON and streamed" check ask
step "an upload, answerable afterwards" check upload
DOCS=$(check count)
log "documents stored: $DOCS"
step "web page in a real browser" web_page
restart_docent() { compose restart docent && wait_for docent healthy && check kept "$DOCS"; }
step "compose restart docent: every document kept" restart_docent
# passage block files in docent's data volume (computed in the background from the start)
blocks() { compose exec -T docent sh -c 'find /var/lib/docent/passages -name "*.kv" 2>/dev/null | wc -l'; }
down_up() {
    local before after
    save_logs
    before=$(blocks)
    [ "$before" -gt 0 ] || die "no passage block was written before the down"
    { compose down && compose up -d qdrant docent && wait_for docent healthy && check kept "$DOCS"; } ||
        die "compose down + up failed"
    after=$(blocks) || die "no passage block count after the up"
    [ "$after" -ge "$before" ] || die "passage blocks: $before before the down, $after after"
    log "ok: the passage blocks kept in the docent-data volume ($before before, $after after)"
}
step "compose down + up: every document and passage block kept" down_up
step "no error in docent's logs" no_errors
down_v() {
    compose down -v
    compose up -d qdrant docent && wait_for docent healthy
    local n
    n=$(check count)
    [ "$n" = 0 ] || die "$n documents after down -v"
    log "ok: down -v removed every document"
}
step "compose down -v: the documents gone" down_v
echo
echo "images:"
docker image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' |
    grep -E "^(docent|qdrant/qdrant|rust|debian):" || true
log "PASS"
