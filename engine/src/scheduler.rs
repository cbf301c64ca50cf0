//! The scheduler: rendezvous (ranks, address book, key map, job token), barriers, heartbeats
//! and membership. One per job; it moves no parameters.
//!
//! Under ElasticBSP (`PolicySpec::job_barriers`) it also plans the job-wide superstep
//! barriers: each worker reports at its barrier ([`Msg::Superstep`]) with its clock and
//! estimated iteration interval; once every live worker that has not finished is there, the
//! scheduler runs ZipLine over their predicted iteration end times ([`plan_superstep`]) and
//! tells each its next barrier ([`Msg::Plan`]). One planner for the whole job, so every shard
//! and worker agrees on the barriers (per-shard planning disagreed and could deadlock).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use falcon_transport::{Completion, Link, LinkId, Transport};

use crate::auth::{self, Purpose};
use crate::config::JobConfig;
use crate::error::{Error, Result};
use crate::keys::{KeyMap, TensorSpec};
use crate::membership::{Action, Ending, Event, Membership, Node, Rendezvous, Settings};
use crate::metrics::{Board, Exporter};
use crate::proto::{Book, Msg, Role};
use crate::supervisor::{Manager, ManagerConfig};
use crate::sync::projection::Class;

pub use crate::membership::{SchedulerReport, SuperstepPlan, plan_superstep};

/// The board, whoever panicked while holding it.
fn lock(b: &Mutex<Board>) -> MutexGuard<'_, Board> {
    b.lock().unwrap_or_else(|p| p.into_inner())
}

/// The job's nodes: (role, rank) → link.
type Nodes = BTreeMap<Node, Link>;

/// A scheduler bound to its address, not yet running.
pub struct Scheduler {
    cfg: JobConfig,
    t: Transport,
}

/// How many of the job's workers and servers each host holds, by host identity.
type Hosts = BTreeMap<String, u32>;

/// The host identity in a node's advertised address (`host=ID;…`, a worker's without a
/// medium); an address without one is a host of its own.
fn host_of(addr: &str) -> &str {
    addr.split(';')
        .find_map(|part| part.strip_prefix("host="))
        .unwrap_or(addr)
}

/// Counts the nodes of each host, from their advertised addresses.
fn per_host<'a>(addrs: impl Iterator<Item = &'a String>) -> Hosts {
    let mut hosts = Hosts::new();
    for a in addrs {
        *hosts.entry(host_of(a).to_string()).or_default() += 1;
    }
    hosts
}

/// The job's workers and servers on the host of `addr` (at least the node itself).
fn host_peers(hosts: &Hosts, addr: &str) -> u32 {
    hosts.get(host_of(addr)).copied().unwrap_or(0).max(1)
}

/// A node admitted at rendezvous: its link, its address and the tensors it declared.
struct Joined {
    link: Link,
    addr: String,
    tensors: Vec<TensorSpec>,
}

/// Rendezvous in progress: the accepted links (with when they came: unadmitted ones expire),
/// the challenge sent to each (used once), the admissions and what each admitted node said.
#[derive(Default)]
struct Gathering {
    links: HashMap<LinkId, (Link, Instant)>,
    nonces: HashMap<LinkId, Vec<u8>>,
    hellos: HashMap<LinkId, Joined>,
}

/// The tensors every worker declared (an empty list defers to the others), or why the job
/// cannot start.
fn agreed_tensors(
    declared: &BTreeMap<(Role, u32), Vec<TensorSpec>>,
) -> std::result::Result<Vec<TensorSpec>, String> {
    let declared: Vec<(u32, &Vec<TensorSpec>)> = declared
        .iter()
        .filter(|((r, _), t)| *r == Role::Worker && !t.is_empty())
        .map(|((_, rank), t)| (*rank, t))
        .collect();
    let Some(&(first, tensors)) = declared.first() else {
        return Err("no worker declared any tensor".into());
    };
    for &(other, theirs) in &declared[1..] {
        if theirs != tensors {
            return Err(difference(first, tensors, other, theirs));
        }
    }
    Ok(tensors.clone())
}

/// How worker `b`'s tensors differ from worker `a`'s, naming the first tensor that differs,
/// its lengths and both ranks.
fn difference(a: u32, ours: &[TensorSpec], b: u32, theirs: &[TensorSpec]) -> String {
    let models = "the workers' models differ (each worker must declare the same tensors, in \
                  the same order)";
    let mine: HashMap<&str, u64> = ours.iter().map(|t| (t.name.as_str(), t.len)).collect();
    let other: HashMap<&str, u64> = theirs.iter().map(|t| (t.name.as_str(), t.len)).collect();
    for t in ours {
        match other.get(t.name.as_str()) {
            None => {
                return format!(
                    "tensor '{}' ({} floats) is declared by worker {a} but not by worker {b}: \
                     {models}",
                    t.name, t.len
                );
            }
            Some(&len) if len != t.len => {
                return format!(
                    "tensor '{}' is {} floats on worker {a} and {len} on worker {b}: {models}",
                    t.name, t.len
                );
            }
            Some(_) => {}
        }
    }
    if let Some(t) = theirs.iter().find(|t| !mine.contains_key(t.name.as_str())) {
        return format!(
            "tensor '{}' ({} floats) is declared by worker {b} but not by worker {a}: {models}",
            t.name, t.len
        );
    }
    let precision = |t: &TensorSpec| match t.wire {
        None => "float32",
        Some(crate::precision::Wire::Bf16) => "bfloat16",
        Some(w) => w.name(),
    };
    if let Some((x, y)) = ours
        .iter()
        .zip(theirs)
        .find(|(x, y)| x.name == y.name && x.wire != y.wire)
    {
        return format!(
            "tensor '{}' is {} on worker {a} and {} on worker {b}: {models}",
            x.name,
            precision(x),
            precision(y)
        );
    }
    let at = ours
        .iter()
        .zip(theirs)
        .position(|(x, y)| x.name != y.name)
        .unwrap_or(0);
    format!(
        "worker {a} declares '{}' as tensor {at} and worker {b} declares '{}' there: {models}",
        ours[at].name, theirs[at].name
    )
}

/// A straggler class, as the report names it.
fn class_name(c: &Class) -> String {
    match c {
        Class::Unknown => "unknown",
        Class::Pioneer => "pioneer",
        Class::Transient => "transient",
        Class::Persistent => "persistent",
    }
    .into()
}

/// The job's supervisor, as configured: each worker stands for one machine of `budget`
/// threads (the scheduler host's cores when unset).
fn supervisor_for(cfg: &JobConfig) -> Manager {
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let st = cfg.supervisor;
    let budget = if st.budget == 0 { cores } else { st.budget };
    let knee = if st.knee == 0 { budget } else { st.knee };
    let workers = cfg.workers.max(1);
    Manager::new(ManagerConfig {
        enabled: st.elastic,
        initial: st.initial.max(1),
        hosts: (0..workers).collect(),
        ..ManagerConfig::one_host(workers, budget, knee, 1)
    })
}

fn refuse(link: &Link, reason: String, report: &mut SchedulerReport) {
    tracing::warn!("scheduler: refusing {}: {reason}", link.peer());
    let _ = link.send(
        &Msg::Refused {
            reason: reason.clone(),
        }
        .encode(),
    );
    report.refused.push(reason);
    link.close();
}

impl Scheduler {
    /// Creates the scheduler's transport (listening).
    pub fn bind(cfg: JobConfig) -> Result<Scheduler> {
        crate::checks::roles_fit(cfg.servers, cfg.workers)
            .map_err(|e| Error::Config(e.to_string()))?;
        let t = Transport::new(cfg.transport_config()).map_err(|e| match e {
            // A port the job's settings chose: the settings must change.
            falcon_transport::Error::Bind { addr, why } => Error::Config(format!(
                "the scheduler cannot listen on {addr}: {why}; give it a free port \
                 (FALCON_SCHEDULER=HOST:PORT, FALCON_SCHEDULER_PORT, DMLC_PS_ROOT_PORT or \
                 MASTER_PORT)"
            )),
            other => other.into(),
        })?;
        Ok(Scheduler { cfg, t })
    }

    /// The address nodes connect to.
    pub fn address(&self) -> String {
        self.t.address().to_string()
    }

    /// Runs the job to its end: rendezvous, then barriers, heartbeats and membership until every
    /// worker is done; then shuts the servers down.
    pub fn run(self) -> Result<SchedulerReport> {
        let mut report = SchedulerReport::default();
        let (nodes, book, hosts) = self.rendezvous(&mut report)?;
        self.serve(nodes, book, hosts, report)
    }

    /// Admits S servers and W workers; returns (role, rank) → link, the book (rank 0) and
    /// how many of them each host holds.
    fn rendezvous(&self, report: &mut SchedulerReport) -> Result<(Nodes, Book, Hosts)> {
        let cfg = &self.cfg;
        let deadline = Instant::now() + cfg.rendezvous_timeout;
        let admission = crate::config::admission_deadline(cfg);
        let mut roster = Rendezvous::new(cfg.servers, cfg.workers);
        let mut st = Gathering::default();
        while !roster.complete() {
            if Instant::now() > deadline {
                return Err(Error::Rendezvous {
                    after: cfg.rendezvous_timeout,
                    missing: roster.missing(),
                });
            }
            crate::postoffice::drain_accepted(&self.t, &mut st.links);
            crate::postoffice::expire_unadmitted(
                &mut st.links,
                admission,
                |id| roster.admitted(id),
                "scheduler",
            );
            let Ok(c) = self.t.cq().wait(Some(Duration::from_millis(20))) else {
                continue;
            };
            match c {
                Completion::Message { link, data } => {
                    self.on_hello(&mut roster, &mut st, link, &data, report)?;
                }
                Completion::Closed { link, .. } => {
                    // A node that left before the job started frees its place.
                    crate::postoffice::drain_accepted(&self.t, &mut st.links);
                    roster.left(link);
                    st.hellos.remove(&link);
                    st.links.remove(&link);
                    st.nonces.remove(&link);
                }
                Completion::WriteImm { .. } => {}
            }
        }
        self.start_job(&roster, st, report)
    }

    /// A message on a link at rendezvous: a knock is challenged, a hello admitted or refused,
    /// anything else refused.
    fn on_hello(
        &self,
        roster: &mut Rendezvous,
        st: &mut Gathering,
        link: LinkId,
        data: &[u8],
        report: &mut SchedulerReport,
    ) -> Result<()> {
        let Some(l) = crate::postoffice::known_link(&self.t, &mut st.links, link) else {
            return Ok(());
        };
        if roster.admitted(link) {
            // A joined node speaks again before the job starts: nothing to say yet.
            tracing::debug!("scheduler: early message from {}", l.peer());
            return Ok(());
        }
        let reason = match Msg::decode(data) {
            Ok(Msg::Knock) => return auth::challenge(&l, &mut st.nonces),
            Ok(Msg::Hello {
                role,
                rank,
                proof,
                addr,
                tensors,
            }) => {
                let proof_ok = st
                    .nonces
                    .remove(&link)
                    .is_some_and(|n| auth::check(&self.cfg.token, Purpose::Hello, &n, &proof));
                match roster.hello(link, role, rank, proof_ok) {
                    Ok(()) => {
                        let joined = Joined {
                            link: l,
                            addr,
                            tensors,
                        };
                        st.hellos.insert(link, joined);
                        return Ok(());
                    }
                    Err(reason) => reason,
                }
            }
            Ok(other) => format!("expected a hello, got {}", other.name()),
            Err(e) => e.to_string(),
        };
        refuse(&l, reason, report);
        st.links.remove(&link);
        st.nonces.remove(&link);
        Ok(())
    }

    /// Every place is taken: ranks, the key map, and each node's book.
    fn start_job(
        &self,
        roster: &Rendezvous,
        mut st: Gathering,
        report: &mut SchedulerReport,
    ) -> Result<(Nodes, Book, Hosts)> {
        let cfg = &self.cfg;
        let mut nodes = BTreeMap::new();
        let mut addrs = BTreeMap::new();
        let mut declared = BTreeMap::new();
        for (node, peer) in roster.ranks() {
            let Some(j) = st.hellos.remove(&peer) else {
                continue;
            };
            nodes.insert(node, j.link);
            addrs.insert(node, j.addr);
            declared.insert(node, j.tensors);
        }
        let tensors = match agreed_tensors(&declared) {
            Ok(t) => t,
            Err(reason) => {
                for l in nodes.values() {
                    refuse(l, reason.clone(), report);
                }
                return Err(Error::Refused(reason));
            }
        };
        let keymap = KeyMap::plan(tensors, cfg.servers, cfg.max_shard_bytes)?;
        report.bytes_per_server = keymap.bytes_per_server();
        tracing::info!(
            "scheduler: job {} placed, bytes per server {}",
            cfg.job,
            report.bytes_per_server_list()
        );
        let servers: Vec<String> = (0..cfg.servers)
            .map(|r| addrs[&(Role::Server, r)].clone())
            .collect();
        let instance = u64::from_le_bytes(auth::nonce()?[..8].try_into().expect("8 bytes"));
        let template = Book {
            rank: 0,
            servers,
            workers: cfg.workers,
            keymap,
            policy: cfg.policy,
            mode: cfg.update_mode(),
            aggregate: cfg.aggregate,
            optimizer: cfg.optimizer,
            scale: cfg.scale,
            wire: cfg.wire,
            recovery: cfg.checkpoint.is_some(),
            rejoin: false,
            instance,
            barriers: 0,
            host_peers: 1,
        };
        let hosts = per_host(addrs.values());
        for ((role, rank), link) in &nodes {
            let book = Book {
                rank: *rank,
                host_peers: host_peers(&hosts, &addrs[&(*role, *rank)]),
                ..template.clone()
            };
            link.send(&Msg::Book(book).encode())
                .map_err(|e| Error::PeerGone {
                    role: role.name(),
                    rank: *rank,
                    why: e.to_string(),
                })?;
        }
        Ok((nodes, template, hosts))
    }

    /// Runs the job after rendezvous: transport completions go to the membership, whose
    /// actions the driver carries out, until it ends the job.
    fn serve(
        self,
        nodes: Nodes,
        book: Book,
        hosts: Hosts,
        report: SchedulerReport,
    ) -> Result<SchedulerReport> {
        let admission = crate::config::admission_deadline(&self.cfg);
        let m = Membership::new(Settings::of(&self.cfg), report, Instant::now());
        let tick = m.tick_every(self.cfg.heartbeat);
        let supervisor = supervisor_for(&self.cfg);
        let board = Arc::new(Mutex::new(Board::new(self.cfg.workers, self.cfg.servers)));
        // Stops serving scrapes when the job is over (dropped on return).
        let _exporter = match self.cfg.metrics_addr {
            Some(addr) => Some(Exporter::start(addr, board.clone())?),
            None => None,
        };
        let mut d = Driver {
            cfg: &self.cfg,
            t: &self.t,
            by_link: nodes.iter().map(|(k, l)| (l.id(), *k)).collect(),
            nodes,
            joining: HashMap::new(),
            nonces: HashMap::new(),
            book,
            hosts,
            advised: supervisor.all_threads(),
            supervisor,
            m,
            out: Vec::new(),
            board,
        };
        let mut next = d.feed(Event::Tick);
        let ending = loop {
            if let Some(ending) = next {
                break ending;
            }
            crate::postoffice::drain_accepted(&self.t, &mut d.joining);
            crate::postoffice::expire_unadmitted(&mut d.joining, admission, |_| false, "scheduler");
            next = match self.t.cq().wait(Some(tick)) {
                Ok(c) => d.on_completion(c)?,
                Err(_) => d.feed(Event::Tick),
            };
        };
        if ending.lingers() {
            // Give the nodes a moment to read the shutdown before our links close.
            std::thread::sleep(Duration::from_millis(50));
        }
        match ending.error() {
            Some(e) => Err(e),
            None => Ok(d.m.into_report()),
        }
    }
}

/// The running job's driver: the links of the nodes and of those asking to join, the
/// challenges, the book, and the supervisor; it turns completions into the membership's
/// events and carries out its actions.
struct Driver<'a> {
    cfg: &'a JobConfig,
    t: &'a Transport,
    nodes: Nodes,
    by_link: HashMap<LinkId, Node>,
    /// Links of nodes asking to join the running job, and the challenge sent to each.
    joining: HashMap<LinkId, (Link, Instant)>,
    nonces: HashMap<LinkId, Vec<u8>>,
    /// The book a node joining is sent (with its rank and the barriers fallen).
    book: Book,
    /// The workers and servers on each host at the start.
    hosts: Hosts,
    supervisor: Manager,
    /// The thread count last advised to each worker.
    advised: Vec<usize>,
    m: Membership,
    out: Vec<Action>,
    /// What the metrics endpoint shows.
    board: Arc<Mutex<Board>>,
}

impl Driver<'_> {
    /// One completion; the ending, once the job is over.
    fn on_completion(&mut self, c: Completion) -> Result<Option<Ending>> {
        match c {
            Completion::Message { link, data } => match self.by_link.get(&link) {
                Some(&node) => Ok(self.on_message(node, &data)),
                None => self.on_joining(link, &data),
            },
            Completion::Closed { link, error } => {
                crate::postoffice::drain_accepted(self.t, &mut self.joining);
                self.joining.remove(&link);
                self.nonces.remove(&link);
                match self.by_link.get(&link) {
                    Some(&node) if !self.m.finished(node) => {
                        tracing::warn!(
                            "scheduler: {} {} left: {}",
                            node.0.name(),
                            node.1,
                            crate::postoffice::closed_why(&error)
                        );
                        Ok(self.feed(Event::Closed { node }))
                    }
                    _ => Ok(self.feed(Event::Tick)),
                }
            }
            Completion::WriteImm { .. } => Ok(self.feed(Event::Tick)),
        }
    }

    /// A message from a node of the job.
    fn on_message(&mut self, node: Node, data: &[u8]) -> Option<Ending> {
        let msg = match Msg::decode(data) {
            Ok(m) => Some(m),
            Err(e) => {
                tracing::warn!("scheduler: {e} from {} {}", node.0.name(), node.1);
                None
            }
        };
        if let Some(m) = &msg {
            lock(&self.board).on_message(node.0, node.1, m);
        }
        if let Some(Msg::IterationDone {
            threads,
            tasks,
            nanos,
        }) = &msg
            && node.0 == Role::Worker
        {
            self.advise(node.1, *threads, *tasks, *nanos);
        }
        self.feed(Event::Message { node, msg })
    }

    /// The supervisor: project, re-plan, advise whose count changed.
    fn advise(&mut self, worker: u32, threads: u32, tasks: u32, nanos: u64) {
        self.supervisor
            .report(worker, threads as usize, tasks, Duration::from_nanos(nanos));
        let now = self.supervisor.all_threads();
        for (w, (&new, old)) in now.iter().zip(self.advised.iter_mut()).enumerate() {
            let to = (Role::Worker, w as u32);
            if new != *old
                && self.m.is_live(to)
                && let Some(l) = self.nodes.get(&to)
            {
                let m = Msg::Threads {
                    threads: new as u32,
                };
                let _ = l.send(&m.encode());
                lock(&self.board).threads(w as u32, new as u64);
            }
            *old = new;
        }
        let classes = self
            .supervisor
            .verdict()
            .classes
            .iter()
            .map(class_name)
            .collect();
        let report = self.m.report_mut();
        report.parallelism_plans = self.supervisor.plans();
        report.threads = now;
        report.classes = classes;
    }

    /// A message on a link not of the job: a node asking to join it (a server restarted from
    /// its checkpoint, a worker rejoining).
    fn on_joining(&mut self, link: LinkId, data: &[u8]) -> Result<Option<Ending>> {
        let Some(l) = crate::postoffice::known_link(self.t, &mut self.joining, link) else {
            return Ok(None);
        };
        let refusal = match Msg::decode(data) {
            Ok(Msg::Knock) => {
                auth::challenge(&l, &mut self.nonces)?;
                return Ok(None);
            }
            Ok(Msg::Hello {
                role,
                rank,
                proof,
                addr,
                ..
            }) => {
                self.joining.remove(&link);
                let proof_ok = self
                    .nonces
                    .remove(&link)
                    .is_some_and(|n| auth::check(&self.cfg.token, Purpose::Hello, &n, &proof));
                match self.m.admit(role, rank, proof_ok) {
                    Ok(r) => return Ok(self.rejoin(l, (role, r), addr)),
                    Err(reason) => reason,
                }
            }
            Ok(other) => {
                self.joining.remove(&link);
                format!("expected a hello, got {}", other.name())
            }
            Err(e) => {
                self.joining.remove(&link);
                e.to_string()
            }
        };
        refuse(&l, refusal, self.m.report_mut());
        Ok(None)
    }

    /// Admits `node` into the running job on `l`: its book, then the membership's welcome.
    fn rejoin(&mut self, l: Link, node: Node, addr: String) -> Option<Ending> {
        let (role, r) = node;
        if role == Role::Server {
            self.book.servers[r as usize] = addr.clone();
        }
        let b = Book {
            rank: r,
            host_peers: host_peers(&self.hosts, &addr),
            rejoin: true,
            barriers: self.m.barriers_fallen(),
            ..self.book.clone()
        };
        if l.send(&Msg::Book(b).encode()).is_err() {
            return None;
        }
        let link = l.id();
        if let Some(old) = self.nodes.insert(node, l) {
            self.by_link.remove(&old.id());
        }
        self.by_link.insert(link, node);
        self.feed(Event::Joined { node, addr })
    }

    /// Hands `ev` to the membership now and carries out its actions; the ending, if it ended
    /// the job.
    fn feed(&mut self, ev: Event) -> Option<Ending> {
        let membership = !matches!(ev, Event::Message { .. });
        self.m.on_event(ev, Instant::now(), &mut self.out);
        if membership {
            // Who is live, for the metrics: after a tick (where silence becomes death), a
            // closed link or a join, not after every message.
            let mut b = lock(&self.board);
            for &node in self.nodes.keys() {
                b.set_live(node.0, node.1, self.m.is_live(node));
            }
        }
        let mut ending = None;
        for a in self.out.drain(..) {
            match a {
                Action::Send { to, msg } => {
                    if let Some(l) = self.nodes.get(&to) {
                        let _ = l.send(&msg.encode());
                    }
                }
                Action::Broadcast { to, msg } => {
                    let bytes = msg.encode();
                    for l in to.iter().filter_map(|n| self.nodes.get(n)) {
                        let _ = l.send(&bytes);
                    }
                }
                Action::Close { node } => {
                    if let Some(l) = self.nodes.get(&node) {
                        l.close();
                    }
                }
                Action::End(how) => ending = Some(how),
            }
        }
        ending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn untils(plan: &[SuperstepPlan]) -> Vec<u64> {
        plan.iter().map(|p| p.until).collect()
    }

    #[test]
    fn workers_whose_models_differ_are_told_which_tensor_and_which_ranks() {
        let t = |n: &str, len| TensorSpec::new(n, len);
        let of = |w: &[(u32, Vec<TensorSpec>)]| {
            let m: BTreeMap<(Role, u32), Vec<TensorSpec>> = w
                .iter()
                .map(|(r, t)| ((Role::Worker, *r), t.clone()))
                .collect();
            agreed_tensors(&m)
        };
        let base = vec![t("fc.weight", 100), t("fc.bias", 10)];
        assert_eq!(of(&[(0, base.clone()), (1, base.clone())]).unwrap(), base);
        let e = of(&[
            (0, base.clone()),
            (1, base.clone()),
            (2, vec![t("fc.weight", 200), t("fc.bias", 10)]),
        ])
        .unwrap_err();
        assert!(e.starts_with("tensor 'fc.weight' is 100 floats on worker 0 and 200 on worker 2: the workers' models differ"), "{e}");
        let e = of(&[(0, base.clone()), (3, vec![t("fc.weight", 100)])]).unwrap_err();
        assert!(
            e.starts_with(
                "tensor 'fc.bias' (10 floats) is declared by worker 0 but not by worker 3"
            ),
            "{e}"
        );
        let e = of(&[
            (0, base.clone()),
            (1, vec![t("fc.bias", 10), t("fc.weight", 100)]),
        ])
        .unwrap_err();
        assert!(
            e.starts_with(
                "worker 0 declares 'fc.weight' as tensor 0 and worker 1 declares 'fc.bias' there"
            ),
            "{e}"
        );
        // A tensor that is bfloat16 on one worker and float32 on another.
        let half = TensorSpec {
            wire: Some(crate::precision::Wire::Bf16),
            ..t("fc.weight", 100)
        };
        let e = of(&[(0, base.clone()), (1, vec![half, t("fc.bias", 10)])]).unwrap_err();
        assert!(
            e.starts_with("tensor 'fc.weight' is float32 on worker 0 and bfloat16 on worker 1"),
            "{e}"
        );
        // An empty declaration defers to the others.
        assert_eq!(of(&[(0, vec![]), (1, base.clone())]).unwrap(), base);
    }

    #[test]
    fn hosts_are_counted_from_advertised_addresses() {
        let addrs = [
            "host=a-1;tcp=10.0.0.1:9000;shm=/run/x.sock",
            "host=a-1;tcp=10.0.0.1:9001",
            // Workers advertise their host alone (they accept no links).
            "host=a-1",
            "host=b-2",
            "garbage",
        ]
        .map(String::from);
        let hosts = per_host(addrs.iter());
        assert_eq!(hosts.get("a-1"), Some(&3));
        assert_eq!(hosts.get("b-2"), Some(&1));
        assert_eq!(hosts.get("garbage"), Some(&1));
        assert_eq!(host_peers(&hosts, "host=a-1"), 3);
        assert_eq!(host_peers(&hosts, "host=b-2;tcp=10.0.0.2:9000"), 1);
        // A node on a host not seen at the start (one rejoining elsewhere) counts itself.
        assert_eq!(host_peers(&hosts, "host=c-3"), 1);
        assert_eq!(host_of("tcp=1.2.3.4:5;host=z"), "z");
    }

    #[test]
    fn superstep_plans_equalize_the_barrier_and_stay_within_r() {
        // 1, 2 and 4 ms per iteration, R = 4: all three can end together at 4 ms.
        let ms = 1_000_000;
        let plan = plan_superstep(&[(0, 10, ms), (1, 7, 2 * ms), (2, 3, 4 * ms)], 4);
        assert_eq!(untils(&plan), vec![14, 9, 4]);
        // Unknown intervals take the mean of the known ones (here 2 ms for worker 2).
        let plan = plan_superstep(&[(0, 5, ms), (1, 5, 3 * ms), (2, 5, 0)], 3);
        assert_eq!(plan[2].interval_ns, 2 * ms);
        // Nobody known: one iteration each.
        let plan = plan_superstep(&[(0, 5, 0), (1, 9, 0)], 8);
        assert_eq!(untils(&plan), vec![6, 10]);
        assert!(plan_superstep(&[], 4).is_empty());
        // Predictions saturate rather than overflow.
        let plan = plan_superstep(&[(0, 3, u64::MAX), (1, 4, u64::MAX / 3)], 5);
        assert!(plan.iter().all(|p| (1..=5).contains(&(p.until - p.clock))));
        // Always 1 ≤ until − clock ≤ R, whatever the intervals (R = 0 is taken as 1).
        let mut rng = fastrand::Rng::with_seed(5);
        for _ in 0..500 {
            let r = rng.u32(0..9);
            let at: Vec<(u32, u64, u64)> = (0..rng.u32(1..7))
                .map(|w| {
                    (
                        w,
                        rng.u64(0..1000),
                        rng.u64(0..5) * rng.u64(0..100) * [1, 1_000, 1_000_000][rng.usize(0..3)],
                    )
                })
                .collect();
            let plan = plan_superstep(&at, r);
            assert_eq!(plan.len(), at.len());
            for (p, a) in plan.iter().zip(&at) {
                assert_eq!((p.worker, p.clock), (a.0, a.1));
                assert!((1..=u64::from(r.max(1))).contains(&(p.until - p.clock)));
            }
            // A faster worker is never planned fewer iterations than a slower one.
            for p in &plan {
                for q in &plan {
                    if p.interval_ns < q.interval_ns {
                        assert!(p.until - p.clock >= q.until - q.clock, "{p:?} vs {q:?}");
                    }
                }
            }
        }
    }
}
