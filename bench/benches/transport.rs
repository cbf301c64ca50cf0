//! Criterion benchmarks of the transport, per medium and size, each group with its physical
//! reference (memcpy for shm, a plain blocking loopback socket for tcp) as a sibling bench.
//! After criterion, a summary table of medians and ratios is printed and written to
//! `target/falcon-bench/transport.{md,json}` (`--test` runs everything once, quickly).

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput};
use falcon_bench::reference::{self, PlainSocket};
use falcon_bench::transport::{self, Bench, Effort, SIZES};
use falcon_transport::Medium;

fn bandwidth(c: &mut Criterion, medium: Medium, max: u64) {
    let bench = Bench::new(medium, max).expect("bench setup");
    let mut sock = PlainSocket::start(max as usize).expect("plain socket");
    let src = vec![0xA5u8; max as usize];
    let mut dst = vec![0u8; max as usize];
    for op in ["write", "read"] {
        let mut g = c.benchmark_group(format!("{medium}/{op}"));
        g.sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(2));
        for &size in &SIZES {
            g.throughput(Throughput::Bytes(size));
            g.bench_with_input(BenchmarkId::new("falcon", size), &size, |b, &size| {
                b.iter_custom(|iters| match op {
                    "write" => bench.write_batch(size, iters as usize),
                    _ => bench.read_batch(size, iters as usize),
                })
            });
            g.bench_with_input(BenchmarkId::new("reference", size), &size, |b, &size| {
                b.iter_custom(|iters| match (medium, op) {
                    (Medium::Shm, _) => reference::memcpy(
                        &src[..size as usize],
                        &mut dst[..size as usize],
                        iters as usize,
                    ),
                    (_, "write") => sock
                        .write_batch(size as usize, iters as usize)
                        .expect("socket"),
                    _ => sock
                        .read_batch(size as usize, iters as usize)
                        .expect("socket"),
                })
            });
        }
        g.finish();
    }
    let mut g = c.benchmark_group(format!("{medium}/round-trip"));
    g.sample_size(20)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));
    let size = if medium == Medium::Shm { 64 } else { 4096 };
    transport::set_round_trip_len(size);
    g.bench_function(BenchmarkId::new("falcon", size), |b| {
        b.iter_custom(|iters| (0..iters).map(|_| bench.round_trip(size)).sum())
    });
    g.bench_function(BenchmarkId::new("reference", size), |b| {
        b.iter_custom(|iters| match medium {
            Medium::Shm => reference::atomic_ping_pong(iters as usize).iter().sum(),
            _ => (0..iters)
                .map(|_| sock.round_trip(size as usize).expect("socket"))
                .sum(),
        })
    });
    g.finish();
}

fn main() {
    let test_mode = std::env::args().any(|a| a == "--test");
    // FALCON_BENCH_QUICK without --test: the quick summary alone (the soft-RoCE guest runs
    // this: emulated, it shows function, not speed).
    let summary_only = std::env::var_os("FALCON_BENCH_QUICK").is_some() && !test_mode;
    let quick = test_mode || std::env::var_os("FALCON_BENCH_QUICK").is_some();
    // FALCON_HELPER_THREADS as a node reads it: the helpers that share long shm copies.
    if let Ok(v) = std::env::var("FALCON_HELPER_THREADS") {
        match falcon_engine::checks::helper_threads(&v) {
            Ok(n) => falcon_transport::spread::set_helpers(n),
            Err(e) => {
                eprintln!("FALCON_HELPER_THREADS={v}: {e}");
                std::process::exit(2);
            }
        }
    }
    let media = transport::available_media();
    if !summary_only {
        let mut c = Criterion::default().configure_from_args();
        let max = *SIZES.iter().max().expect("sizes");
        for &medium in &media {
            bandwidth(&mut c, medium, max);
        }
        c.final_summary();
    }

    let effort = if quick { Effort::QUICK } else { Effort::FULL };
    let rows = transport::summary(&media, effort);
    let table = transport::markdown(&rows);
    println!(
        "\nfalcon transport summary ({}):\n\n{table}",
        if quick { "quick" } else { "full" }
    );
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/falcon-bench");
    if std::fs::create_dir_all(&dir).is_ok() {
        let _ = std::fs::write(dir.join("transport.md"), &table);
        let _ = std::fs::write(
            dir.join("transport.json"),
            serde_json::to_string_pretty(&rows).unwrap_or_default(),
        );
    }
}
