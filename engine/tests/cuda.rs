//! Push and pull of CUDA device memory (feature `cuda`): `Worker::push_device` and
//! `Worker::pull_device` through in-process clusters over shm and tcp, bit for bit against a
//! worker of the same job that pushes and pulls host regions.
//!
//! Without a device the no-GPU path is checked (a typed error, no panic) and the device tests
//! print a `SKIPPED:` line saying why (`FALCON_CUDA_REQUIRE_DEVICE=1` makes that a failure).
#![cfg(feature = "cuda")]

use std::sync::mpsc;
use std::time::Duration;

use falcon_engine::keys::TensorSpec;
use falcon_engine::local::LocalCluster;
use falcon_engine::sync::PolicySpec;
use falcon_engine::update::{Aggregate, Optimizer};
use falcon_engine::worker::{f32_bytes, f32_bytes_mut};
use falcon_engine::{Error, JobConfig, Worker};
use falcon_transport::Medium;
use falcon_transport::cuda::{self, CudaError, Gpu};

/// Opens device 0, or says why the test skips.
fn gpu_for_test(test: &str) -> Option<Gpu> {
    match Gpu::open(0) {
        Ok(g) => Some(g),
        Err(e) if std::env::var("FALCON_CUDA_REQUIRE_DEVICE").as_deref() != Ok("1") => {
            println!("SKIPPED: {test}: no usable CUDA device: {e}");
            None
        }
        Err(e) => panic!("{test}: FALCON_CUDA_REQUIRE_DEVICE=1 but {e}"),
    }
}

#[test]
fn without_a_device_opening_one_is_a_typed_error() {
    match Gpu::open(0) {
        Ok(gpu) => {
            // A device: an empty device region and one of a few floats round-trip.
            let mut r = gpu.device_region(0).unwrap();
            assert!(r.is_empty());
            assert!(r.to_host().unwrap().is_empty());
            r.upload(&[]).unwrap();
            let mut r = gpu.device_region(3).unwrap();
            r.upload(&[1.0, -2.0, 3.5]).unwrap();
            r.stage_out(0, 3).unwrap().wait().unwrap();
            let mut back = [0f32; 3];
            r.staging().read_at(0, f32_bytes_mut(&mut back)).unwrap();
            assert_eq!(back, [1.0, -2.0, 3.5]);
            let e = r.stage_out(2, 2).unwrap_err();
            assert!(matches!(e, CudaError::Call(_)), "{e}");
            let e = r.upload(&[1.0]).unwrap_err();
            assert!(matches!(e, CudaError::Call(_)), "{e}");
            println!(
                "cuda: a device; staging page-locked: {}",
                r.pinned().is_ok()
            );
        }
        Err(e) => {
            assert!(
                matches!(e, CudaError::Missing { .. } | CudaError::NoDevice(_)),
                "{e}"
            );
            // The engine's error keeps it typed.
            let e = Error::from(e);
            assert!(e.to_string().starts_with("CUDA: "), "{e}");
            println!("cuda: no device: {e}");
        }
    }
}

fn cfg(medium: Medium, workers: u32) -> JobConfig {
    let mut c = JobConfig {
        job: format!("test-{}", fastrand::u64(..)),
        token: "secret".into(),
        servers: 2,
        workers,
        policy: PolicySpec::Bsp,
        aggregate: Aggregate::Mean,
        optimizer: Optimizer::Sgd { lr: 0.1 },
        max_shard_bytes: 1024, // many shards per tensor, over both servers
        heartbeat: Duration::from_secs(1),
        rendezvous_timeout: Duration::from_secs(30),
        ..JobConfig::default()
    };
    c.transport.medium = medium;
    c
}

const N: usize = 1000;

fn grad(w: u32, t: u64, p: &[f32]) -> Vec<f32> {
    p.iter()
        .enumerate()
        .map(|(i, x)| {
            0.05 * x + 0.001 * ((w + 1) as f32) * ((t + 1) as f32) + 0.0001 * (i % 7) as f32
        })
        .collect()
}

/// Two workers under BSP: worker 0 pushes and pulls device memory, worker 1 host regions.
/// Both must pull the same bits at every clock, and the result must be the single-process
/// reference's, bit for bit.
fn device_against_host(gpu: &Gpu, medium: Medium) {
    const ITERS: u64 = 5;
    let cluster =
        LocalCluster::start(cfg(medium, 2), vec![TensorSpec::new("w", N as u64)]).unwrap();
    let init: Vec<f32> = (0..N).map(|i| (i as f32 * 0.37).sin()).collect();
    let (tx, rx) = mpsc::channel::<(u32, u64, Vec<f32>)>();
    let threads: Vec<_> = cluster
        .workers
        .iter()
        .cloned()
        .map(|worker: Worker| {
            let (init, tx, gpu) = (init.clone(), tx.clone(), gpu.clone());
            std::thread::spawn(move || {
                let name = medium.name();
                let media = worker.server_media();
                assert!(media.iter().all(|m| *m == name), "{media:?}");
                let rank = worker.rank();
                if rank == 0 {
                    let mut dev = gpu.device_region(N).unwrap();
                    dev.upload(&init).unwrap();
                    // init from the staging region, copied out of the device.
                    dev.stage_out(0, N).unwrap().wait().unwrap();
                    worker.init("w", dev.staging()).unwrap();
                    worker.barrier().unwrap();
                    for t in 0..ITERS {
                        worker.pull_device("w", &mut dev, t).unwrap();
                        let p = dev.to_host().unwrap();
                        tx.send((rank, t, p.clone())).unwrap();
                        dev.upload(&grad(rank, t, &p)).unwrap();
                        worker.push_device("w", &dev, t).unwrap();
                    }
                    assert!(
                        dev.pinned().is_ok(),
                        "staging not page-locked: {}",
                        dev.pinned().err().unwrap_or("")
                    );
                } else {
                    worker.barrier().unwrap();
                    let buf = worker.buffer("w").unwrap();
                    let mut p = vec![0f32; N];
                    for t in 0..ITERS {
                        worker.pull("w", &buf, t).unwrap();
                        buf.read_at(0, f32_bytes_mut(&mut p)).unwrap();
                        tx.send((rank, t, p.clone())).unwrap();
                        buf.write_at(0, f32_bytes(&grad(rank, t, &p))).unwrap();
                        worker.push("w", &buf, t).unwrap();
                    }
                }
                worker.clock()
            })
        })
        .collect();
    drop(tx);
    for h in threads {
        assert_eq!(h.join().unwrap(), ITERS);
    }
    let mut seen: Vec<Vec<Option<Vec<f32>>>> = vec![vec![None; ITERS as usize]; 2];
    for (r, t, p) in rx {
        seen[r as usize][t as usize] = Some(p);
    }
    let keymap = cluster.workers[0].keymap().clone();
    let report = cluster.finish().unwrap();
    let mut p = init;
    for (t, (d, h)) in seen[0].iter().zip(&seen[1]).enumerate() {
        let (d, h) = (d.as_ref().unwrap(), h.as_ref().unwrap());
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(d),
            bits(h),
            "{}: clock {t}: device and host pulls differ",
            medium.name()
        );
        assert_eq!(
            bits(d),
            bits(&p),
            "{}: clock {t}: pulled values differ from the reference",
            medium.name()
        );
        let gs = [grad(0, t as u64, &p), grad(1, t as u64, &p)];
        for ((x, a), b) in p.iter_mut().zip(&gs[0]).zip(&gs[1]) {
            *x -= 0.1 * ((a + b) * 0.5);
        }
    }
    let got = report.tensor(&keymap, "w").unwrap();
    assert!(
        got.iter().zip(&p).all(|(a, b)| a.to_bits() == b.to_bits()),
        "{}: the result differs from the reference",
        medium.name()
    );
}

#[test]
fn device_push_and_pull_match_host_bit_for_bit_over_shm() {
    let Some(gpu) = gpu_for_test("device_push_and_pull_match_host_bit_for_bit_over_shm") else {
        return;
    };
    device_against_host(&gpu, Medium::Shm);
}

#[test]
fn device_push_and_pull_match_host_bit_for_bit_over_tcp() {
    let Some(gpu) = gpu_for_test("device_push_and_pull_match_host_bit_for_bit_over_tcp") else {
        return;
    };
    device_against_host(&gpu, Medium::Tcp);
}

/// Device work queued on another stream (a kernel's output, here a copy on a lane) is
/// pushed as it is once that work is done, and a pull's values are there for work queued on
/// another stream after it; lengths are checked.
#[test]
fn device_push_orders_after_other_streams_and_checks_lengths() {
    let Some(gpu) = gpu_for_test("device_push_orders_after_other_streams_and_checks_lengths")
    else {
        return;
    };
    let cluster =
        LocalCluster::start(cfg(Medium::Shm, 1), vec![TensorSpec::new("w", N as u64)]).unwrap();
    let worker = cluster.workers[0].clone();
    let mut dev = gpu.device_region(N).unwrap();
    let other = gpu.context().new_stream().unwrap();
    let init: Vec<f32> = (0..N).map(|i| i as f32 * 0.5).collect();
    // Written on another stream, not waited for: push_device must see it.
    other.memcpy_htod(&init, dev.device_mut()).unwrap();
    dev.stage_out(0, N).unwrap().wait().unwrap();
    worker.init("w", dev.staging()).unwrap();
    worker.barrier().unwrap();
    let g: Vec<f32> = (0..N).map(|i| (i % 13) as f32).collect();
    other.memcpy_htod(&g, dev.device_mut()).unwrap();
    worker.push_device("w", &dev, 0).unwrap();
    worker.pull_device("w", &mut dev, 1).unwrap();
    let back = other.clone_dtoh(dev.device()).unwrap();
    other.synchronize().unwrap();
    let want: Vec<f32> = init.iter().zip(&g).map(|(p, g)| p - 0.1 * g).collect();
    assert!(
        back[..N]
            .iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits())
    );
    let mut short = gpu.device_region(N - 1).unwrap();
    let e = worker.push_device("w", &short, 1).unwrap_err();
    assert!(matches!(e, Error::WrongLength { .. }), "{e}");
    let e = worker.pull_device("w", &mut short, 1).unwrap_err();
    assert!(matches!(e, Error::WrongLength { .. }), "{e}");
    let _ = cuda::probe();
    worker.finish().unwrap();
    cluster.finish().unwrap();
}
