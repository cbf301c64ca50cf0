//! Transport benchmarks: one-sided write and read bandwidth and small-message round trips per
//! medium, each beside its physical reference.

use std::time::{Duration, Instant};

use falcon_transport::{Completion, Link, Medium, Region, RemoteKey, Transport, TransportConfig};
use serde::Serialize;

use crate::reference::{self, PlainSocket};
use crate::stats::{median, percentile, size_label};

/// Immediates the echo side understands.
const IMM_ACK: u32 = 1;
const IMM_PING: u32 = 2;
const IMM_PONG: u32 = 3;

/// The sizes measured.
pub const SIZES: [u64; 5] = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20];

/// Two transports in this process joined by one link of `medium`, with an echo thread on the
/// far side. Both ends are real: the shm side maps memfds and rings futexes, the tcp side goes
/// through the kernel's loopback.
pub struct Bench {
    a: Transport,
    ab: Link,
    /// The far side's region, granted to us.
    remote: RemoteKey,
    src: Region,
    dst: Region,
    echo: Option<std::thread::JoinHandle<()>>,
}

impl Bench {
    /// Sets up a link of `medium` whose regions hold `max_len` bytes.
    pub fn new(medium: Medium, max_len: u64) -> falcon_transport::Result<Bench> {
        let cfg = TransportConfig::default();
        let a = Transport::new(cfg.clone())?;
        let b = Transport::new(cfg)?;
        let ab = a.connect_with(b.address(), medium)?;
        let ba = b.accept(Some(Duration::from_secs(10)))?;
        let far = Region::new(max_len)?;
        let remote = ab_key(&ba, &far, &a)?;
        let near = Region::new(max_len)?;
        let near_key = ab.grant(&near)?;
        ab.send(&near_key.to_bytes())?;
        let src = Region::new(max_len)?;
        src.fill(0xA5);
        let dst = Region::new(max_len)?;
        // Touch every page once so the first measured batch does not pay page faults.
        dst.fill(0);
        far.fill(0);
        let echo = std::thread::Builder::new()
            .name("bench-echo".into())
            .spawn(move || echo_loop(b, ba, far))
            .map_err(|e| falcon_transport::Error::Config(format!("spawn echo thread: {e}")))?;
        Ok(Bench {
            a,
            ab,
            remote,
            src,
            dst,
            echo: Some(echo),
        })
    }

    /// `n` one-sided writes of `len` bytes; the last carries an immediate the far side
    /// acknowledges, so the time covers delivery, not just posting.
    pub fn write_batch(&self, len: u64, n: usize) -> Duration {
        let start = Instant::now();
        for i in 0..n {
            let imm = (i + 1 == n).then_some(IMM_ACK);
            self.ab
                .write(&self.src, 0, &self.remote, 0, len, imm)
                .expect("write");
        }
        match self
            .a
            .cq()
            .wait(Some(Duration::from_secs(30)))
            .expect("ack")
        {
            Completion::Message { .. } => {}
            other => panic!("bench: unexpected {other:?}"),
        }
        start.elapsed()
    }

    /// `n` one-sided reads of `len` bytes.
    pub fn read_batch(&self, len: u64, n: usize) -> Duration {
        let start = Instant::now();
        for _ in 0..n {
            self.ab
                .read(&self.dst, 0, &self.remote, 0, len)
                .expect("read");
        }
        start.elapsed()
    }

    /// One round trip: a write of `len` bytes with an immediate, answered by a write of `len`
    /// bytes with an immediate.
    pub fn round_trip(&self, len: u64) -> Duration {
        let start = Instant::now();
        self.ab
            .write(&self.src, 0, &self.remote, 0, len, Some(IMM_PING))
            .expect("ping");
        match self
            .a
            .cq()
            .wait(Some(Duration::from_secs(30)))
            .expect("pong")
        {
            Completion::WriteImm { imm: IMM_PONG, .. } => {}
            other => panic!("bench: unexpected {other:?}"),
        }
        start.elapsed()
    }
}

impl Drop for Bench {
    fn drop(&mut self) {
        self.ab.close();
        if let Some(h) = self.echo.take() {
            let _ = h.join();
        }
    }
}

fn ab_key(ba: &Link, far: &Region, a: &Transport) -> falcon_transport::Result<RemoteKey> {
    let key = ba.grant(far)?;
    ba.send(&key.to_bytes())?;
    match a.cq().wait(Some(Duration::from_secs(10)))? {
        Completion::Message { data, .. } => RemoteKey::from_bytes(&data),
        _ => Err(falcon_transport::Error::Config(
            "expected the peer's message carrying a remote key, got a completion of another kind"
                .into(),
        )),
    }
}

fn echo_loop(b: Transport, ba: Link, _far: Region) {
    let Ok(Completion::Message { data, .. }) = b.cq().wait(Some(Duration::from_secs(10))) else {
        return;
    };
    let Ok(back) = RemoteKey::from_bytes(&data) else {
        return;
    };
    let src = Region::new(back.len).expect("region");
    loop {
        match b.cq().wait(None) {
            Ok(Completion::WriteImm { imm: IMM_ACK, .. }) => {
                if let Err(e) = ba.send(&[]) {
                    eprintln!("bench echo: acknowledgement failed: {e}");
                    return;
                }
            }
            Ok(Completion::WriteImm { imm: IMM_PING, .. }) => {
                // Echo with the same size the ping had: the benchmark uses one size per run.
                let len = PING_LEN.load(std::sync::atomic::Ordering::Relaxed);
                if let Err(e) = ba.write(&src, 0, &back, 0, len, Some(IMM_PONG)) {
                    eprintln!("bench echo: pong failed: {e}");
                    return;
                }
            }
            Ok(Completion::Closed { .. }) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

/// Size of the pong the echo thread answers with.
static PING_LEN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(64);

/// Sets the round-trip payload size (both directions).
pub fn set_round_trip_len(len: u64) {
    PING_LEN.store(len, std::sync::atomic::Ordering::Relaxed);
}

/// One line of the summary.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// `shm` or `tcp`.
    pub medium: String,
    /// `write`, `read` or `round trip`.
    pub op: String,
    /// Bytes per operation.
    pub size: u64,
    /// falcon's figure: GB/s for bandwidth, µs p50 for latency.
    pub falcon: f64,
    /// falcon's p99 (latency rows only).
    pub falcon_p99: Option<f64>,
    /// The reference's name.
    pub reference: String,
    /// The reference's figure, same unit.
    pub reference_value: f64,
    /// falcon / reference (bandwidth: higher is better; latency: lower is better).
    pub ratio: f64,
    /// `GB/s` or `µs p50`.
    pub unit: String,
}

/// How hard to measure.
#[derive(Clone, Copy, Debug)]
pub struct Effort {
    /// Repetitions per figure (the median is kept).
    pub reps: usize,
    /// Bytes moved per bandwidth repetition (at least 8 operations).
    pub bytes_per_rep: u64,
    /// Timed round trips per latency figure.
    pub round_trips: usize,
}

impl Effort {
    /// A full measurement (about a minute or two per medium on 2 cores).
    pub const FULL: Effort = Effort {
        reps: 9,
        bytes_per_rep: 512 << 20,
        round_trips: 20_000,
    };
    /// A smoke run so the benchmarks cannot rot (seconds).
    pub const QUICK: Effort = Effort {
        reps: 1,
        bytes_per_rep: 8 << 20,
        round_trips: 200,
    };
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// The media this machine can benchmark: shm and tcp, and rdma where a device answers;
/// `FALCON_BENCH_MEDIA` (comma-separated names) keeps only those it names (the soft-RoCE
/// guest measures rdma alone: the host measures the others).
pub fn available_media() -> Vec<Medium> {
    let mut media = vec![Medium::Shm, Medium::Tcp];
    if Transport::new(TransportConfig::default()).is_ok_and(|t| t.rdma_available()) {
        media.push(Medium::Rdma);
    }
    if let Ok(only) = std::env::var("FALCON_BENCH_MEDIA") {
        let wanted: Vec<&str> = only.split(',').map(str::trim).collect();
        media.retain(|m| wanted.contains(&m.name()));
    }
    media
}

/// The RDMA device and GID index perftest should use, when perftest can be run.
fn perftest_device() -> Option<(String, i32)> {
    #[cfg(feature = "rdma")]
    {
        let port = falcon_transport::rdma_ports()
            .ok()?
            .into_iter()
            .find(|p| p.state == "ACTIVE")?;
        let gid = std::env::var("FALCON_RDMA_GID_INDEX")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        Some((
            std::env::var("FALCON_RDMA_DEVICE").unwrap_or(port.device),
            gid,
        ))
    }
    #[cfg(not(feature = "rdma"))]
    None
}

/// Runs the whole transport summary for `media`, interleaving falcon's batches with the
/// reference's so drift affects both alike. References: memcpy (shm), a plain blocking
/// loopback socket (tcp), and for rdma perftest's `ib_write_bw`/`ib_read_bw`/`ib_write_lat`
/// when installed, else the plain socket (soft-RoCE runs over the kernel's network stack).
pub fn summary(media: &[Medium], effort: Effort) -> Vec<Row> {
    let max = *SIZES.iter().max().expect("sizes");
    let mut rows = Vec::new();
    for &medium in media {
        // Progress on stderr: a crash in an emulated guest is then placed.
        eprintln!("falcon transport summary: {medium} …");
        let bench = Bench::new(medium, max).expect("bench setup");
        let mut sock = PlainSocket::start(max as usize).expect("plain socket");
        let src = vec![0xA5u8; max as usize];
        let mut dst = vec![0u8; max as usize];
        let perf = if medium == Medium::Rdma {
            perftest_device()
        } else {
            None
        };
        for &size in &SIZES {
            let n = (effort.bytes_per_rep / size).clamp(8, 100_000) as usize;
            let bytes = n as u64 * size;
            for op in ["write", "read"] {
                let tool = if op == "write" {
                    "ib_write_bw"
                } else {
                    "ib_read_bw"
                };
                // perftest's average Gb/s, measured once beside our repetitions.
                let perftest = perf
                    .as_ref()
                    .and_then(|(d, g)| reference::perftest(tool, d, *g, size, n.min(5000) as u32))
                    .map(|v| v[3] / 8.0);
                let (mut f, mut r) = (Vec::new(), Vec::new());
                for _ in 0..effort.reps {
                    let t = if op == "write" {
                        bench.write_batch(size, n)
                    } else {
                        bench.read_batch(size, n)
                    };
                    f.push(gbps(bytes, t));
                    if perftest.is_some() {
                        continue;
                    }
                    let t = match medium {
                        Medium::Shm => {
                            reference::memcpy(&src[..size as usize], &mut dst[..size as usize], n)
                        }
                        _ if op == "write" => sock.write_batch(size as usize, n).expect("socket"),
                        _ => sock.read_batch(size as usize, n).expect("socket"),
                    };
                    r.push(gbps(bytes, t));
                }
                let fv = median(&mut f);
                let (reference, rv) = match (medium, perftest) {
                    (_, Some(v)) => (format!("perftest {tool}"), v),
                    (Medium::Shm, None) => ("memcpy".to_string(), median(&mut r)),
                    _ => (
                        "plain blocking socket, loopback".to_string(),
                        median(&mut r),
                    ),
                };
                rows.push(Row {
                    medium: medium.name().into(),
                    op: op.into(),
                    size,
                    falcon: fv,
                    falcon_p99: None,
                    reference,
                    reference_value: rv,
                    ratio: fv / rv,
                    unit: "GB/s".into(),
                });
            }
        }
        let rtt_sizes: &[u64] = match medium {
            Medium::Shm => &[64],
            _ => &[64, 4096],
        };
        for &size in rtt_sizes {
            set_round_trip_len(size);
            for _ in 0..effort.round_trips / 10 + 10 {
                bench.round_trip(size);
            }
            let mut f: Vec<f64> = (0..effort.round_trips)
                .map(|_| bench.round_trip(size).as_secs_f64() * 1e6)
                .collect();
            // ib_write_lat reports one-way latency: a round trip is twice its typical value.
            let perftest = perf
                .as_ref()
                .and_then(|(d, g)| {
                    reference::perftest("ib_write_lat", d, *g, size, effort.round_trips as u32)
                })
                .map(|v| 2.0 * v[4]);
            let (reference, rv) = match (medium, perftest) {
                (_, Some(v)) => ("perftest ib_write_lat × 2".to_string(), v),
                (Medium::Shm, None) => {
                    let mut r: Vec<f64> = reference::atomic_ping_pong(effort.round_trips)
                        .iter()
                        .map(|d| d.as_secs_f64() * 1e6)
                        .collect();
                    ("atomic ping-pong, 2 threads".to_string(), median(&mut r))
                }
                _ => {
                    let mut r: Vec<f64> = (0..effort.round_trips)
                        .map(|_| {
                            sock.round_trip(size as usize)
                                .expect("socket")
                                .as_secs_f64()
                                * 1e6
                        })
                        .collect();
                    (
                        "plain blocking socket ping-pong".to_string(),
                        median(&mut r),
                    )
                }
            };
            let p99 = percentile(&mut f, 99.0);
            let fv = median(&mut f);
            rows.push(Row {
                medium: medium.name().into(),
                op: "round trip".into(),
                size,
                falcon: fv,
                falcon_p99: Some(p99),
                reference,
                reference_value: rv,
                ratio: fv / rv,
                unit: "µs p50".into(),
            });
        }
        drop(bench);
        eprintln!("falcon transport summary: {medium} done");
    }
    rows
}

/// Renders rows as a Markdown table.
pub fn markdown(rows: &[Row]) -> String {
    let mut out = String::from(
        "| medium | op | size | falcon | reference | reference value | ratio |\n|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let falcon = match r.falcon_p99 {
            Some(p99) => format!("{:.1} µs p50 ({:.1} p99)", r.falcon, p99),
            None => format!("{:.2} {}", r.falcon, r.unit),
        };
        let reference = if r.unit == "GB/s" {
            format!("{:.2} GB/s", r.reference_value)
        } else {
            format!("{:.1} µs p50", r.reference_value)
        };
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {:.2} |\n",
            r.medium,
            r.op,
            size_label(r.size),
            falcon,
            r.reference,
            reference,
            r.ratio
        ));
    }
    out
}
