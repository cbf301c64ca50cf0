//! Push + pull of device memory against host memory (feature `cuda`): one worker, one server,
//! in-process, over shm and tcp; for each size the median time of one push and the pull that
//! follows it, three ways, interleaved:
//!
//! - host: `push` and `pull` of a host region (no device involved);
//! - device: `push_device` and `pull_device` of a `DeviceRegion` (one DMA copy each way,
//!   through the page-locked staging region, overlapped shard by shard);
//! - by hand: what a caller without them does: copy the gradient off the device into a
//!   vector, `push_slice` (a second copy into a region), `pull_slice` (a copy out of it), and
//!   copy the values to the device.
//!
//! `cargo run --release --features cuda -p falcon-engine --example device_pushpull [REPS]`
//! (`FALCON_SHM_IN_PLACE=0`: every shm push copied into the server's slot, as `falcon role` does)
use std::time::{Duration, Instant};

use falcon_engine::keys::TensorSpec;
use falcon_engine::local::LocalCluster;
use falcon_engine::sync::PolicySpec;
use falcon_engine::{JobConfig, Worker};
use falcon_transport::Medium;
use falcon_transport::cuda::Gpu;

const SIZES: [usize; 6] = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20];

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    if let Err(e) = run() {
        eprintln!("device_pushpull: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let reps: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(50);
    let gpu = Gpu::open(0)?;
    println!(
        "device {}: {} ({}), {reps} rounds per size after 5 warm-up rounds",
        gpu.info().ordinal,
        gpu.info().name,
        gpu.info().arch()
    );
    println!("medium | size | host push+pull | device push+pull | by hand | device/host");
    for medium in [Medium::Shm, Medium::Tcp] {
        let mut cfg = JobConfig {
            job: format!("devbench-{}", std::process::id()),
            token: "bench".into(),
            servers: 1,
            workers: 1,
            policy: PolicySpec::Bsp,
            ..JobConfig::default()
        };
        cfg.transport.medium = medium;
        // As `falcon role` reads it: 0 copies every shm push into the slot.
        cfg.shm_in_place = !std::env::var("FALCON_SHM_IN_PLACE").is_ok_and(|v| {
            matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "0" | "false" | "no" | "off"
            )
        });
        let tensors = SIZES
            .iter()
            .map(|b| TensorSpec::new(format!("t{b}"), (*b / 4) as u64))
            .collect();
        let cluster = LocalCluster::start(cfg, tensors)?;
        let worker: Worker = cluster.workers[0].clone();
        for &bytes in &SIZES {
            let name = format!("t{bytes}");
            let n = bytes / 4;
            let host = worker.buffer(&name)?;
            let mut dev = gpu.device_region(n)?;
            if let Err(why) = dev.pinned() {
                println!("(staging not page-locked: {why})");
            }
            let vals: Vec<f32> = (0..n).map(|i| (i % 101) as f32 * 1e-3).collect();
            dev.upload(&vals)?;
            worker.init(&name, &host)?;
            let mut hand = vec![0f32; n];
            let mut clock = 0u64;
            let (mut th, mut td, mut tb) = (Vec::new(), Vec::new(), Vec::new());
            for r in 0..reps + 5 {
                let t = Instant::now();
                worker.push(&name, &host, clock)?;
                clock += 1;
                worker.pull(&name, &host, clock)?;
                let h = t.elapsed();
                let t = Instant::now();
                worker.push_device(&name, &dev, clock)?;
                clock += 1;
                worker.pull_device(&name, &mut dev, clock)?;
                let d = t.elapsed();
                let t = Instant::now();
                let s = dev.stream().clone();
                s.memcpy_dtoh(&dev.device().slice(..n), &mut hand[..])?;
                s.synchronize()?;
                worker.push_slice(&name, &hand, clock)?;
                clock += 1;
                worker.pull_slice(&name, &mut hand, clock)?;
                s.memcpy_htod(&hand, &mut dev.device_mut().slice_mut(..n))?;
                dev.synchronize()?;
                let b = t.elapsed();
                if r >= 5 {
                    th.push(h);
                    td.push(d);
                    tb.push(b);
                }
            }
            let (h, d, b) = (median(th), median(td), median(tb));
            let us = |d: Duration| d.as_secs_f64() * 1e6;
            println!(
                "{} | {} KiB | {:.1} µs | {:.1} µs | {:.1} µs | {:.2}",
                medium.name(),
                bytes >> 10,
                us(h),
                us(d),
                us(b),
                us(d) / us(h)
            );
        }
        worker.finish()?;
        cluster.finish()?;
    }
    Ok(())
}
