//! A worker process of one's own in a job whose scheduler and servers are `falcon role`
//! processes (ps-lite's and BytePS's arrangement). It learns its part from its environment
//! with the launch contract, `Launch::from_env()` (FALCON_*, ps-lite's DMLC_*, torchrun's
//! RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, Slurm's, Open MPI's), joins with `Worker::join`,
//! and pushes and pulls one tensor for a few iterations, checking every value it pulls.
//! Under a launcher (torchrun, srun, mpirun) each rank is a worker and the roles its launch
//! says it hosts (rank 0 the scheduler, each node's first rank a server) run beside it on
//! threads, `HostedRoles`, which it waits for once its worker has finished.
//!
//! Worker r pushes the same gradient at every clock: g[i] = −(r + 1)·(i mod 4 + 1). Under
//! BSP the servers apply the mean of the W workers' gradients with SGD at rate lr, so after t
//! clocks w[i] = t·lr·(i mod 4 + 1)·(W + 1)/2: with lr a power of two these are exact in f32.
//!
//! ```text
//! DMLC_ROLE=scheduler DMLC_PS_ROOT_URI=127.0.0.1 DMLC_PS_ROOT_PORT=9000 DMLC_NUM_WORKER=2 falcon role &
//! DMLC_ROLE=server    DMLC_PS_ROOT_URI=127.0.0.1 DMLC_PS_ROOT_PORT=9000 DMLC_NUM_WORKER=2 falcon role &
//! DMLC_ROLE=worker    DMLC_PS_ROOT_URI=127.0.0.1 DMLC_PS_ROOT_PORT=9000 DMLC_NUM_WORKER=2 \
//!     cargo run --example own_worker   # twice
//! ```

use falcon_engine::Worker;
use falcon_engine::keys::TensorSpec;
use falcon_engine::launch::Launch;
use falcon_engine::proto::Role;

/// The tensor this worker trains.
const TENSOR: &str = "weights";
/// Its length in floats.
const LEN: usize = 1000;
/// Iterations (clocks).
pub const ITERS: u64 = 8;

/// The factor of parameter `i` in every gradient.
fn factor(i: usize) -> f32 {
    (i % 4 + 1) as f32
}

pub fn main() -> Result<(), Box<dyn std::error::Error>> {
    let launch = Launch::from_env()?;
    if launch.role != Role::Worker {
        return Err(format!(
            "this program is a worker; its environment makes it the {}",
            launch.role.name()
        )
        .into());
    }
    // The scheduler and servers this rank hosts (under a launcher), on threads.
    let hosted = falcon_engine::local::HostedRoles::start(&launch)?;
    let tensors = vec![TensorSpec::new(TENSOR, LEN as u64)];
    let w = Worker::join(&launch.config, tensors, launch.rank)?;
    // The learning rate the servers apply: theirs is read from the same variables.
    let lr = launch.config.optimizer.lr();
    let mean = (w.workers() + 1) as f32 / 2.0;
    let expected = |t: u64, i: usize| t as f32 * lr * factor(i) * mean;
    let grad: Vec<f32> = (0..LEN)
        .map(|i| -((w.rank() + 1) as f32) * factor(i))
        .collect();
    let mut values = vec![0f32; LEN];
    let check = |t: u64, values: &[f32]| -> Result<(), String> {
        match (0..LEN).find(|&i| values[i] != expected(t, i)) {
            None => Ok(()),
            Some(i) => Err(format!(
                "worker {}: at clock {t} w[{i}] = {}, expected {}",
                w.rank(),
                values[i],
                expected(t, i)
            )),
        }
    };
    for t in 0..ITERS {
        w.pull_slice(TENSOR, &mut values, t)?;
        check(t, &values)?;
        w.push_slice(TENSOR, &grad, t)?;
    }
    w.pull_slice(TENSOR, &mut values, ITERS)?;
    check(ITERS, &values)?;
    println!(
        "own worker {} of {}: {ITERS} iterations, every pull as expected; final w[0..4] = {} {} {} {}",
        w.rank(),
        w.workers(),
        values[0],
        values[1],
        values[2],
        values[3]
    );
    w.finish()?;
    // They serve the whole job: wait for its end.
    let report = hosted.finish()?;
    if let Some(s) = report.scheduler {
        println!("hosted scheduler: {}", s.ending());
    }
    for (r, s) in report.servers {
        println!(
            "hosted server {r}: {} gradients, first parameter {:.6}",
            s.gradients,
            s.accounts.first().map_or(f32::NAN, |a| a.first)
        );
    }
    Ok(())
}
