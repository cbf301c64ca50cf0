#!/usr/bin/env bash
# falcon's one test entry point. Installs what it needs, then runs: rustfmt, clippy (all
# targets, all features, warnings denied), every test of the workspace, the network-fault
# tests (hosts of network namespaces; root), the benchmarks in a short mode (so they cannot
# rot), and a smoke run of the main command.
# Ends with a line `N passed, N failed` counting the stages.
set -uo pipefail
cd "$(dirname "$0")/.."

passed=0
failed=0
failures=()
started=$SECONDS
timings=()
stage() {
    local name=$1 t0=$SECONDS
    shift
    echo "::: $name"
    if "$@"; then
        passed=$((passed + 1))
    else
        failed=$((failed + 1))
        failures+=("$name")
        echo "::: FAILED: $name"
    fi
    timings+=("$(printf '%5d s  %s' $((SECONDS - t0)) "$name")")
    echo "::: took $((SECONDS - t0)) s"
    echo "::: disk: target/ holds $(du -sh target 2>/dev/null | cut -f1), $(df -h --output=avail . | tail -1 | tr -d ' ') free"
}

# --- what the stages need -------------------------------------------------------------
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
# Disk: one pass builds a debug tree, release trees for three feature sets, and the loom and
# miri trees. Incremental caches only pay off when editing and rebuilding; in one pass they
# more than double the debug tree (13 GiB of 29 on a developer's machine), and a CI machine
# with little disk ran out of it. CARGO_INCREMENTAL=1 brings them back.
export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}
if ! command -v cargo >/dev/null; then
    echo "cargo is not installed; install Rust (rustup) first" >&2
    exit 2
fi
for comp in rustfmt clippy; do
    if ! rustup component list --installed 2>/dev/null | grep -q "^$comp"; then
        rustup component add "$comp"
    fi
done
# Installs Debian packages the stages need (root and apt), or says what will be missing.
need_pkgs() { # "what goes without them" PKG...
    local without=$1
    shift
    dpkg -s "$@" >/dev/null 2>&1 && return 0
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "::: installing $*"
        (apt-get install -y -q "$@" || { apt-get update -q && apt-get install -y -q "$@"; }) >/dev/null
    else
        echo "::: WARNING: cannot install $* (not root or no apt): $without"
    fi
}
# The `rdma` feature binds the system libibverbs (rdma-sys + bindgen): its headers and libclang.
# dataset-fashion-mnist: the full Fashion-MNIST (MIT), for the trainer's full-set tests.
need_pkgs "the rdma feature will not build, full-dataset tests skip" \
    libibverbs-dev librdmacm-dev libclang-dev pkg-config dataset-fashion-mnist
# The network-fault tests (tests/netns.rs) make hosts of network namespaces (iproute2), tie the
# roles' lives to the test's (setpriv, util-linux) and drop packets and cut hosts off with
# nftables where the kernel has no netem.
need_pkgs "the network-fault tests emulate less or skip (their SKIPPED: lines say what)" \
    iproute2 nftables util-linux

# The Python package's stages: Debian's PyTorch (CPU; PyPI's wheel pulls gigabytes of CUDA
# libraries), numpy and pytest, seen from a venv that builds and installs the package with the
# README's command.
need_pkgs "the Python package's tests cannot run" \
    python3-torch python3-numpy python3-pytest python3-venv python3-dev gcc

# The venv of the Python stages, with the package installed as the README says (pip builds
# it with maturin, a release build sharing cargo's target directory).
python_package() {
    local venv=target/pyenv
    if [ ! -x "$venv/bin/python" ]; then
        /usr/bin/python3 -m venv --system-site-packages "$venv" || return 1
    fi
    "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    "$venv/bin/python" -m pip install -q ./python || return 1
    local py=$PWD/$venv/bin/python
    (cd /tmp && "$py" -c 'import falcon, falcon.torch, torch; print("::: falcon", falcon.__file__, "torch", torch.__version__)')
}

python_tests() {
    python_package || return 1
    # -rs: every skipped test says why (the CUDA tensor tests skip without a GPU).
    target/pyenv/bin/python -m pytest -q -rs -p no:cacheprovider python/tests
}

# Reads cargo's JSON messages on stdin; prints the executables of the named test/bench targets.
executables_named() {
    python3 -c '
import json, sys
want = set(sys.argv[1:])
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"] \
            and m["target"]["name"] in want:
        print(m["executable"])
' "$@"
}

# The guest suite: the conformance suite (rdma, and shm and tcp again), the rdma error tests, the
# engine's cluster smoke test over rdma, and the transport benchmarks in quick mode, all built with `rdma` in release mode (TCG emulation
# makes debug builds slow). Under emulation the benchmarks show function, not speed.
rdma_guest() {
    cargo test --release -p falcon-transport -p falcon-engine --features rdma --no-run || return 1
    cargo bench -p falcon-bench --features rdma --no-run || return 1
    local bins
    mapfile -t bins < <({
        cargo test --release -p falcon-transport -p falcon-engine --features rdma --no-run --message-format=json
        cargo bench -p falcon-bench --features rdma --no-run --message-format=json
    } 2>/dev/null | executables_named conformance medium_fallback rdma_memlock rdma_port_down rdma_cluster transport)
    if [ "${#bins[@]}" -ne 6 ]; then
        echo "expected 6 guest executables, found ${#bins[@]}: ${bins[*]}"
        return 1
    fi
    local rc=0
    tools/rxe-vm.sh --retry-segv --env RUST_TEST_THREADS=2 --env FALCON_BENCH_QUICK=1 \
        --env FALCON_BENCH_MEDIA=rdma "${bins[@]}" || rc=$?
    if [ "$rc" = 77 ]; then
        echo "::: SKIPPED (visibly): the soft-RoCE guest could not be set up here; RDMA ran nowhere"
        return 0
    fi
    return "$rc"
}

# The latency half of the network-fault tests: this host's kernel may have no netem (a VM's
# often has none), so the lossy-link test runs again in the test guest, whose stock Debian
# kernel has it, and there it must apply 2 ms ± 1 ms and 0.5 % loss (FALCON_NETNS_REQUIRE_NETEM).
netns_guest() {
    cargo test --release -p falcon --test netns --no-run || return 1
    local bin falcon
    bin=$(cargo test --release -p falcon --test netns --no-run --message-format=json 2>/dev/null |
        executables_named netns)
    falcon=$(cargo metadata --format-version 1 --no-deps 2>/dev/null |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/release/falcon
    if [ -z "$bin" ] || [ ! -x "$falcon" ]; then
        echo "expected the netns test and $falcon"
        return 1
    fi
    local rc=0
    tools/rxe-vm.sh --modprobe "sch_netem veth bridge" --file "$falcon" --file "$(command -v tc)" \
        --file "$(command -v setpriv)" --env FALCON_NETNS_REQUIRE_NETEM=1 \
        --args "--exact a_bsp_job_over_three_hosts_with_latency_and_loss_is_exact --nocapture --test-threads=1" \
        "$bin" || rc=$?
    if [ "$rc" = 77 ]; then
        echo "::: SKIPPED (visibly): the test guest could not be set up here; latency was emulated nowhere"
        return 0
    fi
    return "$rc"
}

# rdma tests on the host: they skip without a device; say how many, so a skip is never silent.
# Built as the guest stage builds them (release, transport and engine with rdma), so the two
# stages share one build.
rdma_host() {
    cargo test --release -p falcon-transport -p falcon-engine --features rdma || return 1
    echo "::: rdma tests skipped on this host (no device):"
    cargo test --release -p falcon-transport -p falcon-engine --features rdma --test conformance \
        rdma:: -- --nocapture 2>&1 | grep "^SKIPPED" | sort | uniq -c
    return 0
}

# The CUDA path without a GPU. Feature `cuda` builds with no CUDA toolkit (cudarc loads the
# libraries at run time). NVIDIA's NVRTC from PyPI, in a cached venv, compiles every kernel to
# a cubin for sm_80 and sm_90 (a kernel that does not compile fails the stage); then the two
# no-GPU paths run for real: no libcuda at all, and Debian's libcuda1 (non-free; downloaded and
# unpacked into target/, not installed) with no device. The device tests print SKIPPED lines
# here (counted below); they run on a machine with a GPU (docs/cuda.md). The engine's device
# push/pull tests (engine/tests/cuda.rs) take the same two paths.
cuda_no_gpu() {
    local venv=target/nvrtc-venv cache=$PWD/target/libcuda1
    if ! find "$venv" -name 'libnvrtc.so.12' 2>/dev/null | grep -q .; then
        rm -rf "$venv"
        /usr/bin/python3 -m venv "$venv" && "$venv/bin/python" -m pip install -q nvidia-cuda-nvrtc-cu12 ||
            return 1
    fi
    local nvrtc
    nvrtc=$(dirname "$(find "$PWD/$venv" -name 'libnvrtc.so.12' | head -1)")
    if [ ! -e "$cache/unpacked" ]; then
        local codename
        codename=$(. /etc/os-release && echo "$VERSION_CODENAME")
        rm -rf "$cache" && mkdir -p "$cache/lists/partial" "$cache/apt" || return 1
        echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $codename non-free" \
            >"$cache/sources.list"
        local o=(-q -o "Dir::Etc::SourceList=$cache/sources.list" -o Dir::Etc::SourceParts=/dev/null
            -o "Dir::State::Lists=$cache/lists" -o "Dir::Cache=$cache/apt")
        apt-get "${o[@]}" update >/dev/null &&
            (cd "$cache" && apt-get "${o[@]}" download libcuda1 libnvidia-ptxjitcompiler1 >/dev/null 2>&1) ||
            return 1
        for deb in "$cache"/*.deb; do dpkg -x "$deb" "$cache/root" || return 1; done
        touch "$cache/unpacked"
    fi
    local libcuda
    libcuda=$(dirname "$(find "$cache/root" -name 'libcuda.so*' | head -1)")
    local log=target/cuda-no-gpu.log
    echo "::: no libcuda (NVRTC from $nvrtc)"
    env FALCON_CUDA_EXPECT=no-driver FALCON_CUDA_REQUIRE_NVRTC=1 LD_LIBRARY_PATH="$nvrtc" \
        cargo test -p falcon-trainer --features cuda --lib --test cuda -- --nocapture 2>&1 | tee "$log" |
        grep -E "^(test result|compiled|cuda:)" || return 1
    env LD_LIBRARY_PATH="$nvrtc" cargo test -p falcon-engine --features cuda --test cuda -- --nocapture 2>&1 |
        tee -a "$log" | grep -E "^(test result|cuda:)" || return 1
    echo "::: Debian's libcuda1 and no device ($libcuda)"
    env FALCON_CUDA_EXPECT=no-device LD_LIBRARY_PATH="$libcuda:$nvrtc" \
        cargo test -p falcon-trainer --features cuda --test cuda no_driver -- --nocapture 2>&1 |
        grep -E "^(test result|cuda:)" || return 1
    env LD_LIBRARY_PATH="$libcuda:$nvrtc" \
        cargo test -p falcon-engine --features cuda --test cuda without_a_device -- --nocapture 2>&1 |
        grep -E "^(test result|cuda:)" || return 1
    # The Python package (built with its cuda feature by the Python stage): a CUDA tensor
    # with no libcuda, then with a driver and no device, is a falcon.CudaError and loses
    # nothing.
    if [ -x target/pyenv/bin/python ]; then
        echo "::: Python, CUDA tensors without a GPU: no libcuda, then no device"
        target/pyenv/bin/python -m pytest -q -p no:cacheprovider python/tests/test_cuda.py \
            -k without_cuda | tail -1 || return 1
        env LD_LIBRARY_PATH="$libcuda" target/pyenv/bin/python -m pytest -q -p no:cacheprovider \
            python/tests/test_cuda.py -k without_cuda | tail -1 || return 1
    else
        echo "SKIPPED: Python CUDA tensors without a GPU: the Python stage built no package"
    fi
    echo "::: cuda device tests skipped on this host (no GPU):"
    grep "^SKIPPED" "$log" | cut -d: -f2 | sort | uniq -c
    return 0
}

# --- stages ---------------------------------------------------------------------------
stage "cargo fmt --check" cargo fmt --all -- --check
stage "cargo clippy (all targets, all features, -D warnings)" \
    cargo clippy --workspace --all-targets --all-features -- -D warnings
# The network-fault tests and the chaos run have stages of their own (FALCON_NETNS=0 and
# FALCON_CHAOS=0 skip them here, visibly). The chaos run trains three jobs of seven
# processes: in a release build (shared with the main command and the netns guest) it takes
# a quarter of its debug time.
stage "cargo test (workspace)" env FALCON_NETNS=0 FALCON_CHAOS=0 cargo test --workspace --no-fail-fast
stage "chaos run: kills, restarts, dropped links (tests/chaos.rs, release)" \
    cargo test --release -p falcon --test chaos -- --nocapture
stage "network faults between namespace hosts (tests/netns.rs)" \
    cargo test -p falcon --test netns -- --nocapture --test-threads=1
stage "Python package: pip install ./python, then its tests (numpy, PyTorch, processes)" python_tests
stage "fuzz (short pass, 10 s per target)" tools/fuzz.sh 10
stage "cargo test (transport with rdma, host)" rdma_host
stage "cuda without a GPU: kernels to cubin for sm_80 and sm_90, no libcuda, no device" cuda_no_gpu
stage "loom: shard meta seqlock and clocks" env RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
    cargo test -p falcon-engine --test loom_meta --release
stage "loom: shm SPSC ring" env RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
    cargo test -p falcon-transport --lib --release ring::loom_model
stage "loom: elastic pool task source" env RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
    cargo test -p falcon-trainer --test loom_pool --release
stage "miri: ring and seqlock on plain memory" tools/miri.sh
stage "benchmarks, quick mode" env FALCON_BENCH_QUICK=1 \
    cargo bench -p falcon-bench --bench transport -- --test
stage "main command smoke run" cargo run --release -- train --iters 30
stage "rdma in the soft-RoCE guest" rdma_guest
stage "network latency and loss (netem) in the test guest" netns_guest

echo
echo "::: time per stage (total $((SECONDS - started)) s):"
printf '%s\n' "${timings[@]}"
for f in "${failures[@]}"; do echo "failed stage: $f"; done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
