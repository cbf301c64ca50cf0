//! The tcp admission wall under attack, on live jobs of real `falcon role` processes
//! (a scheduler, 2 servers, 4 workers, tcp, a job token, the `count` workload).
//!
//! The attacker is this test process: raw `std::net::TcpStream`s speaking the wire format by
//! hand, without the job token, bounded in count and time, on loopback only. Each test is a
//! row of the README's reliability table: it asserts that the job is not hurt (it finishes,
//! every gradient applied exactly once, no node declared dead, no link lost) and measures the
//! scheduler's and one server's resident memory, threads and descriptors (`/proc/PID`) before,
//! during and after the attack; each prints one `WALL row N:` line of figures.
//!
//! 1. A peer without the token pipelines control messages, or replays a captured legitimate
//!    stream: it never gets a link, and heartbeats keep being processed.
//! 2. Frame headers announcing 8 GiB, then a trickle: no memory is reserved for them, and
//!    the connections are closed at once (or at the handshake deadline, for a header that
//!    itself trickles in).
//! 3. 200 silent or trickling connections per listener: no thread each, descriptors bounded
//!    by the wall's caps, every one closed by the handshake deadline.
//! 4. 2000 connect-and-close cycles per listener leave no descriptor behind.
//!
//! The tests run one at a time (a lock): each job's figures are its own.

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::{FALCON, Job, first_parameter, number_after};

const SERVERS: u32 = 2;
const WORKERS: u32 = 4;
/// The handshake deadline of `falcon role` (`TransportConfig::handshake_timeout`'s default;
/// no environment variable sets it).
const DEADLINE: Duration = Duration::from_secs(5);
/// The wall's caps (`TransportConfig::max_handshakes`, `max_handshakes_per_source`).
const MAX_PENDING: usize = 128;
const MAX_PER_SOURCE: usize = 32;
/// Slack for a loaded 2-core machine: a deadline is met if it is met this late.
const LATE: Duration = Duration::from_millis(1000);
/// "Closed at once": well under the deadline.
const AT_ONCE: Duration = Duration::from_millis(1000);

const FRAME_HEADER: usize = 48;
/// The transport's wire version (`transport/src/wire.rs`).
const WIRE_VERSION: u16 = 3;
const OP_HELLO: u16 = 1;
const OP_SEND: u16 = 3;
const OP_ERROR: u16 = 6;
const OP_PROOF: u16 = 8;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

// ---------------------------------------------------------------------------------------
// The job.

/// A role process whose output is read as it comes.
struct Proc {
    what: String,
    child: Child,
    out: Arc<Mutex<String>>,
    err: Arc<Mutex<String>>,
    readers: Vec<JoinHandle<()>>,
}

impl Proc {
    /// Starts a role with the job's variables and `extra`; with `nofile`, under that limit of
    /// open descriptors (`ulimit -n`, then `exec`: the pid is the role's).
    fn spawn(
        job: &Job,
        role: &str,
        rank: Option<u32>,
        extra: &[(&str, String)],
        nofile: Option<u32>,
    ) -> Proc {
        let mut c = match nofile {
            None => Command::new(FALCON),
            Some(n) => {
                let mut c = Command::new("sh");
                c.arg("-c")
                    .arg(format!("ulimit -n {n} && exec \"$0\" \"$@\""))
                    .arg(FALCON);
                c
            }
        };
        c.arg("role")
            .env("DMLC_ROLE", role)
            .envs(job.vars.iter().map(|(k, v)| (k, v)))
            .envs(extra.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(r) = rank {
            c.env("FALCON_RANK", r.to_string());
        }
        let mut child = c.spawn().expect("spawn role");
        let out = Arc::new(Mutex::new(String::new()));
        let err = Arc::new(Mutex::new(String::new()));
        let read = |from: Box<dyn Read + Send>, into: Arc<Mutex<String>>| {
            std::thread::spawn(move || {
                for line in BufReader::new(from).lines() {
                    let Ok(line) = line else { break };
                    let mut s = into.lock().unwrap();
                    s.push_str(&line);
                    s.push('\n');
                }
            })
        };
        let readers = vec![
            read(Box::new(child.stdout.take().unwrap()), out.clone()),
            read(Box::new(child.stderr.take().unwrap()), err.clone()),
        ];
        let what = match rank {
            Some(r) => format!("{role} {r}"),
            None => role.to_string(),
        };
        Proc {
            what,
            child,
            out,
            err,
            readers,
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn stdout(&self) -> String {
        self.out.lock().unwrap().clone()
    }

    fn running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// Waits for the exit (killing it after `limit`); returns its status, stdout and stderr.
    fn wait(mut self, limit: Duration) -> Ended {
        let status = common::wait_for(&mut self.child, limit);
        let _ = self.child.wait();
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
        Ended {
            what: self.what.clone(),
            ok: status.is_some_and(|s| s.success()),
            status: format!("{status:?}"),
            out: self.stdout(),
            err: self.err.lock().unwrap().clone(),
        }
    }
}

/// A role that ended.
struct Ended {
    what: String,
    ok: bool,
    status: String,
    out: String,
    err: String,
}

impl Ended {
    /// Its output, without worker 0's progress lines.
    fn dump(&self) -> String {
        let out: String = self
            .out
            .lines()
            .filter(|l| !l.contains(" iteration "))
            .map(|l| format!("{l}\n"))
            .collect();
        format!("--- {} ({}):\n{out}{}", self.what, self.status, self.err)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The attacked jobs' settings (SSP over tcp, the count workload, 4 shards on 2 servers),
/// and the job's id.
fn wall_job(name: &str, iters: u64) -> (Job, u64) {
    let iters_s = iters.to_string();
    let job = Job::new(
        name,
        SERVERS,
        WORKERS,
        &[
            ("FALCON_POLICY", "ssp(2)"),
            ("FALCON_MEDIUM", "tcp"),
            ("FALCON_WORKLOAD", "count"),
            ("FALCON_ITERS", &iters_s),
            ("FALCON_FLOATS", "4096"),
            ("FALCON_MAX_SHARD_BYTES", "4096"),
        ],
    );
    let name = &job
        .vars
        .iter()
        .rev()
        .find(|(k, _)| k == "FALCON_JOB")
        .unwrap()
        .1;
    let id = falcon_engine::config::job_hash(name);
    (job, id)
}

/// A live job, and where its scheduler and server 0 listen.
struct Live {
    job: Job,
    iters: u64,
    job_id: u64,
    scheduler_addr: SocketAddr,
    server_addr: SocketAddr,
    scheduler: Proc,
    servers: Vec<Proc>,
    workers: Vec<Proc>,
}

impl Live {
    /// Starts a job of `iters` iterations and returns once it trains. `worker3_via`, given
    /// the scheduler's address, may name another port for worker 3 to reach it by (a proxy).
    ///
    /// `nofile`: a limit of open descriptors for the attacked roles (the scheduler, server 0).
    fn start(
        name: &str,
        iters: u64,
        nofile: Option<u32>,
        worker3_via: impl FnOnce(SocketAddr) -> Option<u16>,
    ) -> Live {
        let (job, job_id) = wall_job(name, iters);
        let scheduler_addr = SocketAddr::from(([127, 0, 0, 1], job.port));
        let worker3_via = worker3_via(scheduler_addr);
        let scheduler = Proc::spawn(&job, "scheduler", None, &[], nofile);
        let servers = (0..SERVERS)
            .map(|r| {
                let nofile = if r == 0 { nofile } else { None };
                Proc::spawn(&job, "server", Some(r), &[], nofile)
            })
            .collect();
        let workers = (0..WORKERS)
            .map(|r| {
                let via = match (r, worker3_via) {
                    (3, Some(p)) => vec![("DMLC_PS_ROOT_PORT", p.to_string())],
                    _ => vec![],
                };
                Proc::spawn(&job, "worker", Some(r), &via, None)
            })
            .collect();
        let mut live = Live {
            job,
            iters,
            job_id,
            scheduler_addr,
            server_addr: SocketAddr::from(([0, 0, 0, 0], 0)),
            scheduler,
            servers,
            workers,
        };
        // Every worker has joined (the start barrier) once worker 0 reports its first
        // iteration: every link is up.
        let start = Instant::now();
        while !live.workers[0].stdout().contains("worker 0 iteration") {
            assert!(
                live.all_running(),
                "a role ended before training began:\n{}",
                live.dump()
            );
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "the job did not start training in 30 s:\n{}",
                live.dump()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        // Server 0 listens on a port of its own choosing (no port picked here and bound
        // there: another connection may take it meanwhile).
        let ports = listening_ports(live.servers[0].pid());
        assert_eq!(
            ports.len(),
            1,
            "server 0 listens on one tcp port: {ports:?}"
        );
        live.server_addr = SocketAddr::from(([127, 0, 0, 1], ports[0]));
        // Let the links settle (first heartbeats, checkpoints) before the baseline.
        std::thread::sleep(Duration::from_millis(300));
        live
    }

    fn all_running(&mut self) -> bool {
        let mut all = self.scheduler.running();
        for p in self.servers.iter_mut().chain(self.workers.iter_mut()) {
            all &= p.running();
        }
        all
    }

    /// The attack is over: the job must still have been running.
    fn still_running(&mut self, row: u32) {
        assert!(
            self.all_running(),
            "row {row}: the job ended (or a role died) before the attack was over; give it more iterations:\n{}",
            self.dump()
        );
    }

    /// Every role's output so far.
    fn dump(&self) -> String {
        std::iter::once(&self.scheduler)
            .chain(&self.servers)
            .chain(&self.workers)
            .map(|p| format!("--- {}:\n{}{}", p.what, p.stdout(), p.err.lock().unwrap()))
            .collect()
    }

    fn pids(&self) -> [u32; 2] {
        [self.scheduler.pid(), self.servers[0].pid()]
    }

    /// Waits for the job to finish and checks it: every role succeeded, no node was declared
    /// dead or rejoined, no worker lost a link, and every shard's parameters count exactly
    /// the gradients pushed (each applied once). Returns the scheduler's stderr and worker 0's
    /// stdout.
    fn finish(self) -> (String, String) {
        let limit = Duration::from_secs(60);
        let Live {
            job,
            iters,
            scheduler,
            servers,
            workers,
            ..
        } = self;
        let workers: Vec<Ended> = workers.into_iter().map(|w| w.wait(limit)).collect();
        let servers: Vec<Ended> = servers.into_iter().map(|s| s.wait(limit)).collect();
        let scheduler = scheduler.wait(limit);
        let all = || {
            std::iter::once(&scheduler)
                .chain(&servers)
                .chain(&workers)
                .map(Ended::dump)
                .collect::<String>()
        };
        let failed: Vec<&str> = std::iter::once(&scheduler)
            .chain(&servers)
            .chain(&workers)
            .filter(|e| !e.ok)
            .map(|e| e.what.as_str())
            .collect();
        assert!(failed.is_empty(), "{failed:?} failed:\n{}", all());
        let (sched_out, sched_err) = (&scheduler.out, &scheduler.err);
        assert!(
            sched_out.contains("job done") && sched_out.contains("dead: []; rejoined: []"),
            "the scheduler declared nodes dead or rejoined:\n{}",
            all()
        );
        for (r, Ended { out, .. }) in workers.iter().enumerate() {
            let line = out
                .lines()
                .find(|l| l.starts_with(&format!("worker {r}: ")))
                .unwrap_or_else(|| panic!("worker {r} report missing:\n{out}"));
            assert!(
                line.contains(&format!("{iters} iterations"))
                    && line.contains("reconnects 0")
                    && line.contains("lost updates 0"),
                "worker {r}: {line}"
            );
        }
        let mut shards = 0;
        for Ended { out, .. } in &servers {
            for line in out.lines().filter(|l| l.contains("first parameter")) {
                let first = first_parameter(line);
                let seqs = number_after(line, "sequence numbers").unwrap();
                let skipped = number_after(line, "applied +").unwrap();
                // Constant gradients of −1 at step 1/8: the values count the gradients applied.
                let applied = (first / 0.125).round() as u64;
                assert_eq!(
                    (applied, seqs, skipped),
                    (WORKERS as u64 * iters, WORKERS as u64 * iters, 0),
                    "every gradient applied exactly once: {line}"
                );
                shards += 1;
            }
        }
        // 4096 floats in 4 KiB shards.
        assert_eq!(shards, 4, "every shard reported");
        drop(job);
        (sched_err.clone(), workers[0].out.clone())
    }
}

/// Iterations for a job that trains through an attack of about `attack` seconds (and its
/// measurements after), with a margin: the pace of an undisturbed job is measured once.
fn iters_for(attack: f64) -> u64 {
    static PACE: OnceLock<f64> = OnceLock::new();
    let pace = *PACE.get_or_init(|| {
        let live = Live::start("wall-pace", 60, None, |_| None);
        let (_, worker0) = live.finish();
        let line = worker0
            .lines()
            .find(|l| l.starts_with("worker 0: "))
            .unwrap();
        let pace: f64 = line
            .split(" it/s")
            .next()
            .and_then(|t| t.rsplit('(').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no pace in {line}"));
        eprintln!("WALL pace: an undisturbed job trains {pace:.1} iterations/s");
        pace
    });
    (pace * (attack * 1.5 + 2.5)).ceil().max(40.0) as u64
}

/// The tcp ports process `pid` listens on (its sockets' inodes, found in its network
/// namespace's table).
fn listening_ports(pid: u32) -> Vec<u16> {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .collect();
    let table = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).unwrap();
    let mut ports: Vec<u16> = table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // local address, state (0A: listening), inode.
            let listening = f.get(3) == Some(&"0A");
            (listening && inodes.iter().any(|i| Some(&i.as_str()) == f.get(9)))
                .then(|| u16::from_str_radix(f[1].rsplit(':').next()?, 16).ok())
                .flatten()
        })
        .collect();
    ports.sort_unstable();
    ports.dedup();
    ports
}

// ---------------------------------------------------------------------------------------
// What the attacked processes hold.

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Usage {
    rss_kib: u64,
    threads: u64,
    fds: u64,
}

/// No thread of an attacker's own (peak within 2 of before) and no descriptor left behind
/// (after within 3 of before), for both attacked processes.
fn no_threads_nor_fds_held(row: &str, before: &[Usage], peaks: &[Usage], after: &[Usage]) {
    for t in 0..2 {
        assert!(
            peaks[t].threads <= before[t].threads + 2,
            "{row}: {} threads {} -> {}",
            TARGETS[t],
            before[t].threads,
            peaks[t].threads
        );
        assert!(
            after[t].fds <= before[t].fds + 3,
            "{row}: {} fds {} -> {} after",
            TARGETS[t],
            before[t].fds,
            after[t].fds
        );
    }
}

impl Usage {
    fn of(pid: u32) -> Usage {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64);
        Usage {
            rss_kib: field("VmRSS:"),
            threads: field("Threads:"),
            fds,
        }
    }

    fn max(self, o: Usage) -> Usage {
        Usage {
            rss_kib: self.rss_kib.max(o.rss_kib),
            threads: self.threads.max(o.threads),
            fds: self.fds.max(o.fds),
        }
    }

    fn mib(self) -> f64 {
        self.rss_kib as f64 / 1024.0
    }
}

/// Samples processes every 10 ms until stopped; keeps the peaks.
struct Watch {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<Vec<Usage>>,
}

impl Watch {
    fn start(pids: &[u32]) -> Watch {
        let stop = Arc::new(AtomicBool::new(false));
        let pids = pids.to_vec();
        let handle = std::thread::spawn({
            let stop = stop.clone();
            move || {
                let mut peak = vec![Usage::default(); pids.len()];
                loop {
                    for (p, pid) in peak.iter_mut().zip(&pids) {
                        *p = p.max(Usage::of(*pid));
                    }
                    if stop.load(Ordering::Acquire) {
                        return peak;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        });
        Watch { stop, handle }
    }

    fn peaks(self) -> Vec<Usage> {
        self.stop.store(true, Ordering::Release);
        self.handle.join().unwrap()
    }
}

// ---------------------------------------------------------------------------------------
// The attack client: the wire format by hand.

fn header(op: u16, len: u64, region: u64, offset: u64) -> [u8; FRAME_HEADER] {
    let mut h = [0u8; FRAME_HEADER];
    h[0..4].copy_from_slice(b"FLCN");
    h[4..6].copy_from_slice(&WIRE_VERSION.to_le_bytes());
    h[6..8].copy_from_slice(&op.to_le_bytes());
    // imm (the medium asked: tcp), flags: 0.
    h[16..24].copy_from_slice(&region.to_le_bytes());
    h[24..32].copy_from_slice(&offset.to_le_bytes());
    h[32..40].copy_from_slice(&len.to_le_bytes());
    h
}

fn random_bytes(n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    fastrand::fill(&mut v);
    v
}

/// A hello that names the right job (its FNV-1a hash: all the job name gives away).
fn hello(job: u64) -> Vec<u8> {
    let mut v = header(OP_HELLO, 32, job, fastrand::u64(..)).to_vec();
    v.extend(random_bytes(32));
    v
}

/// A proof made without the token.
fn bad_proof() -> Vec<u8> {
    let mut v = header(OP_PROOF, 32, 0, 0).to_vec();
    v.extend(random_bytes(32));
    v
}

/// The complete records of a byte stream: (op, byte range).
fn records(bytes: &[u8]) -> Vec<(u16, std::ops::Range<usize>)> {
    let mut out = Vec::new();
    let mut at = 0;
    while bytes.len() >= at + FRAME_HEADER && &bytes[at..at + 4] == b"FLCN" {
        let op = u16::from_le_bytes(bytes[at + 6..at + 8].try_into().unwrap());
        let len = u64::from_le_bytes(bytes[at + 32..at + 40].try_into().unwrap());
        let end = at as u64 + FRAME_HEADER as u64 + len;
        if end > bytes.len() as u64 {
            break;
        }
        out.push((op, at..end as usize));
        at = end as usize;
    }
    out
}

/// Connects to `to` from the source address `from`.
fn connect(from: IpAddr, to: SocketAddr) -> TcpStream {
    use socket2::{Domain, Socket, Type};
    let s = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    s.bind(&SocketAddr::new(from, 0).into()).unwrap();
    s.connect_timeout(&to.into(), Duration::from_secs(3))
        .unwrap_or_else(|e| panic!("connect {from} -> {to}: {e} (did the job end early?)"));
    s.into()
}

/// The loopback source addresses the attack may use (127.0.0.2.. when the kernel routes
/// all of 127/8 to loopback, as Linux does; else 127.0.0.1 alone).
fn sources(n: u8) -> Vec<IpAddr> {
    let all: Vec<IpAddr> = (2..2 + n)
        .map(|i| IpAddr::V4(Ipv4Addr::new(127, 0, 0, i)))
        .collect();
    if TcpListener::bind((all[n as usize - 1], 0)).is_ok() {
        all
    } else {
        vec![IpAddr::V4(Ipv4Addr::LOCALHOST)]
    }
}

/// One attack connection, watched until the other end closes it.
struct Conn {
    s: TcpStream,
    target: usize,
    kind: usize,
    start: Instant,
    /// When the peer closed it (from `start`).
    closed: Option<Duration>,
    /// What the peer sent.
    got: Vec<u8>,
    /// Bytes to trickle, one a second.
    trickle: Vec<u8>,
    next_trickle: Instant,
}

impl Conn {
    /// `burst` is sent at once; then `trickle`, a byte a second.
    fn open(s: TcpStream, target: usize, kind: usize, burst: &[u8], trickle: Vec<u8>) -> Conn {
        let start = Instant::now();
        let mut c = Conn {
            s,
            target,
            kind,
            start,
            closed: None,
            got: Vec::new(),
            trickle,
            next_trickle: start,
        };
        if !burst.is_empty() {
            // The peer may refuse and reset before all of it went: that is its answer.
            let _ = c.s.write_all(burst);
        }
        c.s.set_nonblocking(true).unwrap();
        c
    }

    /// Reads what came; trickles what is due. Returns whether it is still open.
    fn poll(&mut self, now: Instant) -> bool {
        if self.closed.is_some() {
            return false;
        }
        let mut buf = [0u8; 4096];
        loop {
            match self.s.read(&mut buf) {
                Ok(0) => break self.close(now),
                Ok(n) => self.got.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                // Reset: closed with our bytes unread.
                Err(_) => break self.close(now),
            }
        }
        if self.closed.is_none() && !self.trickle.is_empty() && now >= self.next_trickle {
            match self.s.write(&self.trickle[..1]) {
                Ok(1) => {
                    self.trickle.remove(0);
                    self.next_trickle += Duration::from_secs(1);
                }
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => self.close(now),
            }
        }
        self.closed.is_none()
    }

    fn close(&mut self, now: Instant) {
        self.closed = Some(now - self.start);
        // Nothing more goes out on it.
        let _ = self.s.shutdown(std::net::Shutdown::Both);
    }

    /// Whether the peer held it past [`AT_ONCE`] (or still holds it): it waited for admission.
    fn held(&self) -> bool {
        self.closed.is_none_or(|d| d >= AT_ONCE)
    }

    /// The ops the peer sent (its hello, perhaps a refusal; never a proof).
    fn ops(&self) -> Vec<u16> {
        records(&self.got).into_iter().map(|(op, _)| op).collect()
    }
}

/// Watches `conns` until every one is closed or `limit` passed, sampling `pids` meanwhile.
fn watch_until_closed(conns: &mut [Conn], limit: Duration) {
    let start = Instant::now();
    loop {
        let now = Instant::now();
        let mut open = 0;
        for c in conns.iter_mut() {
            open += c.poll(now) as usize;
        }
        if open == 0 || start.elapsed() > limit {
            return;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// No connection was admitted: none was sent a proof.
fn none_admitted(conns: &[Conn], row: u32) {
    for (i, c) in conns.iter().enumerate() {
        assert!(
            !c.ops().contains(&OP_PROOF),
            "row {row}: attack connection {i} (kind {}) to the {} was sent a proof, admitted: ops {:?}",
            c.kind,
            TARGETS[c.target],
            c.ops()
        );
    }
}

/// What becomes of a new connection: greeted (the wall's hello) or closed unanswered.
fn newcomer_fate(to: SocketAddr) -> String {
    let start = Instant::now();
    let mut s = TcpStream::connect(to).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) => {
                return format!(
                    "was closed unanswered after {:.3} s ({} bytes)",
                    secs(start.elapsed()),
                    got.len()
                );
            }
            Ok(n) => {
                got.extend_from_slice(&buf[..n]);
                if records(&got).first().is_some_and(|r| r.0 == OP_HELLO) {
                    return format!("was greeted in {:.3} s", secs(start.elapsed()));
                }
            }
            Err(e) => return format!("got {e} after {:.3} s", secs(start.elapsed())),
        }
    }
}

/// A fresh connection is greeted with the wall's hello (for the right job) within a second:
/// the listener still admits.
fn still_greets(to: SocketAddr, job: u64) -> Duration {
    let start = Instant::now();
    let mut s = TcpStream::connect(to).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    let mut h = [0u8; FRAME_HEADER + 32];
    s.read_exact(&mut h)
        .unwrap_or_else(|e| panic!("{to} sent no hello to a fresh connection: {e}"));
    let rec = records(&h);
    assert_eq!(rec.len(), 1, "{to}: a hello record");
    assert_eq!(rec[0].0, OP_HELLO, "{to}: a hello");
    assert_eq!(u64::from_le_bytes(h[16..24].try_into().unwrap()), job);
    start.elapsed()
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn max_closed(conns: &[Conn], pick: impl Fn(&Conn) -> bool) -> Duration {
    conns
        .iter()
        .filter(|c| pick(c))
        .map(|c| c.closed.unwrap_or(Duration::MAX))
        .max()
        .unwrap_or_default()
}

fn min_closed(conns: &[Conn], pick: impl Fn(&Conn) -> bool) -> Duration {
    conns
        .iter()
        .filter(|c| pick(c))
        .map(|c| c.closed.unwrap_or(Duration::MAX))
        .min()
        .unwrap_or_default()
}

const TARGETS: [&str; 2] = ["scheduler", "server 0"];

// ---------------------------------------------------------------------------------------
// Row 1: a peer without the token pipelines control messages, or replays a captured stream.

/// A tcp proxy in front of the scheduler that records what its first client sends.
struct Recorder {
    port: u16,
    captured: Arc<Mutex<Vec<u8>>>,
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl Recorder {
    fn start(to: SocketAddr) -> Recorder {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        l.set_nonblocking(true).unwrap();
        let captured = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let handle = std::thread::spawn({
            let (captured, stop) = (captured.clone(), stop.clone());
            move || {
                let mut first = true;
                while !stop.load(Ordering::Acquire) {
                    let client = match l.accept() {
                        Ok((c, _)) => c,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            std::thread::sleep(Duration::from_millis(10));
                            continue;
                        }
                        Err(_) => return,
                    };
                    client.set_nonblocking(false).unwrap();
                    // The scheduler may still be starting.
                    let t = Instant::now();
                    let upstream = loop {
                        match TcpStream::connect(to) {
                            Ok(u) => break Some(u),
                            Err(_) if t.elapsed() < Duration::from_secs(5) => {
                                std::thread::sleep(Duration::from_millis(20))
                            }
                            Err(_) => break None,
                        }
                    };
                    let Some(upstream) = upstream else { continue };
                    let record = first.then(|| captured.clone());
                    first = false;
                    pipe(
                        client.try_clone().unwrap(),
                        upstream.try_clone().unwrap(),
                        record,
                    );
                    pipe(upstream, client, None);
                }
            }
        });
        Recorder {
            port,
            captured,
            stop,
            handle: Some(handle),
        }
    }

    fn captured(&self) -> Vec<u8> {
        self.captured.lock().unwrap().clone()
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Copies `from` to `to` on a thread, recording the first 64 KiB into `record`.
fn pipe(mut from: TcpStream, mut to: TcpStream, record: Option<Arc<Mutex<Vec<u8>>>>) {
    std::thread::spawn(move || {
        let mut buf = [0u8; 16 * 1024];
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if let Some(r) = &record {
                let mut r = r.lock().unwrap();
                let room = (64 * 1024usize).saturating_sub(r.len());
                r.extend_from_slice(&buf[..n.min(room)]);
            }
            if to.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = to.shutdown(std::net::Shutdown::Both);
        let _ = from.shutdown(std::net::Shutdown::Both);
    });
}

/// "RSS 6.1/6.3/6.2 MiB, threads 12/12/12, fds 20/148/20" (before/peak during/after).
fn figures(before: Usage, peak: Usage, after: Usage) -> String {
    format!(
        "RSS {:.1}/{:.1}/{:.1} MiB, threads {}/{}/{}, fds {}/{}/{}",
        before.mib(),
        peak.mib(),
        after.mib(),
        before.threads,
        peak.threads,
        after.threads,
        before.fds,
        peak.fds,
        after.fds
    )
}

fn count_lines(text: &str, needle: &str) -> usize {
    text.lines().filter(|l| l.contains(needle)).count()
}

#[test]
fn row1_a_peer_without_the_token_pipelining_or_replaying_never_gets_a_link() {
    let _serial = serial();
    // Worker 3 reaches the scheduler through a recorder: its stream is captured.
    let mut recorder = None;
    let mut live = Live::start("wall-row1", iters_for(5.5), None, |scheduler| {
        let r = Recorder::start(scheduler);
        let port = r.port;
        recorder = Some(r);
        Some(port)
    });
    let recorder = recorder.unwrap();
    // Worker 3's heartbeats follow its admission: let a few of them into the capture.
    let t = Instant::now();
    let sends_in = |bytes: &[u8]| {
        records(bytes)
            .iter()
            .filter(|(op, _)| *op == OP_SEND)
            .count()
    };
    while sends_in(&recorder.captured()) < 8 && t.elapsed() < Duration::from_millis(1500) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let captured = recorder.captured();
    let recs = records(&captured);
    assert!(
        recs.len() >= 2 && recs[0].0 == OP_HELLO && recs[1].0 == OP_PROOF,
        "worker 3's stream starts with its hello and proof: {:?}",
        recs.iter().map(|r| r.0).collect::<Vec<_>>()
    );
    // The control messages a member sent once admitted (knock, hello, heartbeats, ...).
    let sends: Vec<_> = recs
        .iter()
        .filter(|(op, _)| *op == OP_SEND)
        .take(8)
        .collect();
    assert!(
        sends.len() >= 2,
        "worker 3 sent control messages: {:?}",
        recs.iter().map(|r| r.0).collect::<Vec<_>>()
    );
    let messages: Vec<u8> = sends
        .iter()
        .flat_map(|(_, r)| captured[r.clone()].to_vec())
        .collect();
    // The legitimate stream, whole records, at most 16 KiB of it.
    let replay_end = recs
        .iter()
        .map(|(_, r)| r.end)
        .take_while(|&e| e <= 16 * 1024)
        .last()
        .unwrap();
    let replay = captured[..replay_end].to_vec();

    let pids = live.pids();
    let before = pids.map(Usage::of);
    let watch = Watch::start(&pids);
    let targets = [live.scheduler_addr, live.server_addr];
    let local = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let rounds = 10;
    let mut conns = Vec::new();
    let t0 = Instant::now();
    for _ in 0..rounds {
        live.still_running(1);
        let mut batch = Vec::new();
        for (t, &to) in targets.iter().enumerate() {
            // Kind 0: a hello naming the job, a made-up proof, then the control messages, all
            // pipelined at once.
            let mut burst = hello(live.job_id);
            burst.extend(bad_proof());
            burst.extend(&messages);
            batch.push(Conn::open(connect(local, to), t, 0, &burst, Vec::new()));
            // Kind 1: the captured legitimate stream, replayed byte for byte (its proof was
            // made for another connection's nonces).
            batch.push(Conn::open(connect(local, to), t, 1, &replay, Vec::new()));
        }
        watch_until_closed(&mut batch, DEADLINE + LATE);
        conns.extend(batch);
        std::thread::sleep(Duration::from_millis(250));
    }
    let attack = t0.elapsed();
    let peaks = watch.peaks();
    std::thread::sleep(Duration::from_millis(300));
    let after = pids.map(Usage::of);
    none_admitted(&conns, 1);
    let worst = max_closed(&conns, |_| true);
    let told = conns.iter().filter(|c| c.ops().contains(&OP_ERROR)).count();
    let sched_line = figures(before[0], peaks[0], after[0]);
    let server_line = figures(before[1], peaks[1], after[1]);
    let greet = [live.scheduler_addr, live.server_addr].map(|to| still_greets(to, live.job_id));
    let iters = live.iters;
    live.still_running(1);
    let (sched_err, _) = live.finish();
    eprintln!(
        "WALL row 1: {} no-token connections (hello + made-up proof + {} captured control messages, pipelined) and {} replays of worker 3's captured {:.1} KiB stream ({rounds} rounds to the scheduler and server 0 over {:.1} s): 0 admitted, closed in <= {:.3} s ({told} of them sent the refusal frame first), scheduler logged {} refusal warnings (rate-limited); scheduler {sched_line}; server 0 {server_line}; a fresh connection greeted in {:.3} s / {:.3} s; job of {iters} iterations x 4 workers finished exact, no node declared dead",
        conns.iter().filter(|c| c.kind == 0).count(),
        sends.len(),
        conns.iter().filter(|c| c.kind == 1).count(),
        replay.len() as f64 / 1024.0,
        secs(attack),
        secs(worst),
        count_lines(&sched_err, "refused tcp peer"),
        secs(greet[0]),
        secs(greet[1]),
    );
    assert!(
        worst < AT_ONCE,
        "row 1: a refused connection stayed open {:.3} s",
        secs(worst)
    );
    no_threads_nor_fds_held("row 1", &before, &peaks, &after);
}

#[test]
fn row2_frame_headers_announcing_8_gib_reserve_nothing_and_are_closed() {
    let _serial = serial();
    let mut live = Live::start("wall-row2", iters_for(5.5), None, |_| None);
    let pids = live.pids();
    let before = pids.map(Usage::of);
    let watch = Watch::start(&pids);
    let targets = [live.scheduler_addr, live.server_addr];
    let local = IpAddr::V4(Ipv4Addr::LOCALHOST);
    const BIG: u64 = 8 << 30;
    let big = header(OP_SEND, BIG, 0, 0).to_vec();
    const COPIES: usize = 2;
    let mut conns = Vec::new();
    for (t, &to) in targets.iter().enumerate() {
        for _ in 0..COPIES {
            for kind in 0..4 {
                let (burst, trickle) = match kind {
                    // The header first, then its payload trickled.
                    0 => (big.clone(), random_bytes(10)),
                    // A hello naming the job, then the header in the proof's place.
                    1 => ([hello(live.job_id), big.clone()].concat(), random_bytes(10)),
                    // A hello and a made-up proof, then the header (the old attack).
                    2 => (
                        [hello(live.job_id), bad_proof(), big.clone()].concat(),
                        random_bytes(10),
                    ),
                    // The header itself trickled, a byte a second.
                    _ => (Vec::new(), big.clone()),
                };
                conns.push(Conn::open(connect(local, to), t, kind, &burst, trickle));
            }
        }
    }
    watch_until_closed(&mut conns, DEADLINE + LATE + Duration::from_secs(1));
    let peaks = watch.peaks();
    std::thread::sleep(Duration::from_millis(300));
    let after = pids.map(Usage::of);
    none_admitted(&conns, 2);
    let prompt = max_closed(&conns, |c| c.kind < 3);
    let (trickled_min, trickled_max) = (
        min_closed(&conns, |c| c.kind == 3),
        max_closed(&conns, |c| c.kind == 3),
    );
    let greet = [live.scheduler_addr, live.server_addr].map(|to| still_greets(to, live.job_id));
    let lines = [0, 1].map(|t| figures(before[t], peaks[t], after[t]));
    let iters = live.iters;
    live.still_running(2);
    live.finish();
    eprintln!(
        "WALL row 2: {} connections announcing 8 GiB Send frames ({COPIES} of each kind per target: header first, after a hello, after a hello and a made-up proof — each then trickling 1 byte/s — and the header itself trickled 1 byte/s): scheduler {} ; server 0 {} ; closed in <= {:.3} s, the trickled headers at {:.2}..{:.2} s (deadline {} s); 0 admitted; a fresh connection greeted in {:.3} s / {:.3} s; job of {iters} iterations x 4 workers finished exact",
        conns.len(),
        lines[0],
        lines[1],
        secs(prompt),
        secs(trickled_min),
        secs(trickled_max),
        DEADLINE.as_secs(),
        secs(greet[0]),
        secs(greet[1]),
    );
    for t in 0..2 {
        assert!(
            peaks[t].rss_kib < before[t].rss_kib + 16 * 1024,
            "row 2: {} RSS grew {:.1} -> {:.1} MiB",
            TARGETS[t],
            before[t].mib(),
            peaks[t].mib()
        );
    }
    no_threads_nor_fds_held("row 2", &before, &peaks, &after);
    assert!(
        prompt < AT_ONCE,
        "row 2: a connection announcing 8 GiB stayed open {:.3} s",
        secs(prompt)
    );
    assert!(
        trickled_max <= DEADLINE + LATE,
        "row 2: a trickled header stayed open {:.3} s (deadline {} s)",
        secs(trickled_max),
        DEADLINE.as_secs()
    );
}

#[test]
fn row3_silent_and_trickling_connections_cost_no_thread_and_end_at_the_deadline() {
    let _serial = serial();
    let mut live = Live::start("wall-row3", iters_for(5.6), None, |_| None);
    let pids = live.pids();
    let before = pids.map(Usage::of);
    let watch = Watch::start(&pids);
    let targets = [live.scheduler_addr, live.server_addr];
    const PER_TARGET: usize = 200;
    let from = sources(8);
    const KINDS: [&str; 4] = [
        "silent",
        "a hello, then silence",
        "a hello at 1 byte/s",
        "10 bytes of a hello, then silence",
    ];
    let mut conns = Vec::new();
    let t0 = Instant::now();
    for i in 0..PER_TARGET {
        for (t, &to) in targets.iter().enumerate() {
            let kind = i % KINDS.len();
            let h = hello(live.job_id);
            let (burst, trickle) = match kind {
                0 => (Vec::new(), Vec::new()),
                1 => (h, Vec::new()),
                2 => (Vec::new(), h),
                _ => (h[..10].to_vec(), Vec::new()),
            };
            let s = connect(from[i % from.len()], to);
            conns.push(Conn::open(s, t, kind, &burst, trickle));
        }
    }
    let opening = t0.elapsed();
    // While the wall is full: a newcomer from another address (127.0.0.1, the job's own),
    // watched on its own thread so the attack's connections are watched meanwhile.
    let newcomer = std::thread::spawn({
        let to = live.scheduler_addr;
        move || newcomer_fate(to)
    });
    watch_until_closed(&mut conns, DEADLINE + LATE + Duration::from_secs(1));
    let newcomer = newcomer.join().unwrap();
    // A full wall takes a less represented newcomer in (a flooding connection gives way).
    assert!(
        newcomer.starts_with("was greeted"),
        "a newcomer from the job's own address is not locked out: it {newcomer}"
    );
    let peaks = watch.peaks();
    std::thread::sleep(Duration::from_millis(500));
    let after = pids.map(Usage::of);
    none_admitted(&conns, 3);
    // What the caps let wait: per source, then in total.
    let mut per_source: BTreeMap<IpAddr, usize> = BTreeMap::new();
    for i in 0..PER_TARGET {
        *per_source.entry(from[i % from.len()]).or_default() += 1;
    }
    let admissible = per_source
        .values()
        .map(|&n| n.min(MAX_PER_SOURCE))
        .sum::<usize>()
        .min(MAX_PENDING);
    let greet = [live.scheduler_addr, live.server_addr].map(|to| still_greets(to, live.job_id));
    let mut report = Vec::new();
    let mut failures = Vec::new();
    for (t, name) in TARGETS.iter().enumerate() {
        let mine = |c: &Conn| c.target == t;
        let at_once = conns.iter().filter(|c| mine(c) && !c.held()).count();
        let held: Vec<&Conn> = conns.iter().filter(|c| mine(c) && c.held()).collect();
        let last = max_closed(&conns, |c| mine(c));
        let held_min = held
            .iter()
            .map(|c| c.closed.unwrap_or(Duration::MAX))
            .min()
            .unwrap_or_default();
        let trickle = max_closed(&conns, |c| mine(c) && c.kind == 2 && c.held());
        let trickle_min = min_closed(&conns, |c| mine(c) && c.kind == 2 && c.held());
        report.push(format!(
            "{name}: {} held until {:.2}..{:.2} s (hello at 1 byte/s dropped at {:.2}..{:.2} s), {at_once} closed at once, {}",
            held.len(),
            secs(held_min),
            secs(last),
            secs(trickle_min),
            secs(trickle),
            figures(before[t], peaks[t], after[t])
        ));
        if held.len() > MAX_PENDING {
            failures.push(format!(
                "{name}: {} connections waited at once (cap {MAX_PENDING})",
                held.len()
            ));
        }
        if at_once < PER_TARGET - admissible {
            failures.push(format!(
                "{name}: only {at_once} closed at once over the caps (expected {})",
                PER_TARGET - admissible
            ));
        }
        if last > DEADLINE + LATE {
            failures.push(format!(
                "{name}: a connection stayed open {:.3} s (deadline {} s)",
                secs(last),
                DEADLINE.as_secs()
            ));
        }
        if peaks[t].threads > before[t].threads + 2 {
            failures.push(format!(
                "{name}: threads {} -> {}",
                before[t].threads, peaks[t].threads
            ));
        }
        if peaks[t].fds > before[t].fds + MAX_PENDING as u64 + 4 {
            failures.push(format!(
                "{name}: fds {} -> {} (cap {MAX_PENDING})",
                before[t].fds, peaks[t].fds
            ));
        }
        if after[t].fds > before[t].fds + 3 {
            failures.push(format!(
                "{name}: fds {} -> {} after",
                before[t].fds, after[t].fds
            ));
        }
    }
    let iters = live.iters;
    live.still_running(3);
    live.finish();
    eprintln!(
        "WALL row 3: {PER_TARGET} connections per target from {} source addresses, opened in {:.2} s ({}); caps {MAX_PER_SOURCE} per source, {MAX_PENDING} in all; deadline {} s: {}; meanwhile a newcomer from 127.0.0.1 to the scheduler {newcomer}; afterwards a fresh connection greeted in {:.3} s / {:.3} s; job of {iters} iterations x 4 workers finished exact",
        from.len(),
        secs(opening),
        KINDS.join(", "),
        DEADLINE.as_secs(),
        report.join("; "),
        secs(greet[0]),
        secs(greet[1])
    );
    assert!(failures.is_empty(), "row 3: {}", failures.join("; "));
}

#[test]
fn row4_connect_and_close_cycles_leave_no_descriptor_behind() {
    let _serial = serial();
    // The limit under which the old build refused connections once the cycles had leaked
    // its descriptors.
    const NOFILE: u32 = 256;
    let mut live = Live::start("wall-row4", iters_for(2.0), Some(NOFILE), |_| None);
    let pids = live.pids();
    for pid in pids {
        let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
        let line = limits
            .lines()
            .find(|l| l.starts_with("Max open files"))
            .unwrap();
        assert_eq!(
            line.split_whitespace().nth(3),
            Some(NOFILE.to_string().as_str()),
            "{line}"
        );
    }
    let before = pids.map(Usage::of);
    let watch = Watch::start(&pids);
    let targets = [live.scheduler_addr, live.server_addr];
    const CYCLES: usize = 2000;
    let half_hello = hello(live.job_id)[..20].to_vec();
    let t0 = Instant::now();
    for i in 0..CYCLES {
        for &to in &targets {
            let mut s = TcpStream::connect(to).unwrap();
            match i % 3 {
                // Close at once.
                0 => {}
                // Half a hello, then close.
                1 => {
                    let _ = s.write(&half_hello);
                }
                // Reset (SO_LINGER 0).
                _ => socket2::SockRef::from(&s)
                    .set_linger(Some(Duration::ZERO))
                    .unwrap(),
            }
            drop(s);
        }
    }
    let cycling = t0.elapsed();
    // A short settle.
    std::thread::sleep(Duration::from_millis(500));
    let peaks = watch.peaks();
    let after = pids.map(Usage::of);
    let greet = targets.map(|to| still_greets(to, live.job_id));
    let lines = [0, 1].map(|t| figures(before[t], peaks[t], after[t]));
    let iters = live.iters;
    live.still_running(4);
    let (sched_err, _) = live.finish();
    eprintln!(
        "WALL row 4: {CYCLES} connect-and-close cycles per target (ulimit -n {NOFILE}) in {:.2} s (close at once / half a hello / reset), then 0.5 s settle: scheduler {} ; server 0 {} ; a fresh connection greeted in {:.3} s / {:.3} s; scheduler logged {} warnings; job of {iters} iterations x 4 workers finished exact",
        secs(cycling),
        lines[0],
        lines[1],
        secs(greet[0]),
        secs(greet[1]),
        count_lines(&sched_err, "WARN"),
    );
    no_threads_nor_fds_held(&format!("row 4 ({CYCLES} cycles)"), &before, &peaks, &after);
}

// ---------------------------------------------------------------------------------------
// Row 5: a flood of half-open handshakes from many addresses, one each or a few each.

/// Keeps `per_source` half-open handshakes (a hello naming the job, never a proof) open from
/// each of `from` to each of `targets`, opening again at once each one the wall lets go:
/// what an attacker without the token does to lock a node out.
struct Flood {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<(u64, u64)>>,
}

impl Flood {
    fn start(targets: Vec<SocketAddr>, from: Vec<IpAddr>, per_source: usize, job: u64) -> Flood {
        let stop = Arc::new(AtomicBool::new(false));
        let handle = std::thread::spawn({
            let stop = stop.clone();
            move || {
                let open = |src: IpAddr, to: SocketAddr| -> Option<TcpStream> {
                    use socket2::{Domain, Socket, Type};
                    let s = Socket::new(Domain::IPV4, Type::STREAM, None).ok()?;
                    s.bind(&SocketAddr::new(src, 0).into()).ok()?;
                    s.connect_timeout(&to.into(), Duration::from_secs(1)).ok()?;
                    let mut s: TcpStream = s.into();
                    s.write_all(&hello(job)).ok()?;
                    s.set_nonblocking(true).ok()?;
                    Some(s)
                };
                let slots: Vec<(IpAddr, SocketAddr)> = targets
                    .iter()
                    .flat_map(|&to| {
                        from.iter()
                            .flat_map(move |&src| std::iter::repeat_n((src, to), per_source))
                    })
                    .collect();
                let mut conns: Vec<Option<TcpStream>> = slots.iter().map(|_| None).collect();
                let (mut opened, mut let_go) = (0u64, 0u64);
                let mut buf = [0u8; 512];
                while !stop.load(Ordering::Acquire) {
                    for (slot, &(src, to)) in conns.iter_mut().zip(&slots) {
                        if let Some(s) = slot {
                            let gone = loop {
                                match s.read(&mut buf) {
                                    Ok(0) => break true,
                                    Ok(_) => {}
                                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                                        break false;
                                    }
                                    Err(_) => break true,
                                }
                            };
                            if gone {
                                *slot = None;
                                let_go += 1;
                            }
                        }
                        if slot.is_none() {
                            *slot = open(src, to);
                            opened += slot.is_some() as u64;
                        }
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                (opened, let_go)
            }
        });
        Flood {
            stop,
            handle: Some(handle),
        }
    }

    /// Stops it: (connections opened, connections the walls let go).
    fn stop(mut self) -> (u64, u64) {
        self.stop.store(true, Ordering::Release);
        self.handle.take().unwrap().join().unwrap()
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Waits for `needle` in `p`'s stderr; the time it took, or None after `limit`.
fn wait_for_err(p: &mut Proc, needle: &str, limit: Duration) -> Option<Duration> {
    let t = Instant::now();
    while t.elapsed() < limit {
        if p.err.lock().unwrap().contains(needle) {
            return Some(t.elapsed());
        }
        if !p.running() {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    None
}

#[test]
fn row5_half_open_floods_from_many_addresses_lock_no_node_out() {
    let _serial = serial();
    // 128 addresses with one half-open handshake each (the default wall's whole size: the
    // per-address rule alone never evicts), and 8 addresses with 16 each.
    for (addresses, per_source) in [(128u8, 1usize), (8, 16)] {
        let from = sources(addresses);
        if from.len() < addresses as usize {
            eprintln!(
                "WALL row 5: SKIPPED {addresses} x {per_source}: this kernel does not route 127.0.0.2.. to loopback"
            );
            continue;
        }
        let name = format!("{addresses} x {per_source}");
        let iters = iters_for(6.0);
        let (job, job_id) = wall_job("wall-row5", iters);
        let sched_addr = SocketAddr::from(([127, 0, 0, 1], job.port));
        let scheduler = Proc::spawn(&job, "scheduler", None, &[], None);
        let t = Instant::now();
        while TcpStream::connect(sched_addr).is_err() {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "the scheduler never listened"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        // The scheduler's wall is full before anyone else has joined.
        let flood = Flood::start(vec![sched_addr], from.clone(), per_source, job_id);
        std::thread::sleep(Duration::from_millis(500));
        let started = Instant::now();
        let mut servers: Vec<Proc> = (0..SERVERS)
            .map(|r| Proc::spawn(&job, "server", Some(r), &[], None))
            .collect();
        let mut workers: Vec<Proc> = (0..WORKERS)
            .map(|r| Proc::spawn(&job, "worker", Some(r), &[], None))
            .collect();
        let dump = |s: &Proc, sv: &[Proc], w: &[Proc]| -> String {
            std::iter::once(s)
                .chain(sv)
                .chain(w)
                .map(|p| format!("--- {}:\n{}{}", p.what, p.stdout(), p.err.lock().unwrap()))
                .collect()
        };
        while !workers[0].stdout().contains("worker 0 iteration") {
            let ended = workers.iter_mut().chain(&mut servers).any(|p| !p.running());
            assert!(
                !ended && started.elapsed() < Duration::from_secs(30),
                "{name}: the job did not start under the flood:\n{}",
                dump(&scheduler, &servers, &workers)
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let joined = started.elapsed();
        // Now server 0's wall too; then worker 3 is killed and started again with its rank.
        let ports = listening_ports(servers[0].pid());
        let server_addr = SocketAddr::from(([127, 0, 0, 1], ports[0]));
        let flood2 = Flood::start(vec![server_addr], from.clone(), per_source, job_id);
        std::thread::sleep(Duration::from_millis(500));
        let mut victim = workers.pop().unwrap();
        victim.child.kill().unwrap();
        let _ = victim.child.wait();
        drop(victim);
        std::thread::sleep(Duration::from_millis(300));
        let mut back = Proc::spawn(
            &job,
            "worker",
            Some(3),
            &[("RUST_LOG", "warn,falcon_engine::worker=info".to_string())],
            None,
        );
        let rejoined = wait_for_err(&mut back, "rejoining the job at clock", DEADLINE + LATE * 5);
        let (opened, let_go) = flood.stop();
        let (opened2, let_go2) = flood2.stop();
        let Some(rejoined) = rejoined else {
            workers.push(back);
            panic!(
                "{name}: the restarted worker did not rejoin:\n{}",
                dump(&scheduler, &servers, &workers)
            );
        };
        workers.push(back);
        // Every role ends well, the job exact: each shard applied every push it numbered once.
        let limit = Duration::from_secs(60);
        let ended: Vec<Ended> = workers
            .into_iter()
            .chain(servers)
            .map(|p| p.wait(limit))
            .collect();
        let sched = scheduler.wait(limit);
        let all = || {
            ended
                .iter()
                .chain([&sched])
                .map(Ended::dump)
                .collect::<String>()
        };
        assert!(
            ended.iter().all(|e| e.ok) && sched.ok,
            "{name}: a role failed:\n{}",
            all()
        );
        assert!(
            sched.out.contains("rejoined: [worker 3]"),
            "{name}: the scheduler saw worker 3 rejoin:\n{}",
            all()
        );
        let mut shards = 0;
        for e in &ended {
            for line in e.out.lines().filter(|l| l.contains("first parameter")) {
                let applied = (first_parameter(line) / 0.125).round() as u64;
                let seqs = number_after(line, "sequence numbers").unwrap();
                let skipped = number_after(line, "applied +").unwrap();
                assert_eq!(
                    applied,
                    seqs - skipped,
                    "{name}: applied exactly once: {line}"
                );
                shards += 1;
            }
        }
        assert_eq!(shards, 4, "{name}: every shard reported");
        eprintln!(
            "WALL row 5: {name} half-open handshakes held against the scheduler from before the job started (then against server 0 too), reopened as soon as let go ({opened} and {opened2} opened, {let_go} and {let_go2} let go): the job joined in {:.3} s under the flood; worker 3, killed and restarted, rejoined in {:.3} s (handshake deadline {} s); job of {iters} iterations exact",
            secs(joined),
            secs(rejoined),
            DEADLINE.as_secs()
        );
        assert!(
            joined <= DEADLINE + LATE && rejoined <= DEADLINE + LATE,
            "{name}: the job took {:.3} s to join, the restarted worker {:.3} s to rejoin",
            secs(joined),
            secs(rejoined)
        );
    }
}

// ---------------------------------------------------------------------------------------
// Row 6: a peer holding the token (admitted by the wall) announces a 3 GiB message.

#[test]
fn row6_an_admitted_peer_announcing_3_gib_costs_no_memory_and_loses_its_link() {
    use falcon_transport::{Medium, PeerAddr, Transport, TransportConfig};
    let _serial = serial();
    let mut live = Live::start("wall-row6", iters_for(3.0), None, |_| None);
    let pids = live.pids();
    let before = pids.map(Usage::of);
    let watch = Watch::start(&pids);
    // The peer knows the token: the wall admits it, and its link is a link like a role's.
    let t = Transport::new(TransportConfig {
        job: live.job_id,
        token: "t0ken".into(),
        medium: Medium::Tcp,
        shm: false,
        tcp_streams: 1,
        ..TransportConfig::default()
    })
    .unwrap();
    const BIG: u64 = 3 << 30;
    let mut closed = Vec::new();
    for to in [live.scheduler_addr, live.server_addr] {
        let peer = PeerAddr {
            host: "remote".into(),
            tcp: Some(to),
            shm: None,
        };
        let link = t.connect(&peer).expect("admitted with the token");
        let start = Instant::now();
        // The header, then a few MiB of its payload (all a 16 MiB budget may see).
        link.inject_raw(&header(OP_SEND, BIG, 0, 0)).unwrap();
        let _ = link.inject_raw(&vec![7u8; 6 << 20]);
        while link.is_open() && start.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(5));
        }
        closed.push((link.is_open(), start.elapsed()));
    }
    std::thread::sleep(Duration::from_millis(300));
    let peaks = watch.peaks();
    let after = pids.map(Usage::of);
    let lines = [0, 1].map(|t| figures(before[t], peaks[t], after[t]));
    let iters = live.iters;
    live.still_running(6);
    let sched_err = live.scheduler.err.lock().unwrap().clone();
    let server_err = live.servers[0].err.lock().unwrap().clone();
    live.finish();
    eprintln!(
        "WALL row 6: a peer with the token announces a 3 GiB message (and sends 6 MiB of it) to the scheduler and to server 0: scheduler {} ; server 0 {} ; links closed after {:.3} s / {:.3} s; job of {iters} iterations x 4 workers finished exact",
        lines[0],
        lines[1],
        secs(closed[0].1),
        secs(closed[1].1)
    );
    for (t, (open, _)) in closed.iter().enumerate() {
        assert!(!open, "row 6: the {} kept the link", TARGETS[t]);
        assert!(
            peaks[t].rss_kib < before[t].rss_kib + 16 * 1024,
            "row 6: {} RSS grew {:.1} -> {:.1} MiB",
            TARGETS[t],
            before[t].mib(),
            peaks[t].mib()
        );
    }
    for (name, err) in [("scheduler", &sched_err), ("server 0", &server_err)] {
        assert!(
            err.contains("a message of 3221225472 bytes is over the cap on a message from a peer that connected"),
            "row 6: the {name} says which cap the peer broke:\n{err}"
        );
    }
}
