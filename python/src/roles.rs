//! The serving roles from Python: a local cluster (a scheduler and servers on threads of
//! this process, for workers on this host to join), `serve`, which runs the role the
//! environment names for this process (`FALCON_ROLE=scheduler` or `server`), and the roles a
//! launched rank hosts beside its worker (the same script on every rank of a torchrun or
//! Slurm launch: every rank trains, rank 0 hosting the scheduler, each node's first rank a
//! server).

use std::collections::HashMap;
use std::thread::JoinHandle;

use falcon_engine::proto::Role;
use falcon_engine::{Scheduler, SchedulerReport, Server, ServerReport};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::worker::blocking;
use crate::{ConfigError, Error, SLICE, engine_err};

fn scheduler_dict<'py>(py: Python<'py>, r: &SchedulerReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("bytes_per_server", r.bytes_per_server.clone())?;
    let nodes = |v: &[(Role, u32)]| -> Vec<(String, u32)> {
        v.iter().map(|(r, n)| (r.name().to_string(), *n)).collect()
    };
    d.set_item("dead", nodes(&r.dead))?;
    d.set_item("rejoined", nodes(&r.rejoined))?;
    d.set_item(
        "evicted",
        r.evicted
            .iter()
            .map(|(r, n, why)| (r.name().to_string(), *n, why.clone()))
            .collect::<Vec<_>>(),
    )?;
    d.set_item("steals", r.steals)?;
    d.set_item("tasks_transferred", r.tasks_transferred)?;
    d.set_item("parallelism_plans", r.parallelism_plans)?;
    d.set_item("threads", r.threads.clone())?;
    d.set_item("classes", r.classes.clone())?;
    d.set_item("supersteps", r.supersteps)?;
    d.set_item(
        "lost",
        r.lost_workers()
            .iter()
            .map(|&w| ("worker".to_string(), w))
            .collect::<Vec<_>>(),
    )?;
    Ok(d)
}

fn server_dict<'py>(py: Python<'py>, r: &ServerReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("rank", r.rank)?;
    d.set_item("gradients", r.gradients)?;
    d.set_item("updates", r.updates)?;
    d.set_item("delayed_pulls", r.delayed_pulls)?;
    d.set_item("answered_pulls", r.answered_pulls)?;
    d.set_item("dropped_gradients", r.dropped_gradients)?;
    d.set_item("duplicate_pushes", r.duplicate_pushes)?;
    d.set_item("staleness_sum", r.staleness_sum)?;
    d.set_item("staleness_max", r.staleness_max)?;
    d.set_item("workers_dead", r.workers_dead.clone())?;
    d.set_item("workers_rejoined", r.workers_rejoined.clone())?;
    d.set_item("workers_lost", r.workers_lost.clone())?;
    let helps: u64 = r.accounts.iter().map(|a| a.helps).sum();
    d.set_item("transferred_task_gradients", helps)?;
    let workers = PyList::empty(py);
    for c in &r.per_worker {
        let w = PyDict::new(py);
        w.set_item("parked_pulls", c.parked_pulls)?;
        w.set_item("grants", c.grants)?;
        w.set_item("transfers_offered", c.transfers_offered)?;
        w.set_item("dropped_gradients", c.dropped_gradients)?;
        w.set_item("folded_gradients", c.folded_gradients)?;
        workers.append(w)?;
    }
    d.set_item("per_worker", workers)?;
    Ok(d)
}

type Joined<T> = Option<JoinHandle<falcon_engine::Result<T>>>;

/// A job's scheduler and servers on threads of this process, for workers on this host (other
/// processes, or this one) to join. Made by `falcon.local_cluster(...)`.
#[pyclass(module = "falcon")]
pub struct Cluster {
    address: String,
    env: HashMap<String, String>,
    scheduler: Joined<SchedulerReport>,
    servers: Vec<Joined<ServerReport>>,
}

/// Waits (at most `timeout` seconds; None: as long as it takes) until `ended()`, the GIL
/// released, Ctrl-C checked; past the deadline a TimeoutError saying `still` (the roles go on).
fn wait_for_end(
    py: Python<'_>,
    timeout: Option<f64>,
    ended: impl Fn() -> bool,
    still: &str,
) -> PyResult<()> {
    let start = std::time::Instant::now();
    while !ended() {
        if let Some(t) = timeout.filter(|t| start.elapsed().as_secs_f64() >= *t) {
            return Err(crate::TimeoutError::new_err(format!(
                "{still} after {t:.1} s: some worker has not finished"
            )));
        }
        py.detach(|| std::thread::sleep(SLICE / 5));
        py.check_signals()?;
    }
    Ok(())
}

/// A role's thread, joined: its report, or its error (a panic as an error).
fn joined<T>(h: JoinHandle<falcon_engine::Result<T>>, what: &str) -> PyResult<T> {
    match h.join() {
        Ok(r) => r.map_err(|e| {
            let py_err = engine_err(e);
            Python::attach(|py| {
                let msg = py_err.value(py).to_string();
                let ty = py_err.get_type(py);
                PyErr::from_type(ty, format!("{what}: {msg}"))
            })
        }),
        Err(p) => Err(Error::new_err(format!(
            "{what}: its thread panicked: {}",
            falcon_engine::local::panic_message(p.as_ref())
        ))),
    }
}

#[pymethods]
impl Cluster {
    /// Starts a scheduler and the job's servers. `overrides` are FALCON_* variables over the
    /// environment (the launch contract); the scheduler listens on FALCON_SCHEDULER
    /// (default 127.0.0.1 on a free port).
    #[new]
    fn new(overrides: HashMap<String, String>) -> PyResult<Cluster> {
        let mut vars = overrides.clone();
        vars.insert("FALCON_ROLE".into(), "scheduler".into());
        vars.remove("FALCON_RANK");
        vars.entry("FALCON_SCHEDULER".into())
            .or_insert_with(|| "127.0.0.1:0".into());
        let launch = crate::launch(&vars)?;
        let sched = Scheduler::bind(launch.config.clone()).map_err(engine_err)?;
        let address = sched.address();
        let mut cfg = launch.config;
        cfg.scheduler = address.clone();
        let scheduler = std::thread::Builder::new()
            .name("falcon-scheduler".into())
            .spawn(move || sched.run())
            .map_err(|e| Error::new_err(format!("cannot start the scheduler's thread: {e}")))?;
        // The servers listen on the scheduler's interface, on ports of their own (the
        // scheduler's, when FALCON_SCHEDULER names one, is taken).
        let mut server_cfg = cfg.clone();
        if let Some(bind) = server_cfg.transport.bind.as_mut() {
            bind.set_port(0);
        }
        let mut servers = Vec::new();
        for r in 0..cfg.servers {
            let cfg = server_cfg.clone();
            let h = std::thread::Builder::new()
                .name(format!("falcon-server-{r}"))
                .spawn(move || Server::join(cfg, Some(r), Default::default())?.run())
                .map_err(|e| Error::new_err(format!("cannot start server {r}'s thread: {e}")))?;
            servers.push(Some(h));
        }
        // What a worker needs to join: the caller's variables and the scheduler's address.
        let mut env = overrides;
        env.remove("FALCON_ROLE");
        env.remove("FALCON_RANK");
        env.insert("FALCON_SCHEDULER".into(), address.clone());
        env.insert("FALCON_NUM_SERVER".into(), cfg.servers.to_string());
        env.insert("FALCON_NUM_WORKER".into(), cfg.workers.to_string());
        Ok(Cluster {
            address,
            env,
            scheduler: Some(scheduler),
            servers,
        })
    }

    /// The scheduler's address, as workers write it in FALCON_SCHEDULER.
    #[getter]
    fn address(&self) -> String {
        self.address.clone()
    }

    /// The variables a worker process sets to join this cluster (FALCON_SCHEDULER,
    /// FALCON_NUM_WORKER, FALCON_NUM_SERVER and the job's settings).
    #[getter]
    fn env(&self) -> HashMap<String, String> {
        self.env.clone()
    }

    /// Waits (at most `timeout` seconds; None: as long as it takes) for the job to end —
    /// every worker finished — and returns the reports: {"scheduler": {...}, "servers":
    /// [{...}, ...]}. Raises the first role's error; a TimeoutError if the job is still
    /// running at the deadline (the roles go on; call again).
    #[pyo3(signature = (timeout=None))]
    fn finish<'py>(
        &mut self,
        py: Python<'py>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        wait_for_end(
            py,
            timeout,
            || {
                self.scheduler.iter().all(|h| h.is_finished())
                    && self.servers.iter().flatten().all(|h| h.is_finished())
            },
            "the local cluster's job is still running",
        )?;
        let sched = self
            .scheduler
            .take()
            .ok_or_else(|| Error::new_err("this cluster has already finished"))?;
        let sched = joined(sched, "the scheduler")?;
        let out = PyDict::new(py);
        out.set_item("scheduler", scheduler_dict(py, &sched)?)?;
        let servers = PyList::empty(py);
        for (r, h) in self.servers.iter_mut().enumerate() {
            if let Some(h) = h.take() {
                let rep = joined(h, &format!("server {r}"))?;
                servers.append(server_dict(py, &rep)?)?;
            }
        }
        out.set_item("servers", servers)?;
        Ok(out)
    }

    fn __repr__(&self) -> String {
        format!(
            "<falcon.Cluster at {}, {} server(s)>",
            self.address,
            self.servers.len()
        )
    }
}

/// Runs the scheduler's or a server's part in the job the environment (with `overrides`
/// first) describes, until the job ends; returns its report. For a process the launch
/// makes a worker, a ConfigError.
#[pyfunction]
pub fn serve<'py>(
    py: Python<'py>,
    overrides: HashMap<String, String>,
) -> PyResult<Bound<'py, PyDict>> {
    let launch = crate::launch(&overrides)?;
    let cfg = launch.config;
    let mode = cfg.update_mode();
    match launch.role {
        Role::Scheduler => {
            let r = blocking(py, "scheduler", move || {
                Scheduler::bind(cfg)
                    .and_then(Scheduler::run)
                    .map_err(engine_err)
            })?;
            let d = PyDict::new(py);
            d.set_item("role", "scheduler")?;
            d.set_item("report", scheduler_dict(py, &r)?)?;
            d.set_item("ending", format!("scheduler: {}", r.ending()))?;
            d.set_item("failure", r.loss_fails_job(mode))?;
            Ok(d)
        }
        Role::Server => {
            let rank = launch.rank;
            let r = blocking(py, "server", move || {
                Server::join(cfg, rank, Default::default())
                    .and_then(Server::run)
                    .map_err(engine_err)
            })?;
            let d = PyDict::new(py);
            d.set_item("role", "server")?;
            d.set_item("report", server_dict(py, &r)?)?;
            d.set_item("ending", r.ending())?;
            d.set_item("failure", None::<String>)?;
            Ok(d)
        }
        Role::Worker => Err(ConfigError::new_err(
            "this process is a worker by its environment; it has no role to serve",
        )),
    }
}

/// The scheduler and servers a launched rank hosts beside its worker, on threads of this
/// process (`falcon.init()` under torchrun, srun or mpirun starts them; `falcon.finish()`
/// waits for the job's end with them).
#[pyclass(module = "falcon")]
pub struct HostedRoles {
    roles: Option<falcon_engine::local::HostedRoles>,
    what: String,
    mode: falcon_engine::update::UpdateMode,
}

#[pymethods]
impl HostedRoles {
    /// Starts what the launch (the environment, `overrides` first) says this rank hosts;
    /// None where it hosts nothing.
    #[staticmethod]
    fn start(overrides: HashMap<String, String>) -> PyResult<Option<HostedRoles>> {
        let launch = crate::launch(&overrides)?;
        if launch.hosted.is_empty() {
            return Ok(None);
        }
        let mut what = Vec::new();
        if launch.hosted.scheduler.is_some() {
            what.push("the scheduler".to_string());
        }
        for s in &launch.hosted.servers {
            what.push(format!("server {s}"));
        }
        let roles = falcon_engine::local::HostedRoles::start(&launch).map_err(engine_err)?;
        Ok(Some(HostedRoles {
            roles: Some(roles),
            what: what.join(", "),
            mode: launch.config.update_mode(),
        }))
    }

    /// Waits (at most `timeout` seconds; None: as long as it takes) for the hosted roles to
    /// end with the job, and returns {"scheduler": {...} or None, "servers": [{...}, ...],
    /// "ending": the scheduler's line or None, "failure": why the job failed, or None}.
    #[pyo3(signature = (timeout=None))]
    fn finish<'py>(
        &mut self,
        py: Python<'py>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let roles = self
            .roles
            .as_ref()
            .ok_or_else(|| Error::new_err("these hosted roles have already finished"))?;
        let still = format!("{} hosted here still serve", self.what);
        wait_for_end(py, timeout, || roles.is_finished(), &still)?;
        let roles = self
            .roles
            .take()
            .ok_or_else(|| Error::new_err("no hosted roles"))?;
        let report = roles
            .finish_within(std::time::Duration::ZERO)
            .map_err(engine_err)?;
        let out = PyDict::new(py);
        match &report.scheduler {
            Some(r) => {
                out.set_item("scheduler", scheduler_dict(py, r)?)?;
                out.set_item("ending", format!("scheduler: {}", r.ending()))?;
                out.set_item("failure", r.loss_fails_job(self.mode))?;
            }
            None => {
                out.set_item("scheduler", py.None())?;
                out.set_item("ending", py.None())?;
                out.set_item("failure", py.None())?;
            }
        }
        let servers = PyList::empty(py);
        for (_, r) in &report.servers {
            servers.append(server_dict(py, r)?)?;
        }
        out.set_item("servers", servers)?;
        Ok(out)
    }

    fn __repr__(&self) -> String {
        format!("<falcon.HostedRoles: {}>", self.what)
    }
}
