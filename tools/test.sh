#!/usr/bin/env bash
# falcon's one test entry point. Installs what it needs, then runs: rustfmt, clippy (all
# targets, all features, warnings denied), every test of the workspace, the benchmarks in a
# short mode (so they cannot rot), and a smoke run of the main command.
# Ends with a line `N passed, N failed` counting the stages.
set -uo pipefail
cd "$(dirname "$0")/.."

passed=0
failed=0
failures=()
stage() {
    local name=$1
    shift
    echo "::: $name"
    if "$@"; then
        passed=$((passed + 1))
    else
        failed=$((failed + 1))
        failures+=("$name")
        echo "::: FAILED: $name"
    fi
}

# --- what the stages need -------------------------------------------------------------
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
if ! command -v cargo >/dev/null; then
    echo "cargo is not installed; install Rust (rustup) first" >&2
    exit 2
fi
for comp in rustfmt clippy; do
    if ! rustup component list --installed 2>/dev/null | grep -q "^$comp"; then
        rustup component add "$comp"
    fi
done

# --- stages ---------------------------------------------------------------------------
stage "cargo fmt --check" cargo fmt --all -- --check
stage "cargo clippy (all targets, all features, -D warnings)" \
    cargo clippy --workspace --all-targets --all-features -- -D warnings
stage "cargo test (workspace)" cargo test --workspace
stage "benchmarks, quick mode" env FALCON_BENCH_QUICK=1 \
    cargo bench -p falcon-bench --bench transport -- --test
stage "main command smoke run" cargo run --release -- train --iters 30

echo
for f in "${failures[@]}"; do echo "failed stage: $f"; done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
