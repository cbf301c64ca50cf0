#!/usr/bin/env bash
# falcon beside dmlc/ps-lite: the same worker loop (pull the whole model, grad = w - (rank+1),
# push it; serial, waited) on both, interleaved round by round. See README.md.
#
#   bench/pslite/run.sh [--sparse [--draw-in-loop] | --push-pull] [--rate RATE] [--quick]
#                       [--rounds N] [--src DIR] [--out FILE]
#
# --sparse: the key-value loop instead (a table of 1 000 000 one-float keys; each iteration
# pulls and pushes K random keys, K = 1 000 .. 1 000 000). Each worker draws 8 key sets
# before its loop and uses them in turn (ps-lite's own benchmark builds its keys before its
# loop too): the loop times the pushes and pulls. --draw-in-loop: a fresh set drawn in each
# iteration, inside the timed loop, on both sides.
# --push-pull: the dense loop with one push-pull per iteration on both sides (falcon's
# Worker::push_pull, ps-lite's ZPushPull), the push bringing the next iteration's values.
# --rate RATE (tc's units, e.g. 2gbit): over a link of that rate instead of loopback, 1 x 1
# over tcp: the scheduler and server in one network namespace, the worker in another, joined
# by a veth pair shaped with tbf both ways (root, ip and tc needed; else skipped).
# ps-lite's source comes from --src DIR, else $PSLITE_SRC, else a shallow clone of
# https://github.com/dmlc/ps-lite; it is built in a scratch directory
# (${TMPDIR:-/tmp}/falcon-pslite), never in the repository. Exit 77: skipped (no ps-lite
# source, or its build dependencies cannot be installed), said on stderr.
set -euo pipefail

ORIG_CMD="bench/pslite/run.sh${*:+ $*}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
SCRATCH="${TMPDIR:-/tmp}/falcon-pslite"

ROUNDS=5
QUICK=0
SRC="${PSLITE_SRC:-}"
OUT=""
SPARSE=0
SETS=8
PUSHPULL=0
RATE=""

usage() { sed -n '2,21p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
    case "$1" in
        --quick) QUICK=1; ROUNDS=1; shift ;;
        --sparse) SPARSE=1; shift ;;
        --draw-in-loop) SETS=0; shift ;;
        --push-pull) PUSHPULL=1; shift ;;
        --rate) RATE="${2:?--rate needs a rate, e.g. 2gbit}"; shift 2 ;;
        --rounds) ROUNDS="${2:?--rounds needs a number}"; shift 2 ;;
        --src) SRC="${2:?--src needs a directory}"; shift 2 ;;
        --out) OUT="${2:?--out needs a file}"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "run.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
done
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || { echo "run.sh: --rounds must be >= 1" >&2; exit 2; }
[[ $SPARSE -eq 0 && $SETS -eq 0 ]] &&
    { echo "run.sh: --draw-in-loop is an option of --sparse" >&2; exit 2; }
[[ $SPARSE -eq 1 && $PUSHPULL -eq 1 ]] &&
    { echo "run.sh: --push-pull is a dense loop; it does not go with --sparse" >&2; exit 2; }

say() { echo "== $*" >&2; }
skip() { echo "run.sh: SKIPPED: $*" >&2; exit 77; }
die() { echo "run.sh: FAILED: $*" >&2; exit 1; }

# ---- children: every process started here is killed on exit -----------------------------
PIDS=()
cleanup() {
    local p
    for p in "${PIDS[@]:-}"; do
        [[ -n "$p" ]] && kill "$p" 2>/dev/null || true
    done
    for p in "${PIDS[@]:-}"; do
        [[ -n "$p" ]] && wait "$p" 2>/dev/null || true
    done
    PIDS=()
}
# The shaped link's namespaces (--rate), removed on exit.
NS_SRV="falcon-pb-s$$"
NS_WRK="falcon-pb-w$$"
NETNS=0
cleanup_all() {
    cleanup
    if [[ $NETNS -eq 1 ]]; then
        ip netns del "$NS_SRV" 2>/dev/null || true
        ip netns del "$NS_WRK" 2>/dev/null || true
    fi
}
trap cleanup_all EXIT
trap 'cleanup_all; exit 130' INT
trap 'cleanup_all; exit 143' TERM

# ---- build dependencies (Debian packages) -----------------------------------------------
PKGS=(g++ make libzmq3-dev libprotobuf-dev protobuf-compiler git)
missing=()
for p in "${PKGS[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [[ ${#missing[@]} -gt 0 ]]; then
    say "installing ${missing[*]}"
    SUDO=""
    [[ "$(id -u)" -eq 0 ]] || SUDO="sudo -n"
    export DEBIAN_FRONTEND=noninteractive
    if ! { $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 ||
           { $SUDO apt-get update -qq >/dev/null 2>&1 &&
             $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1; }; }; then
        skip "could not install ${missing[*]} with apt-get (install them, then run again)"
    fi
fi
command -v cargo >/dev/null || skip "cargo not found (falcon cannot be built)"
command -v python3 >/dev/null || skip "python3 not found (used to pick free ports)"

# ---- ps-lite's source ----------------------------------------------------------------
mkdir -p "$SCRATCH"
if [[ -n "$SRC" ]]; then
    [[ -f "$SRC/include/ps/ps.h" && -f "$SRC/Makefile" ]] ||
        skip "'$SRC' (--src or PSLITE_SRC) is not a ps-lite checkout (no include/ps/ps.h, Makefile)"
    SRC="$(cd "$SRC" && pwd)"
    say "ps-lite source: $SRC (given)"
elif [[ -f "$SCRATCH/src/include/ps/ps.h" ]]; then
    SRC="$SCRATCH/src"
    say "ps-lite source: $SRC (an earlier clone)"
else
    say "cloning https://github.com/dmlc/ps-lite into $SCRATCH/src"
    rm -rf "$SCRATCH/src"
    if ! GIT_TERMINAL_PROMPT=0 timeout 120 git clone -q --depth 1 \
            https://github.com/dmlc/ps-lite "$SCRATCH/src" 2>"$SCRATCH/clone.err"; then
        rm -rf "$SCRATCH/src"
        skip "no ps-lite source: none given (--src DIR or PSLITE_SRC) and cloning \
https://github.com/dmlc/ps-lite failed ($(tail -n1 "$SCRATCH/clone.err"))"
    fi
    SRC="$SCRATCH/src"
fi
PSLITE_REV="$(git -C "$SRC" rev-parse --short HEAD 2>/dev/null || echo unknown)"

# ---- build ps-lite (scratch copy) against Debian's zmq and protobuf ---------------------
# DEPS_PATH=/usr makes the Makefile's dependency targets (/usr/include/zmq.h,
# /usr/include/google/protobuf/message.h) already satisfied, so it downloads nothing, and
# PROTOC points at the system protoc. No patch is needed.
BUILD="$SCRATCH/build"
mkdir -p "$BUILD"
# cp -a keeps the source's (older) mtimes, so a second run finds libps.a up to date.
if [[ "$SRC" != "$BUILD" ]]; then
    (cd "$SRC" && tar --exclude=.git -cf - .) | (cd "$BUILD" && tar -xpf -)
fi
say "building ps-lite $PSLITE_REV in $BUILD"
if ! nice -n 10 make -C "$BUILD" -j2 ps DEPS_PATH=/usr PROTOC="$(command -v protoc)" \
        >"$SCRATCH/make.log" 2>&1; then
    tail -n 30 "$SCRATCH/make.log" >&2
    die "ps-lite build failed (log: $SCRATCH/make.log)"
fi
KV_LOOP="$SCRATCH/kv_loop"
say "building kv_loop"
nice -n 10 g++ -std=c++11 -O3 -Wall -I"$BUILD/include" "$HERE/kv_loop.cc" \
    "$BUILD/build/libps.a" -lzmq -lprotobuf -pthread -o "$KV_LOOP" ||
    die "kv_loop.cc did not build"

# ---- build falcon ---------------------------------------------------------------------
say "building falcon (release)"
(cd "$REPO" && nice -n 10 cargo build --release -q -p falcon) || die "falcon did not build"
TARGET_DIR="$(cd "$REPO" && cargo metadata --format-version 1 --no-deps |
    grep -o '"target_directory":"[^"]*"' | head -n1 | cut -d'"' -f4)"
FALCON="$TARGET_DIR/release/falcon"
[[ -x "$FALCON" ]] || die "no falcon binary at $FALCON"

# ---- the shaped link (--rate) ---------------------------------------------------------------
SRV_IP=127.0.0.1
WRK_IP=127.0.0.1
if [[ -n "$RATE" ]]; then
    [[ "$(id -u)" -eq 0 ]] || skip "--rate needs root (network namespaces and tc)"
    command -v ip >/dev/null && command -v tc >/dev/null || skip "--rate needs ip and tc (iproute2)"
    NETNS=1
    ip netns add "$NS_SRV" && ip netns add "$NS_WRK" || skip "cannot make network namespaces"
    ip link add "fpb$$s" type veth peer name "fpb$$w" || skip "cannot make a veth pair"
    ip link set "fpb$$s" netns "$NS_SRV"
    ip link set "fpb$$w" netns "$NS_WRK"
    SRV_IP=10.211.0.1
    WRK_IP=10.211.0.2
    ip -n "$NS_SRV" addr add "$SRV_IP/24" dev "fpb$$s"
    ip -n "$NS_WRK" addr add "$WRK_IP/24" dev "fpb$$w"
    for n in "$NS_SRV:fpb$$s" "$NS_WRK:fpb$$w"; do
        ip -n "${n%%:*}" link set lo up
        ip -n "${n%%:*}" link set "${n##*:}" up
        ip netns exec "${n%%:*}" tc qdisc add dev "${n##*:}" root tbf rate "$RATE" \
            burst 512kb latency 10ms || skip "tc refused a tbf qdisc of rate '$RATE'"
    done
    say "a $RATE link: scheduler and servers in $NS_SRV ($SRV_IP), workers in $NS_WRK ($WRK_IP)"
fi
# Runs a role where the link puts it (nothing extra on loopback).
in_ns() {
    local role="$1"
    shift
    if [[ $NETNS -eq 0 ]]; then "$@"
    elif [[ "$role" == worker ]]; then ip netns exec "$NS_WRK" "$@"
    else ip netns exec "$NS_SRV" "$@"; fi
}
host_of() { if [[ "$1" == worker ]]; then echo "$WRK_IP"; else echo "$SRV_IP"; fi; }

# ---- one job ------------------------------------------------------------------------------
free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
RUNS="$SCRATCH/runs"
rm -rf "$RUNS"
mkdir -p "$RUNS"
JOBN=0

# run_job SYSTEM(pslite|falcon) MEDIUM(tcp|ipc|shm) WORKERS SERVERS FLOATS ITERS [KEYS]
# Sets JOB_OUT to "IT_S P50_US". IT_S: iterations per second per worker (the mean over the
# workers), counted over the whole loop on both sides, as falcon's worker counts it. P50_US:
# ps-lite's median iteration after a 10 % warm-up (the mean over workers); falcon prints no
# p50, so its field is 1e6 / IT_S, its mean iteration. KEYS > 0: the sparse loop, FLOATS the
# table's rows (one float each), KEYS the keys drawn per iteration; then JOB_KEYS is
# ps-lite's mean count of distinct keys per iteration (empty for falcon).
run_job() {
    local sys="$1" medium="$2" nw="$3" ns="$4" floats="$5" iters="$6" keys="${7:-0}"
    JOBN=$((JOBN + 1))
    JOB_KEYS=""
    local dir="$RUNS/$JOBN-$sys-$medium-${nw}x$ns-$floats"
    [[ $keys -gt 0 ]] && dir+="-k$keys"
    mkdir -p "$dir"
    local port
    port="$(free_port)"
    local common=(DMLC_PS_ROOT_URI="$SRV_IP" DMLC_PS_ROOT_PORT="$port"
                  DMLC_NUM_SERVER="$ns" DMLC_NUM_WORKER="$nw")
    local cmd
    if [[ "$sys" == pslite ]]; then
        local local_=0
        [[ "$medium" == ipc ]] && local_=1
        common+=(PS_VERBOSE=0 DMLC_LOCAL="$local_" PSBENCH_FLOATS="$floats"
                 PSBENCH_ITERS="$iters" PSBENCH_LR=0.001)
        [[ $keys -gt 0 ]] &&
            common+=(KV_MODE=sparse KV_TABLE="$floats" KV_KEYS="$keys" KV_SETS="$SETS")
        [[ $PUSHPULL -eq 1 ]] && common+=(KV_LOOP=pushpull)
        cmd=("$KV_LOOP")
    else
        # One equal slice per server at most falcon's default shard size (4 MiB), so the
        # model is spread over the servers as ps-lite's one-key-per-server layout is.
        local shard=$(((floats * 4 + ns - 1) / ns))
        shard=$(((shard + 3) / 4 * 4))
        [[ $shard -gt 4194304 ]] && shard=4194304
        common+=(FALCON_POLICY=asp FALCON_FLOATS="$floats" FALCON_ITERS="$iters"
                 FALCON_JOB="pslite-bench-$$-$JOBN" FALCON_TOKEN=bench FALCON_MEDIUM="$medium"
                 FALCON_LR=0.001 FALCON_MAX_SHARD_BYTES="$shard" RUST_LOG=error)
        [[ $keys -gt 0 ]] &&
            common+=(FALCON_WORKLOAD=rows FALCON_ROWS="$keys" FALCON_ROWS_SETS="$SETS")
        [[ $PUSHPULL -eq 1 ]] && common+=(FALCON_LOOP=push-pull)
        cmd=("$FALCON" role)
    fi
    local others=() workers=() names=() i p
    in_ns scheduler env "${common[@]}" DMLC_ROLE=scheduler DMLC_NODE_HOST="$(host_of scheduler)" \
        timeout -k 5 120 "${cmd[@]}" >"$dir/scheduler.out" 2>"$dir/scheduler.err" &
    p=$!; PIDS+=("$p"); others+=("$p"); names[$p]=scheduler
    for ((i = 0; i < ns; i++)); do
        in_ns server env "${common[@]}" DMLC_ROLE=server DMLC_NODE_HOST="$(host_of server)" \
            timeout -k 5 120 "${cmd[@]}" >"$dir/server$i.out" 2>"$dir/server$i.err" &
        p=$!; PIDS+=("$p"); others+=("$p"); names[$p]=server$i
    done
    for ((i = 0; i < nw; i++)); do
        in_ns worker env "${common[@]}" DMLC_ROLE=worker DMLC_NODE_HOST="$(host_of worker)" \
            timeout -k 5 120 "${cmd[@]}" >"$dir/worker$i.out" 2>"$dir/worker$i.err" &
        p=$!; PIDS+=("$p"); workers+=("$p"); names[$p]=worker$i
    done
    local failed=""
    for p in "${workers[@]}" "${others[@]}"; do
        if ! wait "$p"; then
            failed="${names[$p]}"
            break
        fi
    done
    if [[ -n "$failed" ]]; then
        echo "run.sh: $sys $medium ${nw}x$ns floats=$floats: $failed failed (logs: $dir)" >&2
        local f
        for f in "$dir"/*.err; do
            [[ -s "$f" ]] || continue
            echo "--- $(basename "$f") (tail)" >&2
            grep -v '^\[bt\]' "$f" | tail -n 15 >&2
        done
        die "a $sys run failed"
    fi
    PIDS=()
    local out
    if [[ "$sys" == pslite ]]; then
        out="$(cat "$dir"/worker*.out | awk '/^RESULT role=worker/ {
                for (i = 1; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
                n++; it += v["all_it_s"]; p50 += v["p50_us"] }
            END { if (n) printf "%.3f %.3f\n", it / n, p50 / n }')"
    else
        out="$(cat "$dir"/worker*.out | sed -n \
                's/^worker [0-9]*: [0-9]* iterations in [0-9.]* s (\([0-9.]*\) it\/s.*/\1/p' |
            awk '{ n++; it += $1 } END { if (n) printf "%.3f %.3f\n", it / n, 1e6 / (it / n) }')"
    fi
    local got
    got="$(echo "$out" | awk '{print NF}')"
    if [[ "$got" != 2 ]] || [[ "$(ls "$dir"/worker*.out | wc -l)" -ne "$nw" ]]; then
        cat "$dir"/worker*.out | tail -n 5 >&2
        die "$sys $medium ${nw}x$ns floats=$floats: no result line from the workers (logs: $dir)"
    fi
    local nres
    if [[ "$sys" == pslite ]]; then
        nres="$(cat "$dir"/worker*.out | grep -c '^RESULT role=worker' || true)"
    else
        nres="$(cat "$dir"/worker*.out | grep -c '^worker [0-9]*: [0-9]* iterations in' || true)"
    fi
    [[ "$nres" -eq "$nw" ]] || die "$sys $medium ${nw}x$ns floats=$floats: $nres of $nw workers reported (logs: $dir)"
    if [[ $keys -gt 0 && "$sys" == pslite ]]; then
        JOB_KEYS="$(cat "$dir"/worker*.out | awk '/^RESULT role=worker/ {
                for (i = 1; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
                n++; k += v["mean_keys"] }
            END { if (n) printf "%.0f\n", k / n }')"
    fi
    JOB_OUT="$out"
}

# ---- the plan -----------------------------------------------------------------------------
if [[ $SPARSE -eq 0 ]]; then
    SIZES=(4096 65536 1048576 16777216)
    LABELS=("4 KiB" "64 KiB" "1 MiB" "16 MiB")
    ITERS=(5000 4000 1000 100)
    if [[ $QUICK -eq 1 ]]; then ITERS=(1000 800 200 20); fi
    FITERS=("${ITERS[@]}")
    # name | workers | servers | falcon medium | ps-lite medium
    CONFIGS=(
        "tcp 1 worker x 1 server|1|1|tcp|tcp"
        "tcp 2 workers x 2 servers|2|2|tcp|tcp"
        "falcon shm vs ps-lite ipc (DMLC_LOCAL=1), 1x1|1|1|shm|ipc"
        "falcon shm vs ps-lite tcp, 1x1|1|1|shm|tcp"
    )
else
    # The sparse loop: a table of TABLE one-float keys; SIZES are the keys drawn per
    # iteration; both sides run the same number of iterations.
    TABLE=1000000
    SIZES=(1000 10000 100000 1000000)
    LABELS=("1 k keys" "10 k keys" "100 k keys" "1 M keys")
    ITERS=(4000 3000 1000 100)
    if [[ $QUICK -eq 1 ]]; then ITERS=(800 600 200 20); fi
    FITERS=("${ITERS[@]}")
    CONFIGS=(
        "tcp 1 worker x 1 server|1|1|tcp|tcp"
        "tcp 2 workers x 2 servers|2|2|tcp|tcp"
    )
fi
if [[ -n "$RATE" ]]; then
    # One worker, one server, over the shaped link; a quarter of the iterations (at least 5):
    # a run would take long at the link's rate.
    CONFIGS=("tcp 1 worker x 1 server over a $RATE link|1|1|tcp|tcp")
    for i in "${!ITERS[@]}"; do
        ITERS[$i]=$(((ITERS[i] + 3) / 4)); ((ITERS[i] >= 5)) || ITERS[$i]=5
        FITERS[$i]=${ITERS[$i]}
    done
fi

declare -A RATIO FIT PIT FUS PUS NKEYS
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{ a[NR] = $1 }
    END { if (NR == 0) print "nan"; else if (NR % 2) print a[(NR + 1) / 2];
          else print (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }

say "$ROUNDS round(s), $((${#CONFIGS[@]} * ${#SIZES[@]})) cells, ps-lite and falcon interleaved"
for ((r = 1; r <= ROUNDS; r++)); do
    for c in "${!CONFIGS[@]}"; do
        IFS='|' read -r cname nw ns fmed pmed <<<"${CONFIGS[$c]}"
        for s in "${!SIZES[@]}"; do
            if [[ $SPARSE -eq 0 ]]; then floats=$((SIZES[s] / 4)); keys=0
            else floats=$TABLE; keys=${SIZES[$s]}; fi
            key="$c|$s"
            if (((r + c + s) % 2)); then order=(falcon pslite); else order=(pslite falcon); fi
            declare -A res=()
            for sys in "${order[@]}"; do
                if [[ $sys == falcon ]]; then med=$fmed; iters=${FITERS[$s]}
                else med=$pmed; iters=${ITERS[$s]}; fi
                # Not in $(...): the job's processes must stay this shell's children, so
                # the exit trap can kill them.
                run_job "$sys" "$med" "$nw" "$ns" "$floats" "$iters" "$keys"
                res[$sys]="$JOB_OUT"
                [[ -n "$JOB_KEYS" ]] && NKEYS[$key]+=" $JOB_KEYS"
            done
            read -r fit fus <<<"${res[falcon]}"
            read -r pit pus <<<"${res[pslite]}"
            ratio="$(awk -v a="$fit" -v b="$pit" 'BEGIN { printf "%.4f", a / b }')"
            RATIO[$key]+=" $ratio"; FIT[$key]+=" $fit"; PIT[$key]+=" $pit"
            FUS[$key]+=" $fus"; PUS[$key]+=" $pus"
            say "round $r/$ROUNDS  $cname  ${LABELS[$s]}: falcon $fit it/s, ps-lite $pit it/s, ratio $ratio"
        done
    done
done

# ---- report ---------------------------------------------------------------------------
CPU="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//' || echo unknown)"
{
    echo "Throughput ratio, falcon / ps-lite (iterations per second; > 1: falcon faster)," \
         "median of $ROUNDS per-round ratio(s):"
    echo
    printf '| configuration |'; printf ' %s |' "${LABELS[@]}"; echo
    printf '|---|'; for _ in "${LABELS[@]}"; do printf -- '---:|'; done; echo
    for c in "${!CONFIGS[@]}"; do
        IFS='|' read -r cname _ <<<"${CONFIGS[$c]}"
        printf '| %s |' "$cname"
        for s in "${!SIZES[@]}"; do
            printf ' %.2f |' "$(echo "${RATIO[$c|$s]}" | median)"
        done
        echo
    done
    echo
    echo "Absolute medians over the rounds (it/s per worker, the whole loop on both sides;" \
         "ps-lite's p50 is its median iteration after a 10 % warm-up, falcon's figure its mean" \
         "iteration, 1e6 / it/s, as it prints no p50):"
    echo
    if [[ $SPARSE -eq 0 ]]; then
        echo "| configuration | size | iters | falcon it/s | ps-lite it/s | falcon mean µs | ps-lite p50 µs |"
        echo "|---|---|---:|---:|---:|---:|---:|"
    else
        echo "| configuration | keys drawn | distinct keys | iters falcon / ps-lite | falcon it/s | ps-lite it/s | falcon mean µs | ps-lite p50 µs |"
        echo "|---|---|---:|---:|---:|---:|---:|---:|"
    fi
    for c in "${!CONFIGS[@]}"; do
        IFS='|' read -r cname _ <<<"${CONFIGS[$c]}"
        for s in "${!SIZES[@]}"; do
            k="$c|$s"
            if [[ $SPARSE -eq 0 ]]; then
                printf '| %s | %s | %d | %.1f | %.1f | %.1f | %.1f |\n' "$cname" "${LABELS[$s]}" \
                    "${ITERS[$s]}" "$(echo "${FIT[$k]}" | median)" "$(echo "${PIT[$k]}" | median)" \
                    "$(echo "${FUS[$k]}" | median)" "$(echo "${PUS[$k]}" | median)"
            else
                printf '| %s | %s | %.0f | %d / %d | %.1f | %.1f | %.1f | %.1f |\n' "$cname" \
                    "${LABELS[$s]}" "$(echo "${NKEYS[$k]}" | median)" "${FITERS[$s]}" \
                    "${ITERS[$s]}" "$(echo "${FIT[$k]}" | median)" "$(echo "${PIT[$k]}" | median)" \
                    "$(echo "${FUS[$k]}" | median)" "$(echo "${PUS[$k]}" | median)"
            fi
        done
    done
    echo
    if [[ $SPARSE -eq 1 ]]; then
        echo "- sparse: a table of $TABLE keys of one float; each iteration draws K keys with" \
             "replacement (duplicates dropped: 'distinct keys', ps-lite's mean, is what travels);" \
             "falcon: FALCON_WORKLOAD=rows, FALCON_MAX_SHARD_BYTES as in the dense mode"
        if [[ $SETS -gt 0 ]]; then
            echo "- keys: each worker draws $SETS sets before its loop and uses them in turn" \
                 "(KV_SETS, FALCON_ROWS_SETS): the loop times the pushes and pulls"
        else
            echo "- keys: a fresh set drawn in each iteration, inside the timed loop" \
                 "(--draw-in-loop), on both sides"
        fi
    fi
    if [[ $PUSHPULL -eq 1 ]]; then
        echo "- loop: one push-pull per iteration (falcon FALCON_LOOP=push-pull, ps-lite" \
             "KV_LOOP=pushpull: ZPushPull), a pull before the loop"
    fi
    echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "- machine: $(nproc) CPUs, $CPU"
    [[ -z "$RATE" ]] || echo "- link: a veth pair between two network namespaces, tbf rate $RATE both ways"
    echo "- command: \`$ORIG_CMD\`"
    echo "- ps-lite: dmlc/ps-lite $PSLITE_REV (Debian zmq $(dpkg-query -W -f='${Version}' libzmq3-dev 2>/dev/null), protobuf $(dpkg-query -W -f='${Version}' libprotobuf-dev 2>/dev/null)); falcon: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)"
} | tee "${OUT:-/dev/null}"
