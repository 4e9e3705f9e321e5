#!/usr/bin/env bash
# The store's reader race, measured: runs the contract cases
# `readers_see_exactly_one_version_while_it_is_replaced` and
# `readers_see_one_whole_version_under_cpu_load` (200 rounds each run) RUNS and
# STRESS_RUNS times (default 200 each) beside one CPU burner per core, and prints how many
# runs passed, with the CPU they ran on.
# Usage: scripts/stress-store.sh [RUNS [STRESS_RUNS]]
set -euo pipefail
RUNS=${1:-200}
STRESS_RUNS=${2:-$RUNS}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/docent-target}
bin=$(cargo test --workspace --test contract --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "contract" and m.get("executable"):
        print(m["executable"])')
[ -x "$bin" ] || { echo "stress-store: could not build the contract tests" >&2; exit 1; }
cores=$(nproc)
burners=()
for _ in $(seq "$cores"); do
    (while :; do :; done) &
    burners+=($!)
done
trap 'kill "${burners[@]}" 2>/dev/null || true' EXIT
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $cores cores, $cores burners beside the tests"
for case in readers_see_exactly_one_version_while_it_is_replaced readers_see_one_whole_version_under_cpu_load; do
    runs=$RUNS
    [ "$case" = readers_see_one_whole_version_under_cpu_load ] && runs=$STRESS_RUNS
    pass=0 fail=0 start=$(date +%s)
    for i in $(seq "$runs"); do
        if out=$("$bin" --exact "edge::$case" 2>&1); then
            pass=$((pass + 1))
        else
            fail=$((fail + 1))
            echo "run $i failed:" >&2
            grep -E "saw|panicked" <<<"$out" | head -3 >&2
        fi
    done
    echo "$case: $pass of $runs runs passed ($fail failed) in $(( $(date +%s) - start )) s"
done
