//! Physical references: what the hardware and kernel do without falcon.

use std::hint::black_box;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// memcpy of `len` bytes between two distinct buffers, `n` times; returns the elapsed time.
pub fn memcpy(src: &[u8], dst: &mut [u8], n: usize) -> Duration {
    let start = Instant::now();
    for _ in 0..n {
        dst.copy_from_slice(black_box(src));
        black_box(&mut *dst);
    }
    start.elapsed()
}

/// A plain blocking TCP socket pair on loopback with a tiny server: the reference for the
/// tcp medium. Ops: `W len` + payload (server reads it), `A` (server answers one byte),
/// `R len` (server sends len bytes), `P len` + payload (server echoes it).
pub struct PlainSocket {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl PlainSocket {
    /// Starts the server thread and connects to it.
    pub fn start(max_len: usize) -> std::io::Result<PlainSocket> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        std::thread::Builder::new()
            .name("plain-socket-server".into())
            .spawn(move || {
                let Ok((mut s, _)) = listener.accept() else {
                    return;
                };
                let _ = s.set_nodelay(true);
                let mut buf = vec![0u8; max_len];
                let mut hdr = [0u8; 9];
                while s.read_exact(&mut hdr).is_ok() {
                    let len = u64::from_le_bytes(hdr[1..].try_into().expect("8 bytes")) as usize;
                    let ok = match hdr[0] {
                        b'W' => s.read_exact(&mut buf[..len]),
                        b'A' => s.write_all(&[1]),
                        b'R' => s.write_all(&buf[..len]),
                        b'P' => s
                            .read_exact(&mut buf[..len])
                            .and_then(|_| s.write_all(&buf[..len])),
                        _ => return,
                    };
                    if ok.is_err() {
                        return;
                    }
                }
            })?;
        let stream = TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        Ok(PlainSocket {
            stream,
            buf: vec![0x3Cu8; max_len],
        })
    }

    fn header(op: u8, len: usize) -> [u8; 9] {
        let mut h = [op; 9];
        h[1..].copy_from_slice(&(len as u64).to_le_bytes());
        h
    }

    /// `n` writes of `len` bytes, then an acknowledged round trip (the data has arrived).
    pub fn write_batch(&mut self, len: usize, n: usize) -> std::io::Result<Duration> {
        let start = Instant::now();
        for _ in 0..n {
            let h = Self::header(b'W', len);
            let mut bufs = [
                std::io::IoSlice::new(&h),
                std::io::IoSlice::new(&self.buf[..len]),
            ];
            write_all_vectored(&mut self.stream, &mut bufs)?;
        }
        self.stream.write_all(&Self::header(b'A', 0))?;
        let mut one = [0u8; 1];
        self.stream.read_exact(&mut one)?;
        Ok(start.elapsed())
    }

    /// `n` request/response reads of `len` bytes.
    pub fn read_batch(&mut self, len: usize, n: usize) -> std::io::Result<Duration> {
        let start = Instant::now();
        for _ in 0..n {
            self.stream.write_all(&Self::header(b'R', len))?;
            self.stream.read_exact(&mut self.buf[..len])?;
        }
        Ok(start.elapsed())
    }

    /// One ping-pong of `len` bytes each way.
    pub fn round_trip(&mut self, len: usize) -> std::io::Result<Duration> {
        let start = Instant::now();
        let h = Self::header(b'P', len);
        let mut bufs = [
            std::io::IoSlice::new(&h),
            std::io::IoSlice::new(&self.buf[..len]),
        ];
        write_all_vectored(&mut self.stream, &mut bufs)?;
        self.stream.read_exact(&mut self.buf[..len])?;
        Ok(start.elapsed())
    }
}

fn write_all_vectored(
    s: &mut TcpStream,
    mut bufs: &mut [std::io::IoSlice<'_>],
) -> std::io::Result<()> {
    while !bufs.is_empty() {
        let n = s.write_vectored(bufs)?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        std::io::IoSlice::advance_slices(&mut bufs, n);
    }
    Ok(())
}

/// Two threads bouncing a counter through one shared cache line: the floor of any cross-core
/// hand-off, the reference for the shm round trip. Returns `n` per-round-trip latencies.
pub fn atomic_ping_pong(n: usize) -> Vec<Duration> {
    let word = Arc::new(AtomicU64::new(0));
    let w2 = word.clone();
    let echo = std::thread::spawn(move || {
        for i in 0..n as u64 {
            while w2.load(Ordering::Acquire) != 2 * i + 1 {
                std::hint::spin_loop();
            }
            w2.store(2 * i + 2, Ordering::Release);
        }
    });
    let mut out = Vec::with_capacity(n);
    for i in 0..n as u64 {
        let start = Instant::now();
        word.store(2 * i + 1, Ordering::Release);
        while word.load(Ordering::Acquire) != 2 * i + 2 {
            std::hint::spin_loop();
        }
        out.push(start.elapsed());
    }
    echo.join().expect("echo thread");
    out
}

/// Runs a perftest tool (`ib_write_bw`, `ib_read_bw`, `ib_write_lat`) against itself on
/// `device` and returns the numbers of its result line for `size`: for the bandwidth tools
/// `[bytes, iterations, peak Gb/s, average Gb/s, Mpps]`, for the latency tool
/// `[bytes, iterations, min, max, typical, avg, stdev, p99, p99.9]` in µs (one-way).
/// `None` when perftest is not installed or the run fails.
pub fn perftest(
    tool: &str,
    device: &str,
    gid_index: i32,
    size: u64,
    iters: u32,
) -> Option<Vec<f64>> {
    use std::process::{Command, Stdio};
    let port = 20000 + (std::process::id() % 20000) as u16;
    let args = |extra: &[&str]| {
        let mut a: Vec<String> = vec![
            "-d".into(),
            device.into(),
            "-x".into(),
            gid_index.to_string(),
            "-s".into(),
            size.to_string(),
            "-n".into(),
            iters.to_string(),
            "-p".into(),
            port.to_string(),
            "-F".into(),
        ];
        if tool.ends_with("_bw") {
            a.push("--report_gbits".into());
        }
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let mut server = Command::new(tool)
        .args(args(&[]))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    std::thread::sleep(Duration::from_millis(500));
    let out = Command::new(tool).args(args(&["localhost"])).output();
    let _ = server.kill();
    let _ = server.wait();
    let out = out.ok()?;
    String::from_utf8_lossy(&out.stdout).lines().find_map(|l| {
        let nums: Vec<f64> = l
            .split_whitespace()
            .filter_map(|w| w.parse().ok())
            .collect();
        (nums.len() >= 5 && nums[0] == size as f64).then_some(nums)
    })
}

/// `n` uncontended atomic `fetch_add`s on one word that stays in this core's cache: the cost of
/// the cheapest shared-state update. Returns the elapsed time.
pub fn atomic_fetch_add(n: usize) -> Duration {
    let word = AtomicU64::new(0);
    let start = Instant::now();
    for _ in 0..n {
        black_box(&word).fetch_add(1, Ordering::AcqRel);
    }
    let elapsed = start.elapsed();
    black_box(word.load(Ordering::Relaxed));
    elapsed
}

/// A dependent chain of random reads over a buffer much larger than the caches: each read's
/// address comes from the previous read, so every read pays a whole cache (and TLB) miss.
pub struct RandomReads {
    next: Vec<u64>,
    at: u64,
}

impl RandomReads {
    /// One random cycle through the `bytes / 8` words of a buffer of `bytes` bytes (Sattolo's
    /// shuffle, seeded: the same cycle every run).
    pub fn new(bytes: usize) -> RandomReads {
        let len = (bytes / 8).max(2);
        let mut next: Vec<u64> = (0..len as u64).collect();
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for i in (1..len).rev() {
            // xorshift64, then a multiply-shift into 0..i.
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let j = ((u128::from(x) * i as u128) >> 64) as usize;
            next.swap(i, j);
        }
        RandomReads { next, at: 0 }
    }

    /// `n` dependent random reads; returns the elapsed time.
    pub fn run(&mut self, n: usize) -> Duration {
        let mut at = self.at;
        let start = Instant::now();
        for _ in 0..n {
            at = self.next[at as usize];
        }
        let elapsed = start.elapsed();
        self.at = black_box(at);
        elapsed
    }
}

/// A cache miss's cost in ns: `reads` dependent random reads in `bytes`, once to warm up,
/// then the median per read over `reps` runs.
pub fn miss_ns(bytes: usize, reads: usize, reps: usize) -> f64 {
    let mut misses = RandomReads::new(bytes);
    misses.run(reads);
    let mut per: Vec<f64> = (0..reps.max(1))
        .map(|_| misses.run(reads).as_nanos() as f64 / reads.max(1) as f64)
        .collect();
    crate::stats::median(&mut per)
}

#[cfg(test)]
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_reads_visit_every_word_once_per_cycle() {
        let mut r = RandomReads::new(8 * 1000);
        let mut seen = vec![false; 1000];
        for _ in 0..1000 {
            assert!(!std::mem::replace(&mut seen[r.at as usize], true));
            r.run(1);
        }
        assert!(seen.iter().all(|&s| s) && r.at == 0);
        assert!(atomic_fetch_add(10) < Duration::from_secs(1));
    }
}
