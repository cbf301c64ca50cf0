//! The job's metrics for dashboards: a Prometheus (OpenMetrics text) endpoint on the
//! scheduler, `http://ADDR/metrics` where `FALCON_METRICS_ADDR` (or `--metrics-addr`) says.
//!
//! Workers and servers send their counters to the scheduler with their heartbeats
//! ([`Msg::Metrics`]); the scheduler adds what it sees itself (iterations the trainers
//! report, the tasks it relays between stragglers and helpers, the threads it advises). The
//! [`Board`] is plain state, fed by the scheduler's driver and read by [`Board::render`];
//! [`Exporter`] is the thin HTTP driver, a thread that answers every scrape at once from the
//! board and nothing else (a request it does not understand gets 404 or 400, a slow one is
//! cut off at its deadline while the others are answered). Requests are parsed by
//! `httparse`, the parser of the Rust HTTP stack (hyper's).
//!
//! The encoding is the prometheus-client crate's, the Prometheus project's own Rust client:
//! exposition format details (escaping, `_total` suffixes, `# EOF`) are its business.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec};

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::error::{Error, Result};
pub use crate::proto::NodeMetrics;
use crate::proto::{Msg, Role};

/// What the scheduler knows of one worker.
#[derive(Clone, Debug, Default)]
struct WorkerRow {
    sent: NodeMetrics,
    /// Iterations the trainer reported, their compute time and the threads of the last.
    reported: u64,
    compute_nanos: u64,
    threads: u64,
    /// Tasks transferred away from it, and to it.
    tasks_given: u64,
    tasks_helped: u64,
}

/// The scheduler's view of the job's metrics.
#[derive(Clone, Debug, Default)]
pub struct Board {
    workers: BTreeMap<u32, WorkerRow>,
    servers: BTreeMap<u32, NodeMetrics>,
    live: BTreeMap<(Role, u32), bool>,
}

impl Board {
    /// An empty board for a job of `workers` workers and `servers` servers (every node
    /// appears, with zeros, before it reports).
    pub fn new(workers: u32, servers: u32) -> Board {
        let mut b = Board::default();
        for w in 0..workers {
            b.workers.insert(w, WorkerRow::default());
            b.live.insert((Role::Worker, w), true);
        }
        for s in 0..servers {
            b.servers.insert(s, NodeMetrics::default());
            b.live.insert((Role::Server, s), true);
        }
        b
    }

    /// A message from node `(role, rank)` of the job.
    pub fn on_message(&mut self, role: Role, rank: u32, msg: &Msg) {
        match (role, msg) {
            (Role::Worker, Msg::Metrics(m)) => {
                self.workers.entry(rank).or_default().sent = m.clone()
            }
            (Role::Server, Msg::Metrics(m)) => {
                self.servers.insert(rank, m.clone());
            }
            (Role::Worker, Msg::IterationDone { threads, nanos, .. }) => {
                let w = self.workers.entry(rank).or_default();
                w.reported = w.reported.saturating_add(1);
                w.compute_nanos = w.compute_nanos.saturating_add(*nanos);
                w.threads = u64::from(*threads);
            }
            // The straggler's answer to a steal: the sender gave tasks to a worker of the job
            // (as the scheduler relays it; a rank outside the job is not one).
            (
                Role::Worker,
                Msg::Tasks {
                    helper, start, end, ..
                },
            ) if self.workers.contains_key(helper) && *helper != rank => {
                let n = u64::from(end.saturating_sub(*start));
                let given = &mut self.workers.entry(rank).or_default().tasks_given;
                *given = given.saturating_add(n);
                let helped = &mut self.workers.entry(*helper).or_default().tasks_helped;
                *helped = helped.saturating_add(n);
            }
            _ => {}
        }
    }

    /// The scheduler advised worker `rank` to run `threads` threads.
    pub fn threads(&mut self, rank: u32, threads: u64) {
        self.workers.entry(rank).or_default().threads = threads;
    }

    /// Whether node `(role, rank)` is a live member of the job.
    pub fn set_live(&mut self, role: Role, rank: u32, live: bool) {
        self.live.insert((role, rank), live);
    }

    /// The metrics in the OpenMetrics text format.
    pub fn render(&self) -> String {
        let mut r = Registry::default();
        let label = |k: &str, v: u32| vec![(k.to_string(), v.to_string())];
        let counter = |r: &mut Registry, name: &str, help: &str| {
            let f = Family::<Vec<(String, String)>, Counter>::default();
            r.register(name, help, f.clone());
            f
        };
        let seconds = |r: &mut Registry, name: &str, help: &str| {
            let f = Family::<Vec<(String, String)>, Counter<f64, std::sync::atomic::AtomicU64>>::default();
            r.register(name, help, f.clone());
            f
        };
        let gauge = |r: &mut Registry, name: &str, help: &str| {
            let f = Family::<Vec<(String, String)>, Gauge>::default();
            r.register(name, help, f.clone());
            f
        };
        let ratio = |r: &mut Registry, name: &str, help: &str| {
            let f =
                Family::<Vec<(String, String)>, Gauge<f64, std::sync::atomic::AtomicU64>>::default(
                );
            r.register(name, help, f.clone());
            f
        };
        let up = gauge(
            &mut r,
            "falcon_up",
            "1 for a live member of the job, 0 for one declared dead",
        );
        let w_iter = counter(
            &mut r,
            "falcon_worker_iterations",
            "Iterations a worker completed (every tensor pushed)",
        );
        let w_reported = counter(
            &mut r,
            "falcon_worker_reported_iterations",
            "Iterations a worker's trainer reported with their compute time",
        );
        let w_compute = seconds(
            &mut r,
            "falcon_worker_compute_seconds",
            "Compute time of the reported iterations",
        );
        let w_blocked = seconds(
            &mut r,
            "falcon_worker_blocked_seconds",
            "Time a worker waited on pulls the policy held and at barriers",
        );
        let w_stale = ratio(
            &mut r,
            "falcon_worker_staleness_mean",
            "Mean staleness of a worker's acknowledged pushes (updates in between)",
        );
        let w_stale_max = gauge(
            &mut r,
            "falcon_worker_staleness_max",
            "Largest staleness of a worker's acknowledged pushes",
        );
        let w_given = counter(
            &mut r,
            "falcon_worker_tasks_given",
            "Tasks transferred away from a worker (a straggler) to helpers",
        );
        let w_helped = counter(
            &mut r,
            "falcon_worker_tasks_helped",
            "Tasks of other workers a worker computed",
        );
        let w_threads = gauge(
            &mut r,
            "falcon_worker_threads",
            "Threads a worker computes with (last reported or advised)",
        );
        let w_pushes = counter(&mut r, "falcon_worker_pushes", "Shard pushes of a worker");
        let w_pulls = counter(&mut r, "falcon_worker_pulls", "Shard pulls of a worker");
        let s_in = counter(
            &mut r,
            "falcon_server_bytes_in",
            "Gradient bytes a server received",
        );
        let s_out = counter(
            &mut r,
            "falcon_server_bytes_out",
            "Parameter bytes a server wrote to answer pulls",
        );
        let s_grads = counter(
            &mut r,
            "falcon_server_gradients",
            "Gradients a server applied or aggregated",
        );
        let s_updates = counter(
            &mut r,
            "falcon_server_updates",
            "Updates a server applied to its parameters",
        );
        let s_parked = gauge(
            &mut r,
            "falcon_server_parked_pulls",
            "Pulls waiting at a server for the policy now",
        );
        let s_delayed = counter(
            &mut r,
            "falcon_server_delayed_pulls",
            "Pulls that waited at a server for the policy",
        );
        let s_dropped = counter(
            &mut r,
            "falcon_server_dropped_gradients",
            "Gradients a server's policy dropped",
        );
        let s_folded = counter(
            &mut r,
            "falcon_server_folded_gradients",
            "Late gradients a server folded into a later step",
        );
        for (&rank, w) in &self.workers {
            let l = label("worker", rank);
            let m = &w.sent;
            w_iter.get_or_create(&l).inc_by(m.iterations);
            w_reported.get_or_create(&l).inc_by(w.reported);
            w_compute
                .get_or_create(&l)
                .inc_by(w.compute_nanos as f64 / 1e9);
            w_blocked
                .get_or_create(&l)
                .inc_by(m.blocked_nanos as f64 / 1e9);
            let mean = if m.staleness_count > 0 {
                m.staleness_sum as f64 / m.staleness_count as f64
            } else {
                0.0
            };
            w_stale.get_or_create(&l).set(mean);
            w_stale_max.get_or_create(&l).set(m.staleness_max as i64);
            w_given.get_or_create(&l).inc_by(w.tasks_given);
            w_helped.get_or_create(&l).inc_by(w.tasks_helped);
            w_threads.get_or_create(&l).set(w.threads as i64);
            w_pushes.get_or_create(&l).inc_by(m.pushes);
            w_pulls.get_or_create(&l).inc_by(m.pulls);
        }
        for (&rank, m) in &self.servers {
            let l = label("server", rank);
            s_in.get_or_create(&l).inc_by(m.bytes_in);
            s_out.get_or_create(&l).inc_by(m.bytes_out);
            s_grads.get_or_create(&l).inc_by(m.pushes);
            s_updates.get_or_create(&l).inc_by(m.updates);
            s_parked.get_or_create(&l).set(m.parked_pulls as i64);
            s_delayed.get_or_create(&l).inc_by(m.delayed_pulls);
            s_dropped.get_or_create(&l).inc_by(m.dropped_gradients);
            s_folded.get_or_create(&l).inc_by(m.folded_gradients);
        }
        for (&(role, rank), &live) in &self.live {
            up.get_or_create(&vec![
                ("role".to_string(), role.name().to_string()),
                ("rank".to_string(), rank.to_string()),
            ])
            .set(i64::from(live));
        }
        let mut out = String::new();
        // Encoding into a String cannot fail.
        let _ = encode(&mut out, &r);
        out
    }
}

/// One deadline for a scrape's whole exchange (its request and our answer), from its
/// connection: a client trickling bytes, or not reading, gets no more time.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(2);
/// The most bytes of a request's head read.
const REQUEST_HEAD: usize = 8192;
/// The most connections served at once; a newcomer past it takes the oldest one's place.
const MAX_CLIENTS: usize = 64;
/// Longest a poll sleeps, so a stopping endpoint is noticed.
const POLL_SLEEP: Duration = Duration::from_millis(100);

/// The metrics endpoint: a thread answering `GET /metrics` from a [`Board`]; it stops when
/// dropped.
///
/// One thread serves every connection at once with non-blocking sockets and `poll`: each has
/// one deadline for its whole exchange ([`EXCHANGE_TIMEOUT`]), at most [`MAX_CLIENTS`] are
/// open (a newcomer past that takes the oldest one's place), and a request's head is parsed
/// by the `httparse` crate, at most [`REQUEST_HEAD`] bytes of it. Slow or silent clients
/// therefore never hold up a scrape.
pub struct Exporter {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Exporter {
    /// Binds `addr` (port 0: any free port) and starts answering scrapes from `board`.
    pub fn start(addr: SocketAddr, board: Arc<Mutex<Board>>) -> Result<Exporter> {
        let listener = TcpListener::bind(addr).map_err(|e| {
            Error::os(
                format!("the metrics endpoint cannot listen on {addr} (FALCON_METRICS_ADDR)"),
                e,
            )
        })?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::os(format!("the metrics endpoint on {addr}"), e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::os(format!("the metrics endpoint on {addr}"), e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let halt = stop.clone();
        let thread = std::thread::Builder::new()
            .name("falcon-metrics".into())
            .spawn(move || serve(&listener, &board, &halt))
            .map_err(|e| Error::os("cannot start the metrics endpoint's thread", e))?;
        tracing::info!("scheduler: metrics at http://{addr}/metrics");
        Ok(Exporter {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Exporter {
    /// Stops answering and closes the port (the next job may bind it at once).
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One scrape in progress.
struct Client {
    conn: TcpStream,
    deadline: Instant,
    /// The request's head so far.
    head: Vec<u8>,
    /// The answer, once the head is in, and how much of it went out.
    reply: Option<(Vec<u8>, usize)>,
    /// The answer went out and our side is shut: what the client still sends is drained
    /// until it closes, so the close is a FIN after the answer, not a reset.
    done: bool,
}

impl Client {
    /// Moves bytes; false once the exchange is over.
    fn step(&mut self, board: &Mutex<Board>) -> bool {
        let mut buf = [0u8; 1024];
        if self.done || self.reply.is_none() {
            loop {
                match self.conn.read(&mut buf) {
                    Ok(0) if self.done => return false,
                    Ok(0) => {
                        // Closed before a complete head: answer what came (a 400).
                        self.reply = Some((respond(&self.head, true, board), 0));
                        break;
                    }
                    // Done: what the client still sends is read and dropped.
                    Ok(_) if self.done => {}
                    Ok(n) => {
                        let room = REQUEST_HEAD.saturating_sub(self.head.len());
                        self.head.extend_from_slice(&buf[..n.min(room)]);
                        let full = self.head.len() >= REQUEST_HEAD;
                        let reply = respond(&self.head, full, board);
                        if !reply.is_empty() {
                            self.reply = Some((reply, 0));
                            break;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => return false,
                }
            }
        }
        if let Some((reply, sent)) = &mut self.reply
            && !self.done
        {
            while *sent < reply.len() {
                match self.conn.write(&reply[*sent..]) {
                    Ok(0) => return false,
                    Ok(n) => *sent += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return true,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => return false,
                }
            }
            let _ = self.conn.shutdown(std::net::Shutdown::Write);
            self.done = true;
        }
        true
    }

    fn wants(&self) -> PollFlags {
        match &self.reply {
            Some(_) if !self.done => PollFlags::OUT,
            _ => PollFlags::IN,
        }
    }
}

/// The endpoint's loop: every connection at once, until `halt`.
fn serve(listener: &TcpListener, board: &Mutex<Board>, halt: &AtomicBool) {
    let mut clients: Vec<Client> = Vec::new();
    while !halt.load(Ordering::Acquire) {
        let now = Instant::now();
        let sleep = clients
            .iter()
            .map(|c| c.deadline.saturating_duration_since(now))
            .min()
            .unwrap_or(POLL_SLEEP)
            .min(POLL_SLEEP);
        let mut fds = Vec::with_capacity(clients.len() + 1);
        fds.push(PollFd::new(listener, PollFlags::IN));
        for c in &clients {
            fds.push(PollFd::from_borrowed_fd(c.conn.as_fd(), c.wants()));
        }
        let timeout = Timespec {
            tv_sec: sleep.as_secs() as _,
            tv_nsec: sleep.subsec_nanos() as _,
        };
        match rustix::event::poll(&mut fds, Some(&timeout)) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => {
                tracing::warn!("metrics endpoint: poll failed: {e}");
                std::thread::sleep(POLL_SLEEP);
                continue;
            }
        }
        let incoming = !fds[0].revents().is_empty();
        let ready: Vec<bool> = fds[1..].iter().map(|f| !f.revents().is_empty()).collect();
        drop(fds);
        let now = Instant::now();
        let mut kept = Vec::with_capacity(clients.len());
        for (mut c, r) in clients.drain(..).zip(ready) {
            if (r && !c.step(board)) || now >= c.deadline {
                continue;
            }
            kept.push(c);
        }
        clients = kept;
        if incoming {
            loop {
                match listener.accept() {
                    Ok((conn, _)) => {
                        if conn.set_nonblocking(true).is_err() {
                            continue;
                        }
                        if clients.len() >= MAX_CLIENTS
                            && let Some(oldest) = clients
                                .iter()
                                .enumerate()
                                .min_by_key(|(_, c)| c.deadline)
                                .map(|(i, _)| i)
                        {
                            clients.swap_remove(oldest);
                        }
                        clients.push(Client {
                            conn,
                            deadline: Instant::now() + EXCHANGE_TIMEOUT,
                            head: Vec::new(),
                            reply: None,
                            done: false,
                        });
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        // Out of descriptors, say: back off rather than spin.
                        tracing::warn!("metrics endpoint: {e}");
                        std::thread::sleep(Duration::from_millis(20));
                        break;
                    }
                }
            }
        }
    }
}

/// The answer to a request whose head so far is `head`: the board's metrics for
/// `GET /metrics`, 404 for another path, 400 for anything that is not a GET request. Empty
/// while the head is incomplete and more may come (`last`: nothing more will).
fn respond(head: &[u8], last: bool, board: &Mutex<Board>) -> Vec<u8> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut req = httparse::Request::new(&mut headers);
    let (status, kind, body) = match req.parse(head) {
        Ok(httparse::Status::Partial) if !last => return Vec::new(),
        Ok(httparse::Status::Complete(_)) if req.method == Some("GET") => match req.path {
            Some(path) if path == "/metrics" || path.starts_with("/metrics?") => {
                let text = board.lock().unwrap_or_else(|p| p.into_inner()).render();
                (
                    "200 OK",
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    text,
                )
            }
            _ => (
                "404 Not Found",
                "text/plain; charset=utf-8",
                "falcon's scheduler serves /metrics only\n".to_string(),
            ),
        },
        _ => (
            "400 Bad Request",
            "text/plain; charset=utf-8",
            "not an HTTP GET request\n".to_string(),
        ),
    };
    format!(
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scrape(addr: SocketAddr, request: &str) -> String {
        let mut c = TcpStream::connect(addr).unwrap();
        c.write_all(request.as_bytes()).unwrap();
        let mut out = String::new();
        c.read_to_string(&mut out).unwrap();
        out
    }

    #[test]
    fn the_board_renders_what_the_nodes_and_the_scheduler_saw() {
        let mut b = Board::new(2, 1);
        let m = NodeMetrics {
            iterations: 7,
            pushes: 14,
            blocked_nanos: 1_500_000_000,
            staleness_sum: 6,
            staleness_count: 4,
            staleness_max: 3,
            ..Default::default()
        };
        b.on_message(Role::Worker, 1, &Msg::Metrics(m));
        b.on_message(
            Role::Worker,
            1,
            &Msg::IterationDone {
                threads: 3,
                tasks: 8,
                nanos: 250_000_000,
            },
        );
        b.on_message(
            Role::Worker,
            0,
            &Msg::Tasks {
                straggler: 0,
                helper: 1,
                clock: 4,
                start: 2,
                end: 7,
            },
        );
        let s = NodeMetrics {
            bytes_in: 4096,
            pushes: 9,
            parked_pulls: 2,
            dropped_gradients: 1,
            folded_gradients: 4,
            ..Default::default()
        };
        b.on_message(Role::Server, 0, &Msg::Metrics(s));
        b.set_live(Role::Worker, 0, false);
        let text = b.render();
        for line in [
            "# TYPE falcon_worker_iterations counter",
            "falcon_worker_iterations_total{worker=\"1\"} 7",
            "falcon_worker_iterations_total{worker=\"0\"} 0",
            "falcon_worker_blocked_seconds_total{worker=\"1\"} 1.5",
            "falcon_worker_compute_seconds_total{worker=\"1\"} 0.25",
            "falcon_worker_staleness_mean{worker=\"1\"} 1.5",
            "falcon_worker_staleness_max{worker=\"1\"} 3",
            "falcon_worker_threads{worker=\"1\"} 3",
            "falcon_worker_tasks_given_total{worker=\"0\"} 5",
            "falcon_worker_tasks_helped_total{worker=\"1\"} 5",
            "falcon_server_bytes_in_total{server=\"0\"} 4096",
            "falcon_server_gradients_total{server=\"0\"} 9",
            "falcon_server_parked_pulls{server=\"0\"} 2",
            "falcon_server_dropped_gradients_total{server=\"0\"} 1",
            "falcon_server_folded_gradients_total{server=\"0\"} 4",
            "falcon_up{role=\"worker\",rank=\"0\"} 0",
            "falcon_up{role=\"server\",rank=\"0\"} 1",
            "# EOF",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line:?} missing from:\n{text}"
            );
        }
    }

    #[test]
    fn the_endpoint_answers_scrapes_and_refuses_the_rest() {
        let board = Arc::new(Mutex::new(Board::new(1, 1)));
        let e = Exporter::start("127.0.0.1:0".parse().unwrap(), board.clone()).unwrap();
        let ok = scrape(e.addr(), "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(ok.contains("application/openmetrics-text"));
        assert!(ok.contains("falcon_worker_iterations_total{worker=\"0\"} 0"));
        assert!(ok.trim_end().ends_with("# EOF"));
        let missing = scrape(e.addr(), "GET /other HTTP/1.1\r\n\r\n");
        assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
        let bad = scrape(e.addr(), "\x00\x01garbage\r\n\r\n");
        assert!(bad.starts_with("HTTP/1.1 400"), "{bad}");
        // A client that trickles its request a byte at a time is cut off at the deadline,
        // and the next scrape is answered.
        let mut slow = TcpStream::connect(e.addr()).unwrap();
        let trickle = std::thread::spawn(move || {
            for b in b"GET /metrics HTTP/1.1\r\n" {
                if slow.write_all(&[*b]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(300));
            }
        });
        std::thread::sleep(Duration::from_millis(100));
        let t = std::time::Instant::now();
        let ok = scrape(e.addr(), "GET /metrics HTTP/1.0\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"));
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        let _ = trickle.join();
        // Twenty slowloris clients (a partial request each, then silence) hold no scrape up:
        // every connection is served at once, under its own deadline.
        let mut loris: Vec<TcpStream> = (0..20)
            .map(|_| {
                let mut c = TcpStream::connect(e.addr()).unwrap();
                c.write_all(b"GET /metrics HTTP/1.1\r\nX-").unwrap();
                c
            })
            .collect();
        std::thread::sleep(Duration::from_millis(100));
        let mut slowest = Duration::ZERO;
        for _ in 0..5 {
            let t = std::time::Instant::now();
            let ok = scrape(e.addr(), "GET /metrics HTTP/1.1\r\n\r\n");
            assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
            slowest = slowest.max(t.elapsed());
        }
        eprintln!("metrics: a scrape beside 20 slowloris clients answered within {slowest:?}");
        // The old endpoint served one connection at a time, each up to its 2 s deadline.
        assert!(slowest < Duration::from_millis(500), "{slowest:?}");
        // The slow clients are cut off at their deadline.
        for c in &mut loris {
            c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut rest = String::new();
            let _ = c.read_to_string(&mut rest);
        }
        // More clients than the cap: the oldest give way, the newest is answered.
        let crowd: Vec<TcpStream> = (0..MAX_CLIENTS + 10)
            .map(|_| TcpStream::connect(e.addr()).unwrap())
            .collect();
        std::thread::sleep(Duration::from_millis(100));
        let ok = scrape(e.addr(), "GET /metrics HTTP/1.1\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        drop(crowd);
        // Taken by another process: a clear error.
        let err = Exporter::start(e.addr(), board).err().unwrap().to_string();
        assert!(
            err.contains("the metrics endpoint cannot listen on")
                && err.contains("FALCON_METRICS_ADDR"),
            "{err}"
        );
    }
}
