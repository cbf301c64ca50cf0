//! Engine benchmark: push + pull round trips of a 1 M-float (4 MB) model through the parameter
//! server, 1 worker × 1 server and 4 workers × 2 servers, per medium, beside memcpy of the
//! same 4 MB measured in the same run.

use std::time::{Duration, Instant};

use falcon_engine::JobConfig;
use falcon_engine::keys::TensorSpec;
use falcon_engine::local::LocalCluster;
use falcon_engine::sync::PolicySpec;
use falcon_engine::update::Optimizer;
use falcon_transport::Medium;
use serde::Serialize;

use crate::reference;
use crate::stats::median;

/// The model size.
pub const FLOATS: u64 = 1 << 20;

/// One line of the summary.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// Medium between workers and servers.
    pub medium: String,
    /// Workers.
    pub workers: u32,
    /// Servers.
    pub servers: u32,
    /// Push+pull iterations per second, all workers together.
    pub iters_per_s: f64,
    /// Effective GB/s: (pushed + pulled bytes) / time, all workers together.
    pub gbps: f64,
    /// memcpy of 4 MB, GB/s, same run.
    pub memcpy_gbps: f64,
    /// gbps / memcpy_gbps.
    pub ratio: f64,
}

/// Runs the engine summary.
pub fn summary(quick: bool) -> falcon_engine::Result<Vec<Row>> {
    let iters = if quick { 5 } else { 200 };
    let src = vec![1u8; (FLOATS * 4) as usize];
    let mut dst = vec![0u8; (FLOATS * 4) as usize];
    let mut rows = Vec::new();
    for medium in [Medium::Shm, Medium::Tcp] {
        for (workers, servers) in [(1u32, 1u32), (4, 2)] {
            let mut cfg = JobConfig {
                job: format!("bench-{}", std::process::id()),
                token: "bench".into(),
                servers,
                workers,
                policy: PolicySpec::Asp,
                optimizer: Optimizer::Sgd { lr: 1e-6 },
                ..JobConfig::default()
            };
            cfg.transport.medium = medium;
            let cluster = LocalCluster::start(cfg, vec![TensorSpec::new("model", FLOATS)])?;
            let threads: Vec<_> = cluster
                .workers
                .iter()
                .cloned()
                .map(|w| {
                    std::thread::spawn(move || -> falcon_engine::Result<Duration> {
                        let buf = w.buffer("model")?;
                        let grad = w.buffer("model")?;
                        let mut t = 0;
                        for _ in 0..3 {
                            w.pull("model", &buf, t)?;
                            w.push("model", &grad, t)?;
                            t += 1;
                        }
                        w.barrier()?;
                        let start = Instant::now();
                        for _ in 0..iters {
                            w.pull("model", &buf, t)?;
                            w.push("model", &grad, t)?;
                            t += 1;
                        }
                        Ok(start.elapsed())
                    })
                })
                .collect();
            let mut longest = Duration::ZERO;
            for h in threads {
                let d = h
                    .join()
                    .map_err(|_| falcon_engine::Error::Config("bench worker panicked".into()))??;
                longest = longest.max(d);
            }
            cluster.finish()?;
            let total_iters = (iters * workers as u64) as f64;
            let secs = longest.as_secs_f64();
            let gbps = total_iters * 2.0 * (FLOATS * 4) as f64 / secs / 1e9;
            let mut m: Vec<f64> = (0..if quick { 3 } else { 25 })
                .map(|_| {
                    (FLOATS * 4 * 10) as f64
                        / reference::memcpy(&src, &mut dst, 10).as_secs_f64()
                        / 1e9
                })
                .collect();
            let memcpy_gbps = median(&mut m);
            rows.push(Row {
                medium: medium.name().into(),
                workers,
                servers,
                iters_per_s: total_iters / secs,
                gbps,
                memcpy_gbps,
                ratio: gbps / memcpy_gbps,
            });
        }
    }
    Ok(rows)
}

/// Renders rows as a Markdown table.
pub fn markdown(rows: &[Row]) -> String {
    let mut out = String::from(
        "| medium | workers × servers | push+pull it/s (all workers) | effective GB/s | memcpy 4 MB GB/s | ratio |\n|---|---|---|---|---|---|\n",
    );
    for r in rows {
        out.push_str(&format!(
            "| {} | {} × {} | {:.1} | {:.2} | {:.2} | {:.2} |\n",
            r.medium, r.workers, r.servers, r.iters_per_s, r.gbps, r.memcpy_gbps, r.ratio
        ));
    }
    out
}
