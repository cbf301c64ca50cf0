//! Step time of the models on the CPU and on the CUDA device (feature `cuda`).
//!
//! `cargo run --release --features cuda -p falcon-trainer --example step_time [STEPS]`
//!
//! One step: the gradient of a batch of 64 and the SGD update. `cpu`: the CPU path, one
//! thread. `cuda (Model API)`: [`Model::grad`] on the device, parameters up and gradient down
//! every call, as the trainer's tasks use it. `cuda (resident)`: parameters on the device for
//! the whole run ([`GpuModel::session`]), only the batch goes up and the loss down. Prints
//! the median milliseconds per step of each (after warm-up), as a table and as JSON lines.

use std::time::Instant;

use falcon_trainer::model::gpu::{Device, GpuModel};
use falcon_trainer::model::{Model, ModelSpec};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let steps: usize = std::env::args().nth(1).map_or(Ok(200), |s| s.parse())?;
    let batch = 64;
    let dev = Device::open(0)?;
    println!("device: {} ({})", dev.info().name, dev.info().arch());
    for spec in ["mlp:784-256-10", "cnn:8-16"] {
        let spec: ModelSpec = spec.parse()?;
        let cpu = spec.build()?;
        let gpu = GpuModel::build(&spec, dev.clone())?;
        let mut rng = fastrand::Rng::with_seed(1);
        let x: Vec<f32> = (0..batch * cpu.input_len()).map(|_| rng.f32()).collect();
        let y: Vec<u8> = (0..batch).map(|_| rng.u8(..10)).collect();
        let lr = 0.01 / batch as f32;
        let mut results = Vec::new();
        for (what, model) in [("cpu", &*cpu), ("cuda (Model API)", &gpu as &dyn Model)] {
            let mut params = model.init_vec(1);
            let mut grad = vec![0.0; model.num_params()];
            let mut scratch = model.scratch(batch);
            let mut times = Vec::new();
            let n = if what == "cpu" { steps.min(100) } else { steps };
            for i in 0..n + 10 {
                let t = Instant::now();
                grad.fill(0.0);
                model.grad(&params, &x, &y, &mut grad, &mut scratch)?;
                for (p, g) in params.iter_mut().zip(&grad) {
                    *p -= lr * g;
                }
                if i >= 10 {
                    times.push(t.elapsed().as_secs_f64() * 1e3);
                }
            }
            results.push((what, median(times)));
        }
        let mut session = gpu.session(&gpu.init_vec(1))?;
        let mut times = Vec::new();
        for i in 0..steps + 10 {
            let t = Instant::now();
            session.step(&x, &y, lr)?;
            if i >= 10 {
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        results.push(("cuda (resident)", median(times)));
        let base = results[0].1;
        for (what, ms) in &results {
            println!(
                "{:<16} {:<18} {:>9.3} ms/step  {:>6.1}× the cpu",
                spec.to_string(),
                what,
                ms,
                base / ms
            );
        }
        for (what, ms) in &results {
            println!(
                "{{\"model\":\"{spec}\",\"batch\":{batch},\"path\":\"{what}\",\"ms_per_step\":{ms:.4}}}"
            );
        }
    }
    Ok(())
}
