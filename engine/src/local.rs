//! The embedded local cluster, in-process: a scheduler and the servers on threads of this
//! process, the workers as handles. For tests and for programs that embed falcon; the
//! multi-process form is `falcon local`.

use std::thread::JoinHandle;

use crate::config::JobConfig;
use crate::error::{Error, Result};
use crate::keys::TensorSpec;
use crate::scheduler::{Scheduler, SchedulerReport};
use crate::server::{Server, ServerHooks, ServerReport};
use crate::worker::Worker;

/// A running in-process cluster.
pub struct LocalCluster {
    /// One handle per worker, by rank.
    pub workers: Vec<Worker>,
    scheduler: JoinHandle<Result<SchedulerReport>>,
    servers: Vec<JoinHandle<Result<ServerReport>>>,
}

/// What a finished cluster reports.
#[derive(Debug)]
pub struct LocalReport {
    /// The scheduler's report.
    pub scheduler: SchedulerReport,
    /// Each server's report, by rank.
    pub servers: Vec<ServerReport>,
}

impl LocalReport {
    /// The final values of `tensor`, gathered from the servers' shards.
    pub fn tensor(&self, keymap: &crate::keys::KeyMap, name: &str) -> Result<Vec<f32>> {
        let t = keymap.tensor(name)?;
        let mut out = vec![0f32; keymap.tensors[t].len as usize];
        for s in keymap.shards_of(t) {
            let vals = self
                .servers
                .iter()
                .find_map(|r| r.params.get(&s.id))
                .ok_or_else(|| Error::Config(format!("no server reported shard {}", s.id)))?;
            out[s.offset as usize..(s.offset + s.len) as usize].copy_from_slice(vals);
        }
        Ok(out)
    }
}

fn join<T>(h: JoinHandle<Result<T>>, what: &str) -> Result<T> {
    h.join()
        .map_err(|_| Error::Config(format!("the {what} thread panicked")))?
}

impl LocalCluster {
    /// Starts a scheduler, `cfg.servers` servers and `cfg.workers` workers training `tensors`.
    pub fn start(cfg: JobConfig, tensors: Vec<TensorSpec>) -> Result<LocalCluster> {
        Self::start_with(cfg, tensors, ServerHooks::default())
    }

    /// As `start`, with server hooks (learning-rate schedule, gradient scaling).
    pub fn start_with(
        mut cfg: JobConfig,
        tensors: Vec<TensorSpec>,
        hooks: ServerHooks,
    ) -> Result<LocalCluster> {
        let sched = Scheduler::bind(cfg.clone())?;
        cfg.scheduler = sched.address();
        let scheduler = std::thread::Builder::new()
            .name("falcon-scheduler".into())
            .spawn(move || sched.run())
            .map_err(|e| Error::Config(format!("spawn scheduler: {e}")))?;
        let servers = (0..cfg.servers)
            .map(|r| {
                let (cfg, hooks) = (cfg.clone(), hooks.clone());
                std::thread::Builder::new()
                    .name(format!("falcon-server-{r}"))
                    .spawn(move || Server::join(cfg, Some(r), hooks)?.run())
                    .map_err(|e| Error::Config(format!("spawn server: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let joining: Vec<_> = (0..cfg.workers)
            .map(|r| {
                let (cfg, tensors) = (cfg.clone(), tensors.clone());
                std::thread::spawn(move || Worker::join(&cfg, tensors, Some(r)))
            })
            .collect();
        let mut workers = Vec::new();
        for h in joining {
            workers.push(join(h, "worker")?);
        }
        Ok(LocalCluster {
            workers,
            scheduler,
            servers,
        })
    }

    /// Tells every worker it is done and waits for the scheduler and servers to finish.
    pub fn finish(self) -> Result<LocalReport> {
        for w in &self.workers {
            w.finish()?;
        }
        let scheduler = join(self.scheduler, "scheduler")?;
        let servers = self
            .servers
            .into_iter()
            .map(|h| join(h, "server"))
            .collect::<Result<Vec<_>>>()?;
        Ok(LocalReport { scheduler, servers })
    }
}
