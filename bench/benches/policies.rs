//! Criterion benchmarks of the synchronization policies (see `falcon_bench::policies`): the
//! summary is measured first, then criterion times the same references, traces and ZipLine
//! candidates; at the end the summary table is printed and written to
//! `target/falcon-bench/policies.{md,json}` (`--test` runs everything once, quickly;
//! `FALCON_BENCH_QUICK=1` alone runs the quick summary without criterion, as `falcon bench
//! policies --quick` does).

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, SamplingMode, Throughput};
use falcon_bench::policies::{self, MISS_BYTES, Replay, Trace};
use falcon_bench::reference::{self, RandomReads};
use falcon_bench::zipline;

fn main() {
    let test_mode = std::env::args().any(|a| a == "--test");
    let summary_only = std::env::var_os("FALCON_BENCH_QUICK").is_some() && !test_mode;
    let quick = test_mode || std::env::var_os("FALCON_BENCH_QUICK").is_some();
    let effort = if quick {
        policies::QUICK
    } else {
        policies::FULL
    };
    let (summary, traces) = policies::measure(effort);
    if !summary_only {
        let mut c = Criterion::default().configure_from_args();
        criterion_groups(&mut c, effort, &traces);
        c.final_summary();
    }
    let table = policies::markdown(&summary);
    println!("\nfalcon policies summary ({}):\n\n{table}", summary.mode);
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/falcon-bench");
    let _ = policies::write(&summary, &dir);
}

fn criterion_groups(c: &mut Criterion, effort: policies::Effort, traces: &[Trace]) {
    let mut misses = RandomReads::new(MISS_BYTES);
    let mut g = c.benchmark_group("reference");
    g.sample_size(20)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    g.bench_function("atomic-fetch-add", |b| {
        b.iter_custom(|iters| reference::atomic_fetch_add(iters as usize))
    });
    g.bench_function("random-read-64MiB", |b| {
        b.iter_custom(|iters| misses.run(iters as usize))
    });
    g.finish();
    drop(misses);

    for per_policy in traces.chunk_by(|a, b| a.policy.name == b.policy.name) {
        let mut g = c.benchmark_group(format!("policy/{}", per_policy[0].policy.name));
        g.warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(1))
            .throughput(Throughput::Elements(1));
        for t in per_policy {
            let mut replay = Replay::new(t);
            g.sample_size(if t.slow(effort) { 10 } else { 20 });
            g.bench_function(BenchmarkId::from_parameter(t.workers), |b| {
                b.iter_custom(|pushes| replay.run(pushes))
            });
        }
        g.finish();
    }

    let mut g = c.benchmark_group("zipline");
    g.sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    for (n, r, _) in zipline::PAPER {
        let cand = zipline::candidates(n, r);
        g.throughput(Throughput::Elements((n * r) as u64));
        g.bench_with_input(BenchmarkId::new(format!("R={r}"), n), &cand, |b, cand| {
            b.iter_custom(|iters| zipline::time(cand, iters))
        });
    }
    g.finish();
}
