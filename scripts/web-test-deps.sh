#!/usr/bin/env bash
# What the web page's browser test (tests/integration/web.rs) needs: Debian's Chromium
# (/usr/bin/chromium, from apt; no browser download), playwright-core and axe-core, pinned in
# tests/web/package-lock.json (npm ci). Idempotent: when all are there it only checks.
# CHROMIUM=/path/to/chromium uses another Chromium instead of the apt package.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
web=$root/tests/web
chromium=${CHROMIUM:-/usr/bin/chromium}

die() { echo "web-deps: $*" >&2; exit 1; }
say() { echo "web-deps: $*"; }

as_root() {
    if [ "$(id -u)" = 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        die "need root to run: $* (or install it yourself)"
    fi
}

if [ ! -x "$chromium" ]; then
    command -v apt-get >/dev/null 2>&1 || die "$chromium is missing and apt-get is not available: install Chromium, or set CHROMIUM=/path/to/it"
    say "installing Debian's chromium (apt-get)"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium
    [ -x "$chromium" ] || die "apt-get did not install $chromium"
fi

command -v node >/dev/null 2>&1 || die "node (20 or newer) and npm are needed for the browser test"
major=$(node -p 'process.versions.node.split(".")[0]')
[ "$major" -ge 20 ] || die "node $(node --version) is too old: playwright-core needs node 20 or newer"

# npm ci only when node_modules does not match the lock file
stamp=$web/node_modules/.docent-lock
if [ -f "$web/node_modules/playwright-core/package.json" ] && cmp -s "$web/package-lock.json" "$stamp"; then
    exit 0
fi
command -v npm >/dev/null 2>&1 || die "npm is needed to install playwright-core"
say "npm ci in tests/web (playwright-core, axe-core; no browser download)"
(cd "$web" && PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci --no-audit --no-fund --loglevel=error)
cp "$web/package-lock.json" "$stamp"
