//! The cost of applying an update, in nanoseconds per float, beside memcpy of the same bytes:
//! a stream of ordinary updates, and a stream of tiny ones (a small learning rate times small
//! gradients) whose results fall into the denormal range, which the apply path flushes to zero
//! (without the flush it costs about 3× as much).
//!
//! Then a row-sparse update: a tenth of the floats drawn at random (sorted, distinct, as a
//! key-value request carries them), applied through their packed index and gathered back (a
//! row pull's answer), in nanoseconds per row beside memcpy of the rows' values.
//!
//! `cargo run --release -p falcon-engine --example apply_cost [FLOATS] [ROUNDS]`

use std::sync::Arc;
use std::time::Instant;

use falcon_engine::rows::{RowIndex, encode_index, index_of_pull};
use falcon_engine::update::{Constant, Optimizer, ShardOptimizer};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median ns per float of `rounds` applications of `g` to fresh parameters `w0`.
fn apply_ns(opt: Optimizer, w0: &[f32], g: &[f32], rounds: usize) -> f64 {
    let mut times = Vec::new();
    let mut o = ShardOptimizer::new(opt, Arc::new(Constant), w0.len());
    let mut w = w0.to_vec();
    for _ in 0..rounds {
        let t = Instant::now();
        o.apply(&mut w, g);
        times.push(t.elapsed().as_nanos() as f64 / w.len() as f64);
    }
    std::hint::black_box(&w);
    median(times)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1 << 20);
    let rounds: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(50);
    let mut rng = fastrand::Rng::with_seed(7);
    let normal_w: Vec<f32> = (0..n).map(|_| rng.f32() - 0.5).collect();
    let normal_g: Vec<f32> = (0..n).map(|_| rng.f32() - 0.5).collect();
    // Parameters and steps at the bottom of the normal range: results fall below it (denormals).
    let tiny_w: Vec<f32> = (0..n).map(|_| (rng.f32() - 0.5) * 4e-38).collect();
    let tiny_g: Vec<f32> = (0..n).map(|_| (rng.f32() - 0.5) * 1e-35).collect();
    let mut dst = vec![0f32; n];
    let copy = median(
        (0..rounds)
            .map(|_| {
                let t = Instant::now();
                dst.copy_from_slice(&normal_w);
                std::hint::black_box(&dst);
                t.elapsed().as_nanos() as f64 / n as f64
            })
            .collect(),
    );
    println!("| optimizer | stream | ns per float | × memcpy ({copy:.3} ns per float) |");
    println!("|---|---|---|---|");
    let opts = [
        ("sgd", Optimizer::Sgd { lr: 1e-3 }),
        ("momentum(0.9)", Optimizer::Momentum { lr: 1e-3, mu: 0.9 }),
        (
            "adam",
            Optimizer::Adam {
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                wd: 0.0,
            },
        ),
    ];
    for (name, opt) in opts {
        for (stream, w, g) in [
            ("normal", &normal_w, &normal_g),
            ("tiny (denormal results)", &tiny_w, &tiny_g),
        ] {
            let ns = apply_ns(opt, w, g, rounds);
            println!("| {name} | {stream} | {ns:.3} | {:.2} |", ns / copy);
        }
    }
    rows(&normal_w, &normal_g, rounds, &mut rng);
}

/// Median ns per row of `rounds` runs of `f`, over `rows` rows.
fn per_row(rows: usize, rounds: usize, mut f: impl FnMut()) -> f64 {
    median(
        (0..rounds)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_nanos() as f64 / rows as f64
            })
            .collect(),
    )
}

/// The row-sparse section: a tenth of the table's single floats, sorted and distinct.
fn rows(w0: &[f32], g: &[f32], rounds: usize, rng: &mut fastrand::Rng) {
    let n = w0.len() as u64;
    let mut picked: Vec<u64> = (0..n / 10).map(|_| rng.u64(0..n)).collect();
    picked.sort_unstable();
    picked.dedup();
    let k = picked.len();
    let mut raw = Vec::new();
    encode_index(k as u64, || picked.iter().map(|&r| (r, 1)), &mut raw);
    let index: RowIndex = index_of_pull(raw).expect("a well-formed index");
    let values = &g[..k];
    let mut dst = vec![0f32; k];
    let copy = per_row(k, rounds, || {
        dst.copy_from_slice(values);
        std::hint::black_box(&dst);
    });
    println!();
    println!("| {k} rows of {n} (one float each) | ns per row | × memcpy ({copy:.3} ns per row) |");
    println!("|---|---|---|");
    let mut w = w0.to_vec();
    for (name, opt) in [
        ("sgd", Optimizer::Sgd { lr: 1e-3 }),
        (
            "adagrad",
            Optimizer::Adagrad {
                lr: 1e-3,
                eps: 1e-8,
            },
        ),
    ] {
        let mut o = ShardOptimizer::new(opt, Arc::new(Constant), w.len());
        let apply = per_row(k, rounds, || o.apply_ranges(&mut w, &index, values));
        println!(
            "| {name}, rows applied | {apply:.3} | {:.2} |",
            apply / copy
        );
    }
    let mut out = vec![0u8; 4 * k];
    let gather = per_row(k, rounds, || {
        index.gather(zerocopy::IntoBytes::as_bytes(w.as_slice()), &mut out);
        std::hint::black_box(&out);
    });
    println!(
        "| rows gathered (a pull's answer) | {gather:.3} | {:.2} |",
        gather / copy
    );
}
