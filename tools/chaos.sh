#!/usr/bin/env bash
# chaos.sh: the chaos run at full length (CI runs a short one in `cargo test`).
# 4 workers and 2 servers train as separate processes while a driver kills -9 and restarts
# random workers and server 1 and every worker's server links are dropped every 1.5 s; the
# job must finish, no update may be applied twice, and accuracy must stay within 1 point of
# an undisturbed run. Then the same chaos over constant gradients whose values count them.
#
# usage: tools/chaos.sh [SECONDS] [SEED]    (default 120 s, seed 7; release build)
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-120}
SEED=${2:-7}
FALCON_CHAOS_SECS=$SECS FALCON_CHAOS_SEED=$SEED \
    cargo test --release -p falcon --test chaos -- --nocapture
