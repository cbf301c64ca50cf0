//! ZipLine's decision cost against the ElasticBSP paper's Table II (shared by the `policies`
//! benchmark and `falcon experiment zipline`).
//!
//! Each point runs `falcon_engine::sync::zipline::zipline` on `N` workers' predicted next `R`
//! iteration ends (each worker a random period of 1 to 4 time units), on one thread.

use std::time::{Duration, Instant};

use falcon_engine::sync::Nanos;
use falcon_engine::sync::zipline::{predict, zipline};
use serde::Serialize;

use crate::stats::median;

/// The paper's points: (N, R, Table II's runtime in µs on a 24-core Xeon E5-2620 v3).
pub const PAPER: [(usize, usize, f64); 6] = [
    (10, 15, 149.0),
    (10, 150, 1320.0),
    (100, 15, 6370.0),
    (100, 150, 49900.0),
    (1000, 15, 253000.0),
    (1000, 150, 2380000.0),
];

/// One simulated time unit.
const UNIT: Nanos = 1_000_000;

/// One measured point.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// Workers.
    pub n: usize,
    /// Predicted iterations per worker.
    pub r: usize,
    /// Our median time per decision, µs.
    pub us: f64,
    /// Of which per candidate point, ns.
    pub ns_per_point: f64,
    /// The paper's time, µs.
    pub paper_us: f64,
    /// paper / ours.
    pub speedup: f64,
}

/// The measured points beside the paper's as a Markdown table, the cost per candidate point
/// also in cache misses of `miss_ns`.
pub fn table(rows: &[Row], miss_ns: f64) -> String {
    use std::fmt::Write;
    let mut t = String::from(
        "| N | R | ours µs | ns per point | × cache miss per point | paper µs (24-core Xeon) | paper / ours |\n|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for z in rows {
        let _ = writeln!(
            t,
            "| {} | {} | {:.1} | {:.1} | {:.2} | {:.0} | {:.0}× |",
            z.n,
            z.r,
            z.us,
            z.ns_per_point,
            z.ns_per_point / miss_ns,
            z.paper_us,
            z.speedup
        );
    }
    t
}

/// The candidate ends of `n` workers, `r` each (deterministic).
pub fn candidates(n: usize, r: usize) -> Vec<Vec<Nanos>> {
    let mut x = 0xD1B5_4A32_D192_ED03 ^ (n * r) as u64;
    (0..n)
        .map(|_| {
            // xorshift64
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            predict(1_000 * UNIT, UNIT + x % (3 * UNIT), r)
        })
        .collect()
}

/// `iters` decisions on `c`.
pub fn time(c: &[Vec<Nanos>], iters: u64) -> Duration {
    let t = Instant::now();
    for _ in 0..iters {
        std::hint::black_box(zipline(std::hint::black_box(c)));
    }
    t.elapsed()
}

/// Measures every point of [`PAPER`]: `reps` repetitions of at least `min_rep` each, median.
pub fn measure(reps: usize, min_rep: Duration) -> Vec<Row> {
    PAPER
        .iter()
        .map(|&(n, r, paper_us)| {
            let cand = candidates(n, r);
            let once = time(&cand, 1);
            let iters = (min_rep.as_nanos() / once.as_nanos().max(1)).max(1) as u64;
            let mut us: Vec<f64> = (0..reps.max(1))
                .map(|_| time(&cand, iters).as_secs_f64() * 1e6 / iters as f64)
                .collect();
            let us = median(&mut us);
            Row {
                n,
                r,
                us,
                ns_per_point: us * 1e3 / (n * r) as f64,
                paper_us,
                speedup: paper_us / us,
            }
        })
        .collect()
}
