//! The cost of encoding and decoding values for the wire, in ns per float, beside memcpy:
//! `cargo run --release -p falcon-engine --example wire_cost [FLOATS] [ROUNDS]`

use std::time::Instant;

use falcon_engine::precision::Wire;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1 << 20);
    let rounds: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(30);
    let mut rng = fastrand::Rng::with_seed(7);
    let scale: f32 = args.next().and_then(|a| a.parse().ok()).unwrap_or(1.0);
    let values: Vec<f32> = (0..n).map(|_| (rng.f32() - 0.5) * scale).collect();
    let mut dst = vec![0f32; n];
    let time = |f: &mut dyn FnMut()| {
        median(
            (0..rounds)
                .map(|_| {
                    let t = Instant::now();
                    f();
                    t.elapsed().as_nanos() as f64 / n as f64
                })
                .collect(),
        )
    };
    let copy = time(&mut || {
        dst.copy_from_slice(&values);
        std::hint::black_box(&dst);
    });
    println!(
        "| wire | encode ns per float | decode ns per float | memcpy ({copy:.3} ns per float) |"
    );
    println!("|---|---|---|---|");
    for wire in [Wire::F32, Wire::Bf16, Wire::F16] {
        let mut bytes = vec![0u8; wire.bytes(n as u64) as usize];
        let enc = time(&mut || {
            wire.encode(&values, &mut bytes);
            std::hint::black_box(&bytes);
        });
        let mut out = vec![0f32; n];
        let dec = time(&mut || {
            wire.decode(&bytes, &mut out);
            std::hint::black_box(&out);
        });
        println!("| {} | {enc:.3} | {dec:.3} | |", wire.name());
    }
}
