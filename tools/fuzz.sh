#!/usr/bin/env bash
# Runs the cargo-fuzz targets of fuzz/ (one per decoder of hostile input: frame headers,
# control packets, ring records, control and rendezvous messages, meta blocks, configuration
# strings and files, IDX files), each for a given time, one after the other.
#
#   tools/fuzz.sh [SECONDS_PER_TARGET (default 60)] [TARGET…]   (default: every target)
#
# Installs cargo-fuzz if it is missing. Uses the nightly toolchain when there is one, else
# stable with RUSTC_BOOTSTRAP=1 (cargo-fuzz needs nightly-only flags). Builds with debug
# assertions, so an arithmetic overflow is a crash too. Each target starts from its committed
# seeds (fuzz/seeds/TARGET, read only) plus what earlier runs found (fuzz/corpus/TARGET,
# ignored by git); a crashing input lands in fuzz/artifacts/TARGET. Prints per target the
# executions and crashes, and exits non-zero if any target crashed (or failed to build or run).
# Every crash found becomes a regression test in the crate that owns the decoder.
set -uo pipefail
cd "$(dirname "$0")/.."

secs=${1:-60}
[ $# -gt 0 ] && shift
if ! [[ $secs =~ ^[0-9]+$ ]] || [ "$secs" -eq 0 ]; then
    echo "usage: tools/fuzz.sh [SECONDS_PER_TARGET (default 60)] [TARGET…]" >&2
    exit 2
fi
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    for f in fuzz/fuzz_targets/*.rs; do
        targets+=("$(basename "$f" .rs)")
    done
fi
for t in "${targets[@]}"; do
    if [ ! -f "fuzz/fuzz_targets/$t.rs" ]; then
        echo "unknown fuzz target $t; the targets: $(cd fuzz/fuzz_targets && ls | sed 's/\.rs$//' | tr '\n' ' ')" >&2
        exit 2
    fi
done

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "::: installing cargo-fuzz"
    cargo install cargo-fuzz --locked || exit 2
fi
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    fuzz=(cargo +nightly fuzz)
else
    fuzz=(env RUSTC_BOOTSTRAP=1 cargo fuzz)
fi
# The fuzz crate is a workspace of its own with its own target directory, whatever the caller's.
unset CARGO_TARGET_DIR
opts=(--fuzz-dir fuzz -O -a)

echo "::: building the fuzz targets (${fuzz[*]})"
if ! "${fuzz[@]}" build "${opts[@]}"; then
    echo "::: the fuzz targets do not build"
    exit 1
fi

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
rows=()
crashed=0
for t in "${targets[@]}"; do
    mkdir -p "fuzz/corpus/$t" "fuzz/seeds/$t" "fuzz/artifacts/$t"
    echo "::: fuzzing $t for ${secs}s"
    log="$logs/$t.log"
    # -timeout: an input taking 10 s is a hang, reported as a crash; -rss_limit_mb: so is
    # memory beyond 2 GiB. The seeds directory comes second: libFuzzer reads it, writes
    # nothing there.
    "${fuzz[@]}" run "${opts[@]}" "$t" "fuzz/corpus/$t" "fuzz/seeds/$t" -- \
        -max_total_time="$secs" -print_final_stats=1 -timeout=10 -rss_limit_mb=2048 \
        >"$log" 2>&1
    rc=$?
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    if [ -z "$execs" ]; then
        # A crash ends the run before the final stats; the last status line has the count.
        execs=$(grep -o '^#[0-9]*' "$log" | tail -1 | tr -d '#')
    fi
    found=$(grep -c 'Test unit written to' "$log")
    if [ "$rc" -ne 0 ] && [ "$found" -eq 0 ]; then
        found=1
    fi
    if [ "$found" -gt 0 ]; then
        crashed=$((crashed + 1))
        echo "::: CRASH in $t (exit $rc):"
        grep -E 'panicked at|ERROR: |SUMMARY|Test unit written to' "$log" | head -20
        tail -40 "$log"
    fi
    rows+=("$(printf '%-14s %8ss %14s %8s' "$t" "$secs" "${execs:-?}" "$found")")
done

echo
printf '%-14s %9s %14s %8s\n' target time executions crashes
for r in "${rows[@]}"; do echo "$r"; done
if [ "$crashed" -gt 0 ]; then
    echo "::: $crashed target(s) crashed: the inputs are in fuzz/artifacts/"
    exit 1
fi
echo "::: no crash"
