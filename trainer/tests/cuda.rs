//! The CUDA path (feature `cuda`).
//!
//! Without a GPU: every kernel compiles to a cubin for sm_80 and sm_90 (needs NVRTC only;
//! `FALCON_CUDA_REQUIRE_NVRTC=1` makes a missing NVRTC a failure, as in CI), and the two
//! no-GPU paths — no libcuda, and a driver with no device — are typed errors from which
//! `auto` falls back to the CPU (`FALCON_CUDA_EXPECT=no-driver|no-device|device` states
//! which one this run must see). With a device: both models against the CPU on random
//! inputs, concurrent tasks on streams, and a short training run. Device tests print a
//! `SKIPPED:` line saying why when there is no device (`FALCON_CUDA_REQUIRE_DEVICE=1` makes
//! that a failure).
#![cfg(feature = "cuda")]

use std::sync::Arc;

use falcon_trainer::Error;
use falcon_trainer::data::Dataset;
use falcon_trainer::device::{self, Device, Placement};
use falcon_trainer::model::gpu::{self, GpuModel};
use falcon_trainer::model::{Cnn, Mlp, Model, ModelSpec};
use falcon_transport::cuda::{self, CudaError};

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

#[test]
fn every_kernel_compiles_to_a_cubin_for_sm_80_and_sm_90() {
    if !cuda::nvrtc_present() {
        let why = cuda::compile_cubin("", "sm_90").unwrap_err();
        assert!(
            matches!(
                why,
                CudaError::Missing {
                    library: "libnvrtc",
                    ..
                }
            ),
            "{why}"
        );
        assert!(
            env("FALCON_CUDA_REQUIRE_NVRTC").as_deref() != Some("1"),
            "FALCON_CUDA_REQUIRE_NVRTC=1 but {why}"
        );
        println!("SKIPPED: every_kernel_compiles_to_a_cubin_for_sm_80_and_sm_90: {why}");
        return;
    }
    let (major, minor) = cuda::nvrtc_version().unwrap();
    for arch in ["sm_80", "sm_90"] {
        let cubin = gpu::compile_kernels(arch)
            .unwrap_or_else(|e| panic!("the kernels do not compile for {arch}: {e}"));
        // An ELF image.
        assert_eq!(&cubin[..4], b"\x7fELF", "{arch}");
        println!(
            "compiled {} kernels for {arch} with NVRTC {major}.{minor}: {} bytes",
            gpu::SIGNATURES.len(),
            cubin.len()
        );
    }
    // A kernel that does not compile is an error with the compiler's log, not a panic.
    let e = cuda::compile_cubin("extern \"C\" __global__ void k() { nope; }", "sm_90")
        .unwrap_err()
        .to_string();
    assert!(e.contains("nope"), "{e}");
    let e = cuda::compile_cubin("", "compute 90")
        .unwrap_err()
        .to_string();
    assert!(e.contains("not an architecture"), "{e}");
}

/// What the driver side of this machine looks like.
#[derive(Debug, PartialEq)]
enum Seen {
    NoDriver,
    NoDevice,
    Device,
}

fn seen() -> Seen {
    if !cuda::driver_present() {
        return Seen::NoDriver;
    }
    match cuda::probe() {
        Ok(_) => Seen::Device,
        Err(CudaError::NoDevice(_)) => Seen::NoDevice,
        Err(e) => panic!("the driver failed otherwise than with no device: {e}"),
    }
}

#[test]
fn no_driver_and_no_device_are_typed_errors_and_auto_runs_on_the_cpu() {
    let seen = seen();
    match env("FALCON_CUDA_EXPECT").as_deref() {
        Some("no-driver") => assert_eq!(seen, Seen::NoDriver),
        Some("no-device") => assert_eq!(seen, Seen::NoDevice),
        Some("device") => assert_eq!(seen, Seen::Device),
        Some(other) => {
            panic!("FALCON_CUDA_EXPECT={other}: expected no-driver, no-device or device")
        }
        None => {}
    }
    println!(
        "cuda: this run sees {}",
        match seen {
            Seen::NoDriver => "no libcuda",
            Seen::NoDevice => "a driver without a device",
            Seen::Device => "a device",
        }
    );
    let spec: ModelSpec = "mlp:6-5-3".parse().unwrap();
    match seen {
        Seen::NoDriver => {
            let e = cuda::Gpu::open(0).unwrap_err();
            assert!(
                matches!(
                    e,
                    CudaError::Missing {
                        library: "libcuda",
                        ..
                    }
                ),
                "{e}"
            );
            assert!(matches!(cuda::probe(), Err(CudaError::Missing { .. })));
            let e = device::build(&spec, Device::Cuda).err().unwrap();
            assert!(matches!(&e, Error::Cuda(m) if m.contains("libcuda")), "{e}");
            let (m, p) = device::build(&spec, Device::Auto).unwrap();
            assert!(
                matches!(&p, Placement::Cpu(Some(why)) if why.contains("libcuda")),
                "{p}"
            );
            assert_eq!(m.num_params(), spec.build().unwrap().num_params());
        }
        Seen::NoDevice => {
            let e = cuda::Gpu::open(0).unwrap_err();
            assert!(matches!(e, CudaError::NoDevice(_)), "{e}");
            assert!(e.to_string().contains("no device"), "{e}");
            let e = device::build(&spec, Device::Cuda).err().unwrap();
            assert!(
                matches!(&e, Error::Cuda(m) if m.contains("no device")),
                "{e}"
            );
            let (_, p) = device::build(&spec, Device::Auto).unwrap();
            assert!(
                matches!(&p, Placement::Cpu(Some(why)) if why.contains("no device")),
                "{p}"
            );
        }
        Seen::Device => {
            let info = cuda::probe().unwrap();
            assert!(!info.devices.is_empty());
            let e = cuda::Gpu::open(info.devices.len()).unwrap_err();
            assert!(matches!(e, CudaError::NoSuchDevice { .. }), "{e}");
            let (_, p) = device::build(&spec, Device::Auto).unwrap();
            if cuda::nvrtc_present() && cuda::cublas_present() {
                assert!(matches!(p, Placement::Cuda(_)), "{p}");
            }
        }
    }
}

fn rand_vec(rng: &mut fastrand::Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| (rng.f32() * 2.0 - 1.0) * scale).collect()
}

fn assert_close(what: &str, got: &[f32], want: &[f32], rel: f32) {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-3);
    let worst = got
        .iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs())
        .fold(0.0f32, f32::max);
    assert!(
        worst <= rel * scale,
        "{what}: largest difference {worst} against a largest value {scale}"
    );
}

/// The device model's gradient, loss and accuracy against the CPU model's, on random inputs,
/// for a batch that the device splits into several chunks when `n` is large.
fn check_against_cpu(cpu: &dyn Model, gpu: &GpuModel, n: usize, seed: u64) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let params = rand_vec(&mut rng, cpu.num_params(), 0.3);
    let x = rand_vec(&mut rng, n * cpu.input_len(), 1.0);
    let y: Vec<u8> = (0..n).map(|_| rng.u8(..cpu.classes() as u8)).collect();
    // `grad` adds: start both from the same non-zero buffer.
    let start = rand_vec(&mut rng, cpu.num_params(), 1.0);
    let (mut g_cpu, mut g_gpu) = (start.clone(), start.clone());
    let mut s = cpu.scratch(n);
    let (l_cpu, c_cpu) = cpu.grad(&params, &x, &y, &mut g_cpu, &mut s).unwrap();
    let mut s = gpu.scratch(n);
    let (l_gpu, c_gpu) = gpu.grad(&params, &x, &y, &mut g_gpu, &mut s).unwrap();
    assert!(
        (l_cpu - l_gpu).abs() <= 1e-4 * l_cpu.abs(),
        "loss {l_gpu} vs {l_cpu}"
    );
    assert!(
        c_cpu.abs_diff(c_gpu) <= n / 100 + 1,
        "correct {c_gpu} vs {c_cpu}"
    );
    let d_cpu: Vec<f32> = g_cpu.iter().zip(&start).map(|(g, s)| g - s).collect();
    let d_gpu: Vec<f32> = g_gpu.iter().zip(&start).map(|(g, s)| g - s).collect();
    assert_close(&cpu.name(), &d_gpu, &d_cpu, 1e-3);
    let (le_cpu, ce_cpu) = cpu.evaluate(&params, &x, &y, &mut cpu.scratch(n)).unwrap();
    let (le_gpu, ce_gpu) = gpu.evaluate(&params, &x, &y, &mut s).unwrap();
    assert!((le_cpu - le_gpu).abs() <= 1e-4 * le_cpu.abs());
    assert!(ce_cpu.abs_diff(ce_gpu) <= n / 100 + 1);
    // Bad input is refused before anything runs, as on the CPU.
    let bad_y = vec![cpu.classes() as u8; n];
    assert!(matches!(
        gpu.grad(&params, &x, &bad_y, &mut g_gpu, &mut s),
        Err(Error::Config(_))
    ));
    assert!(matches!(
        gpu.grad(&params, &x[1..], &y, &mut g_gpu, &mut s),
        Err(Error::WrongLength { .. })
    ));
}

#[test]
fn the_mlp_on_the_device_matches_the_cpu() {
    let Some(dev) = gpu::device_for_test("the_mlp_on_the_device_matches_the_cpu") else {
        return;
    };
    for (sizes, n) in [(vec![784, 256, 10], 64), (vec![30, 17, 9, 4], 5000)] {
        let cpu = Mlp::new(&sizes).unwrap();
        let gpu = GpuModel::mlp(cpu.clone(), dev.clone()).unwrap();
        check_against_cpu(&cpu, &gpu, n, 7);
    }
}

#[test]
fn the_cnn_on_the_device_matches_the_cpu() {
    let Some(dev) = gpu::device_for_test("the_cnn_on_the_device_matches_the_cpu") else {
        return;
    };
    let cpu = Cnn::small();
    let gpu = GpuModel::cnn(cpu.clone(), dev.clone()).unwrap();
    check_against_cpu(&cpu, &gpu, 40, 8);
    // More than one device chunk.
    check_against_cpu(&cpu, &gpu, gpu.chunk() + 9, 9);
    let odd = Cnn::with_input(12, 8, 3, 5, 7).unwrap();
    check_against_cpu(&odd, &GpuModel::cnn(odd.clone(), dev).unwrap(), 33, 10);
}

#[test]
fn concurrent_tasks_on_streams_give_the_cpu_gradients() {
    let Some(dev) = gpu::device_for_test("concurrent_tasks_on_streams_give_the_cpu_gradients")
    else {
        return;
    };
    let cpu = Arc::new(Mlp::new(&[784, 128, 10]).unwrap());
    let gpu = Arc::new(GpuModel::mlp((*cpu).clone(), dev).unwrap());
    let params = Arc::new(cpu.init_vec(5));
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let (cpu, gpu, params) = (cpu.clone(), gpu.clone(), params.clone());
            std::thread::spawn(move || {
                let mut rng = fastrand::Rng::with_seed(t);
                for _ in 0..10 {
                    let x = rand_vec(&mut rng, 32 * 784, 1.0);
                    let y: Vec<u8> = (0..32).map(|_| rng.u8(..10)).collect();
                    let mut g1 = vec![0.0; cpu.num_params()];
                    let mut g2 = g1.clone();
                    cpu.grad(&params, &x, &y, &mut g1, &mut cpu.scratch(32))
                        .unwrap();
                    gpu.grad(&params, &x, &y, &mut g2, &mut gpu.scratch(32))
                        .unwrap();
                    assert_close("concurrent mlp", &g2, &g1, 1e-3);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn a_short_training_run_on_the_device_learns_like_the_cpu() {
    let Some(dev) = gpu::device_for_test("a_short_training_run_on_the_device_learns_like_the_cpu")
    else {
        return;
    };
    let data = Dataset::bundled().unwrap();
    let cpu = Mlp::new(&[784, 64, 10]).unwrap();
    let gpu = GpuModel::mlp(cpu.clone(), dev).unwrap();
    let mut params = cpu.init_vec(1);
    let (batch, lr, steps) = (64, 0.1f32, 150);
    let mut session = gpu.session(&params).unwrap();
    let mut scratch = cpu.scratch(batch);
    let mut grad = vec![0.0; cpu.num_params()];
    for step in 0..steps {
        let idx: Vec<usize> = (0..batch)
            .map(|i| (step * batch + i) % data.train.len())
            .collect();
        let x: Vec<f32> = idx
            .iter()
            .flat_map(|&i| data.train.image(i).to_vec())
            .collect();
        let y: Vec<u8> = idx.iter().map(|&i| data.train.label(i)).collect();
        session.step(&x, &y, lr / batch as f32).unwrap();
        grad.fill(0.0);
        cpu.grad(&params, &x, &y, &mut grad, &mut scratch).unwrap();
        for (p, g) in params.iter_mut().zip(&grad) {
            *p -= lr / batch as f32 * g;
        }
    }
    let on_device = session.params().unwrap();
    drop(session);
    let test = &data.test;
    let mut s = cpu.scratch(test.len());
    let (_, right_gpu) = cpu
        .evaluate(&on_device, &test.images, &test.labels, &mut s)
        .unwrap();
    let (_, right_cpu) = cpu
        .evaluate(&params, &test.images, &test.labels, &mut s)
        .unwrap();
    let (acc_gpu, acc_cpu) = (
        right_gpu as f64 / test.len() as f64,
        right_cpu as f64 / test.len() as f64,
    );
    println!("150 SGD steps: test accuracy {acc_gpu:.3} on the device, {acc_cpu:.3} on the cpu");
    assert!(acc_gpu > 0.65, "the device run did not learn: {acc_gpu}");
    assert!((acc_gpu - acc_cpu).abs() < 0.03, "{acc_gpu} vs {acc_cpu}");
    assert_close("parameters after training", &on_device, &params, 1e-2);
}
