//! The `falcon` command line.
//!
//! `falcon train` is the main job. Until the parameter-server engine lands it runs a real
//! multi-process demo of the data plane: a server process holds a model in a region, worker
//! processes pull it with one-sided reads and push gradients with one-sided writes carrying
//! immediates, and the server averages them each iteration (synchronously).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use falcon_transport::{
    Completion, Medium, PeerAddr, Region, RemoteKey, Transport, TransportConfig,
};

#[derive(Parser)]
#[command(name = "falcon", version, about = "A heterogeneity-aware parameter server", long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the main job on this host (for now: the data-plane demo).
    Train(TrainArgs),
    /// Run benchmarks and print them beside their physical references.
    Bench {
        /// What to benchmark.
        #[arg(value_parser = ["transport"], default_value = "transport")]
        what: String,
        /// A short smoke run instead of a full measurement.
        #[arg(long)]
        quick: bool,
    },
    /// Explain this machine: host identity, media, memlock limit, shared-memory directory.
    Doctor,
    /// One worker process of `falcon train` (started by it).
    #[command(hide = true)]
    DemoWorker {
        /// The server's address.
        #[arg(long)]
        server: String,
        /// The worker's rank.
        #[arg(long)]
        rank: u32,
        /// Iterations.
        #[arg(long)]
        iters: u32,
        /// Medium.
        #[arg(long)]
        medium: String,
        /// Job id.
        #[arg(long)]
        job: u64,
    },
}

#[derive(clap::Args)]
struct TrainArgs {
    /// Worker processes.
    #[arg(long, default_value_t = 2)]
    workers: u32,
    /// Iterations (each: every worker pulls the model and pushes a gradient).
    #[arg(long, default_value_t = 200)]
    iters: u32,
    /// Model size in f32 parameters.
    #[arg(long, default_value_t = 1 << 20)]
    floats: u64,
    /// Medium between workers and the server: auto, shm or tcp.
    #[arg(long, default_value = "auto")]
    medium: String,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let r = match cli.command {
        Command::Train(a) => train(a),
        Command::Bench { what: _, quick } => {
            let effort = if quick {
                falcon_bench::transport::Effort::QUICK
            } else {
                falcon_bench::transport::Effort::FULL
            };
            let rows = falcon_bench::transport::summary(
                &falcon_bench::transport::available_media(),
                effort,
            );
            println!("{}", falcon_bench::transport::markdown(&rows));
            Ok(())
        }
        Command::Doctor => doctor(),
        Command::DemoWorker {
            server,
            rank,
            iters,
            medium,
            job,
        } => demo_worker(&server, rank, iters, &medium, job),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("falcon: error: {e}");
            ExitCode::FAILURE
        }
    }
}

type Res = Result<(), Box<dyn std::error::Error>>;

const WAIT: Option<Duration> = Some(Duration::from_secs(30));

fn train(a: TrainArgs) -> Res {
    let medium: Medium = a.medium.parse()?;
    if a.workers == 0 || a.floats == 0 {
        return Err("--workers and --floats must be at least 1".into());
    }
    let job = std::process::id() as u64 ^ 0xFA1C_0000_0000;
    let t = Transport::new(TransportConfig {
        job,
        ..Default::default()
    })?;
    let bytes = a.floats * 4;
    let model = Region::new(bytes)?;
    let grads: Vec<Region> = (0..a.workers)
        .map(|_| Region::new(bytes))
        .collect::<Result<_, _>>()?;
    println!(
        "falcon train: data-plane demo (the engine lands with issue 4): 1 server, {} workers, {} floats ({} MiB), {} iterations, medium {medium}",
        a.workers,
        a.floats,
        bytes >> 20,
        a.iters
    );
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    for rank in 0..a.workers {
        children.push(
            std::process::Command::new(&exe)
                .args(["demo-worker", "--server", &t.address().to_string()])
                .args(["--rank", &rank.to_string(), "--iters", &a.iters.to_string()])
                .args(["--medium", medium.name(), "--job", &job.to_string()])
                .spawn()?,
        );
    }
    // Accept every worker, grant it the model (read) and its gradient slot (write).
    let mut links = Vec::new();
    for _ in 0..a.workers {
        links.push(t.accept(WAIT)?);
    }
    for (i, link) in links.iter().enumerate() {
        let mk = link.grant(&model)?;
        let gk = link.grant(&grads[i])?;
        let mut msg = mk.to_bytes().to_vec();
        msg.extend_from_slice(&gk.to_bytes());
        link.send(&msg)?;
    }
    let mut w = vec![0f32; a.floats as usize];
    let mut g = vec![0f32; a.floats as usize];
    let start = Instant::now();
    let lr = 0.5f32;
    for it in 0..a.iters {
        // Wait for every worker's push of this iteration (immediate = iteration).
        let mut got = 0;
        while got < a.workers {
            match t.cq().wait(WAIT)? {
                Completion::WriteImm { imm, .. } if imm == it => got += 1,
                Completion::Closed { error, .. } => {
                    return Err(format!("a worker left early: {error:?}").into());
                }
                other => return Err(format!("unexpected completion {other:?}").into()),
            }
        }
        // Average the gradients into the model: w -= lr * mean(g).
        for grad in &grads {
            grad.read_at(0, bytemuck_f32(&mut g))?;
            for (wi, gi) in w.iter_mut().zip(&g) {
                *wi -= lr * gi / a.workers as f32;
            }
        }
        model.write_at(0, bytemuck_f32(&mut w))?;
        for link in &links {
            link.send(&it.to_le_bytes())?;
        }
        if it % 50 == 0 || it + 1 == a.iters {
            println!("  iteration {it:>4}: w[0] = {:.6}", w[0]);
        }
    }
    let secs = start.elapsed().as_secs_f64();
    for c in &mut children {
        let s = c.wait()?;
        if !s.success() {
            return Err(format!("a worker exited with {s}").into());
        }
    }
    // Each worker pushes gradient = (w - target) with target = rank + 1: w converges to the
    // mean target.
    let target = (1..=a.workers).map(|r| r as f32).sum::<f32>() / a.workers as f32;
    let moved = 2.0 * a.workers as f64 * a.iters as f64 * bytes as f64;
    println!(
        "done: {:.1} iterations/s, {:.2} GB/s moved (pull + push), w[0] = {:.4} (expected → {target:.4})",
        a.iters as f64 / secs,
        moved / secs / 1e9,
        w[0]
    );
    if (w[0] - target).abs() > 1e-2 && a.iters >= 50 {
        return Err("the model did not converge to the workers' mean target".into());
    }
    Ok(())
}

fn bytemuck_f32(v: &mut [f32]) -> &mut [u8] {
    // SAFETY: f32 has no invalid bit patterns and u8 has alignment 1; the length is scaled.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

fn demo_worker(server: &str, rank: u32, iters: u32, medium: &str, job: u64) -> Res {
    let peer: PeerAddr = server.parse()?;
    let t = Transport::new(TransportConfig {
        job,
        bind: None,
        shm: false,
        ..Default::default()
    })?;
    let link = t.connect_with(&peer, medium.parse()?)?;
    let keys = match t.cq().wait(WAIT)? {
        Completion::Message { data, .. } if data.len() == 2 * RemoteKey::SIZE => data,
        other => return Err(format!("worker {rank}: expected keys, got {other:?}").into()),
    };
    let mk = RemoteKey::from_bytes(&keys[..RemoteKey::SIZE])?;
    let gk = RemoteKey::from_bytes(&keys[RemoteKey::SIZE..])?;
    let params = Region::new(mk.len)?;
    let grad = Region::new(gk.len)?;
    let n = (mk.len / 4) as usize;
    let (mut w, mut g) = (vec![0f32; n], vec![0f32; n]);
    let target = (rank + 1) as f32;
    for it in 0..iters {
        link.read(&params, 0, &mk, 0, mk.len)?;
        params.read_at(0, bytemuck_f32(&mut w))?;
        for (gi, wi) in g.iter_mut().zip(&w) {
            *gi = wi - target;
        }
        grad.write_at(0, bytemuck_f32(&mut g))?;
        link.write(&grad, 0, &gk, 0, gk.len, Some(it))?;
        // The server's go-ahead for the next iteration.
        match t.cq().wait(WAIT)? {
            Completion::Message { data, .. } if data == it.to_le_bytes() => {}
            other => return Err(format!("worker {rank}: unexpected {other:?}").into()),
        }
    }
    link.close();
    Ok(())
}

fn doctor() -> Res {
    println!("falcon doctor");
    println!("  host id            {}", falcon_transport::host_id());
    let t = Transport::new(TransportConfig::default())?;
    println!(
        "  shm                available (memfd + unix socket at {})",
        t.address()
            .shm
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default()
    );
    println!(
        "  tcp                available (loopback test listener {})",
        t.address().tcp.map(|a| a.to_string()).unwrap_or_default()
    );
    let (soft, hard) = memlock();
    println!("  memlock (ulimit -l) soft {soft}, hard {hard}");
    rdma_report();
    println!("  cuda               not built in (rebuild with --features cuda)");
    Ok(())
}

#[cfg(feature = "rdma")]
fn rdma_report() {
    match falcon_transport::rdma_ports() {
        Ok(ports) if ports.is_empty() => println!(
            "  rdma               built in; no RDMA device found (tcp will be used between hosts)"
        ),
        Ok(ports) => {
            println!("  rdma               built in; {} port(s):", ports.len());
            for p in ports {
                println!(
                    "    {} port {}: {} · {} · MTU {} · LID {}",
                    p.device, p.port, p.state, p.link_layer, p.mtu, p.lid
                );
                for (i, g) in p.gids {
                    println!("      GID[{i}] {g}");
                }
            }
        }
        Err(e) => println!("  rdma               built in; unavailable: {e}"),
    }
    if let Some(limit) = falcon_transport::memlock_limit() {
        println!(
            "    memlock limit {} KiB: RDMA registers every region it moves; raise it if regions are larger (`ulimit -l unlimited`)",
            limit / 1024
        );
    }
}

#[cfg(not(feature = "rdma"))]
fn rdma_report() {
    println!("  rdma               not built in (rebuild with --features rdma)");
}

fn memlock() -> (String, String) {
    let show = |v: Option<u64>| v.map_or("unlimited".to_string(), |b| format!("{} KiB", b / 1024));
    let l = rustix_limit();
    (show(l.0), show(l.1))
}

fn rustix_limit() -> (Option<u64>, Option<u64>) {
    let text = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    for line in text.lines() {
        if line.starts_with("Max locked memory") {
            let f: Vec<&str> = line.split_whitespace().collect();
            let parse = |s: &str| s.parse::<u64>().ok();
            if f.len() >= 6 {
                return (parse(f[3]), parse(f[4]));
            }
        }
    }
    (None, None)
}
