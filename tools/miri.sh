#!/usr/bin/env bash
# Miri over the lock-free core's logic on plain memory: the shm ring (push, pop, wrap-around
# behind PAD records, a full ring, hostile bytes and cursors, a producer and a consumer
# thread), the shard meta block's seqlock (write/read sections, the lock-free staleness
# check, a writer and readers on threads) and the helper threads that share large copies
# and applies (a pass handed to parked threads, its lifetime erased). Miri reports
# undefined behaviour in the unsafe code and data races between threads; the threaded tests
# run under several schedules.
#
# Miri cannot map a memfd, so the ring's memfd-backed tests are ignored under it (visibly:
# "ignored, maps a memfd"); their heap-backed twins run the same protocol code.
#
# Usage: tools/miri.sh   (env: CARGO_TARGET_DIR, default target/miri; MIRI_SEEDS, default
# 0..8, the schedules each threaded test runs under). Exits 0 when every run passes.
set -uo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/miri}
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
seeds=${MIRI_SEEDS:-0..8}

# --- what it needs: a nightly toolchain with miri and rust-src ---------------------------
if ! command -v rustup >/dev/null; then
    echo "::: miri: rustup is not installed; Miri needs a nightly toolchain from rustup" >&2
    exit 2
fi
if ! rustup run nightly rustc --version >/dev/null 2>&1; then
    echo "::: miri: installing the nightly toolchain"
    if ! rustup toolchain install nightly --profile minimal --component miri,rust-src; then
        echo "::: miri: no nightly toolchain can be had here (offline?); Miri cannot run" >&2
        exit 2
    fi
fi
sysroot=$(rustup run nightly rustc --print sysroot)
if ! cargo +nightly miri --version >/dev/null 2>&1 || [ ! -d "$sysroot/lib/rustlib/src/rust/library" ]; then
    echo "::: miri: adding the miri and rust-src components to nightly"
    if ! rustup +nightly component add miri rust-src; then
        echo "::: miri: the nightly toolchain has no miri component to be had; Miri cannot run" >&2
        exit 2
    fi
fi
cargo +nightly miri setup >/dev/null || {
    echo "::: miri: cargo miri setup failed (building Miri's sysroot)" >&2
    exit 2
}
echo "::: $(cargo +nightly miri --version)"

# --- the runs -------------------------------------------------------------------------
passed=0
failed=0
run() {
    local name=$1
    shift
    echo "::: miri: $name"
    if "$@"; then
        passed=$((passed + 1))
    else
        failed=$((failed + 1))
        echo "::: miri FAILED: $name"
    fi
}

run "transport ring (push, pop, wrap, full, hostile bytes)" \
    cargo +nightly miri test -p falcon-transport --lib ring::tests:: -- --skip producer_and_consumer
run "transport ring, producer and consumer threads, seeds $seeds" \
    env MIRIFLAGS="${MIRIFLAGS:-} -Zmiri-many-seeds=$seeds" \
    cargo +nightly miri test -p falcon-transport --lib ring::tests::producer_and_consumer
# The helper threads of `spread` park for good once started: Miri must not count them (or
# what they hold) as leaks when a test's main thread ends.
run "transport spread (work shared with helper threads), seeds 0..2" \
    env MIRIFLAGS="${MIRIFLAGS:-} -Zmiri-ignore-leaks -Zmiri-many-seeds=0..2" \
    cargo +nightly miri test -p falcon-transport --lib spread::tests::
run "engine meta block (layout, staleness bound)" \
    cargo +nightly miri test -p falcon-engine --lib meta::
run "engine meta seqlock, writer and reader threads, seeds $seeds" \
    env MIRIFLAGS="${MIRIFLAGS:-} -Zmiri-many-seeds=$seeds" \
    cargo +nightly miri test -p falcon-engine --test meta_seqlock

echo "::: miri: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
