#!/usr/bin/env bash
# Builds the fuzz targets and runs each for FUZZ_SECONDS (default 600), FUZZ_JOBS at a
# time (default: the number of cores). Seeds empty corpora from shared/data; prints one
# line per target: executions, rate, corpus size, crashes. Exits 1 if any target crashed.
# `scripts/fuzz.sh --pack` writes fuzz/corpus/ back into fuzz/corpus.tar.xz.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${SHARED:-$(cd .. && pwd)/shared}
SECONDS_EACH=${FUZZ_SECONDS:-600}
JOBS=${FUZZ_JOBS:-$(nproc)}
TARGETS=${FUZZ_TARGETS:-"load_pdf load_docx load_markup split citations stop_stream safety"}
export FUZZ_TARGET_DIR=${FUZZ_TARGET_DIR:-$HOME/.cache/docent-fuzz-target}
export RUSTC_BOOTSTRAP=1
# The corpora travel as one archive (fuzz/corpus.tar.xz: 37 MB of files, under 1 MB packed,
# so a clone, and the working tree a GPU machine receives, stays small): unpacked into
# fuzz/corpus/ (ignored by git) when that is missing; `--pack` writes the archive back after
# a run and `cargo fuzz cmin`.
pack() {
    tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C fuzz -cf - corpus |
        xz -6 -T1 > fuzz/corpus.tar.xz.tmp
    mv fuzz/corpus.tar.xz.tmp fuzz/corpus.tar.xz
    echo "fuzz/corpus.tar.xz: $(find fuzz/corpus -type f | wc -l) files, $(stat -c %s fuzz/corpus.tar.xz) bytes"
}
if [ "${1:-}" = "--pack" ]; then pack; exit 0; fi
[ -d fuzz/corpus ] || tar -C fuzz -xJf fuzz/corpus.tar.xz
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
P="$SHARED/data/parsers/unstructured"

seed() { # target, files...
    local dir="fuzz/corpus/$1"; shift
    mkdir -p "$dir"
    [ -n "$(ls -A "$dir")" ] && return 0
    for f in "$@"; do [ -f "$f" ] && cp "$f" "$dir/seed-$(basename "$f")"; done
    return 0
}
seed_prefixed() { # target, prefix byte (octal), files...
    local dir="fuzz/corpus/$1" b=$2; shift 2
    for f in "$@"; do
        [ -f "$f" ] && { printf "\\$b"; cat "$f"; } > "$dir/seed-$b-$(basename "$f")"
    done
    return 0
}
seed load_pdf "$P/rotated-page-90.pdf" "$P/pdf/fake-memo.pdf" "$P/pdf/embedded-link.pdf" "$P/pdf/header-test-doc.pdf" "$P/pdf/password.pdf" "$P/pdf/list-item-example.pdf"
seed load_docx "$P"/fake.docx "$P"/fake_table.docx "$P"/page-breaks.docx "$P"/handbook-1p.docx "$P"/docx-tables.docx "$P"/language-docs/eng_spa_mult.docx
if [ -z "$(ls -A fuzz/corpus/load_markup 2>/dev/null)" ]; then
    mkdir -p fuzz/corpus/load_markup
    seed_prefixed load_markup 000 "$P/umlauts-non-utf8.md" "$P/simple-table.md"
    seed_prefixed load_markup 001 "$P/codeblock.md" "$P/language-docs/eng_spa_mult.md"
    seed_prefixed load_markup 002 "$P/fake-html.html" "$P/fake-html-cp1252.html" "$P/fake-html-with-footer-and-header.html" "$P/language-docs/eng_spa_mult.html"
fi
seed split "$P/codeblock.md" "$P/simple-table.md" "$P/language-docs/eng_spa_mult.md"
seed citations fuzz/seeds/citations/*
seed stop_stream fuzz/seeds/citations/*
if [ -z "$(ls -A fuzz/corpus/safety 2>/dev/null)" ]; then
    mkdir -p fuzz/corpus/safety
    head -n 40 "$SHARED/data/safety/prompt-injections-deepset/test.jsonl" | python3 -c '
import json, sys
for i, line in enumerate(sys.stdin):
    open(f"fuzz/corpus/safety/seed-deepset-{i}", "w").write(json.loads(line)["text"])
'
fi

(cd fuzz && cargo fuzz build --sanitizer none --target-dir "$FUZZ_TARGET_DIR")

run_one() {
    local t=$1 log="$FUZZ_TARGET_DIR/fuzz-$1.log"
    mkdir -p "fuzz/artifacts/$t"
    (cd fuzz && cargo fuzz run --sanitizer none --target-dir "$FUZZ_TARGET_DIR" "$t" -- \
        -max_total_time="$SECONDS_EACH" -timeout=20 -rss_limit_mb=4096 -max_len=65536 \
        -print_final_stats=1 > "$log" 2>&1) || true
    local runs rate crashes corpus
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
    rate=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
    corpus=$(ls "fuzz/corpus/$t" | wc -l)
    crashes=$(ls "fuzz/artifacts/$t" | wc -l)
    printf '%-12s %12s execs %8s/s  corpus %6s  crashes %s\n' "$t" "$runs" "$rate" "$corpus" "$crashes"
}
export -f run_one
export SECONDS_EACH
lscpu | grep -m1 'Model name' || true
printf '%s\n' $TARGETS | xargs -P "$JOBS" -I{} bash -c 'run_one {}'
status=0
for t in $TARGETS; do
    if [ -n "$(ls -A "fuzz/artifacts/$t" 2>/dev/null)" ]; then
        echo "crash inputs in fuzz/artifacts/$t:"; ls "fuzz/artifacts/$t"; status=1
    fi
done
exit $status
