//! In-process clusters (a scheduler and servers on threads, workers as handles) over the real
//! transport: the engine's end-to-end contracts.

use std::time::Duration;

use falcon_engine::keys::TensorSpec;
use falcon_engine::local::LocalCluster;
use falcon_engine::sync::PolicySpec;
use falcon_engine::update::{Aggregate, Optimizer, UpdateMode};
use falcon_engine::{Error, JobConfig, Worker};

fn cfg(servers: u32, workers: u32, policy: PolicySpec) -> JobConfig {
    // Warnings (a node declared dead, a refused peer) show up in a failing test's output.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
    JobConfig {
        job: format!("test-{}", fastrand::u64(..)),
        token: "secret".into(),
        servers,
        workers,
        policy,
        max_shard_bytes: 1024, // small shards: many per tensor, spread over the servers
        heartbeat: Duration::from_secs(1),
        rendezvous_timeout: Duration::from_secs(30),
        ..JobConfig::default()
    }
}

fn tensors() -> Vec<TensorSpec> {
    vec![TensorSpec::new("w", 1000), TensorSpec::new("b", 10)]
}

/// The gradient worker `w` computes at iteration `t` from parameters `p`: depends on all
/// three, so a worker that saw other parameters would push other bits.
fn grad(w: u32, t: u64, p: &[f32]) -> Vec<f32> {
    p.iter()
        .enumerate()
        .map(|(i, x)| {
            0.05 * x + 0.001 * ((w + 1) as f32) * ((t + 1) as f32) + 0.0001 * (i % 7) as f32
        })
        .collect()
}

#[test]
fn bsp_with_sgd_is_bitwise_equal_to_a_single_process_reference() {
    bsp_against_the_reference(false);
}

#[test]
fn push_pull_under_bsp_is_bitwise_equal_to_the_same_reference() {
    bsp_against_the_reference(true);
}

/// Three workers, two servers, BSP with the mean and SGD, six iterations with jitter; each
/// iteration a pull then a push, or (`push_pull`) one `push_pull` bringing the next
/// iteration's values. The result must be the reference's bit for bit.
fn bsp_against_the_reference(push_pull: bool) {
    const W: u32 = 3;
    const ITERS: u64 = 6;
    let lr = 0.1f32;
    let mut c = cfg(2, W, PolicySpec::Bsp);
    c.optimizer = Optimizer::Sgd { lr };
    c.aggregate = Aggregate::Mean;
    let cluster = LocalCluster::start(c, tensors()).unwrap();
    let init: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin()).collect();
    let threads: Vec<_> = cluster
        .workers
        .iter()
        .cloned()
        .map(|worker: Worker| {
            let init = init.clone();
            std::thread::spawn(move || {
                if worker.rank() == 0 {
                    let buf = worker.buffer("w").unwrap();
                    buf.write_at(0, falcon_engine::worker::f32_bytes(&init))
                        .unwrap();
                    worker.init("w", &buf).unwrap();
                }
                // Nobody pulls before the initial values are in.
                worker.barrier().unwrap();
                let mut p = vec![0f32; 1000];
                let (out, gb) = (worker.buffer("w").unwrap(), worker.buffer("w").unwrap());
                if push_pull {
                    worker.pull("w", &out, 0).unwrap();
                }
                for t in 0..ITERS {
                    if push_pull {
                        out.read_at(0, falcon_engine::worker::f32_bytes_mut(&mut p))
                            .unwrap();
                        let g = grad(worker.rank(), t, &p);
                        gb.write_at(0, falcon_engine::worker::f32_bytes(&g))
                            .unwrap();
                        // The answer may land in the region the gradient left from.
                        let dst = if t % 2 == 0 { &out } else { &gb };
                        worker.push_pull("w", &gb, dst, t).unwrap();
                        if t % 2 == 1 {
                            gb.read_at(0, falcon_engine::worker::f32_bytes_mut(&mut p))
                                .unwrap();
                            out.write_at(0, falcon_engine::worker::f32_bytes(&p))
                                .unwrap();
                        }
                        continue;
                    }
                    worker.pull_slice("w", &mut p, t).unwrap();
                    let g = grad(worker.rank(), t, &p);
                    worker.push_slice("w", &g, t).unwrap();
                    // Jitter: BSP must not care who is fast.
                    std::thread::sleep(Duration::from_micros(fastrand::u64(0..2000)));
                }
                worker.clock()
            })
        })
        .collect();
    for h in threads {
        assert_eq!(h.join().unwrap(), ITERS);
    }
    let keymap = cluster.workers[0].keymap().clone();
    let report = cluster.finish().unwrap();
    let got = report.tensor(&keymap, "w").unwrap();
    // The reference: same gradients, summed in rank order, × 1/W, then w -= lr·g.
    let mut p = init.clone();
    for t in 0..ITERS {
        let gs: Vec<Vec<f32>> = (0..W).map(|w| grad(w, t, &p)).collect();
        let inv = 1.0 / W as f32;
        for i in 0..p.len() {
            let mut s = gs[0][i];
            for g in &gs[1..] {
                s += g[i];
            }
            p[i] -= lr * (s * inv);
        }
    }
    assert!(
        got.iter().zip(&p).all(|(a, b)| a.to_bits() == b.to_bits()),
        "BSP result differs from the reference"
    );
    assert_eq!(
        report.scheduler.bytes_per_server.iter().sum::<u64>(),
        1010 * 4
    );
}

#[test]
fn push_pull_answers_each_shard_after_its_own_push_is_applied() {
    // One worker under ASP: every push is applied at once, so each answer must be what a
    // pull of the next clock returns afterwards, and differ from the values before it, on
    // every shard of both servers: a shard answered before its push was applied would hold
    // the old values. In f32 the answer is exactly the values before minus lr times the
    // gradient. A bf16 push is acknowledged before its apply; the answer still follows it.
    use falcon_engine::precision::Wire;
    const N: usize = 4096;
    let lr = 0.25f32;
    for wire in [Wire::F32, Wire::Bf16] {
        let mut c = cfg(2, 1, PolicySpec::Asp);
        c.optimizer = Optimizer::Sgd { lr };
        c.wire = wire;
        c.max_shard_bytes = 4096; // four shards, two on each server
        let spec = TensorSpec::new("w", N as u64);
        let small = TensorSpec::new("b", 10);
        let cluster = LocalCluster::start(c, vec![spec, small]).unwrap();
        let worker = cluster.workers[0].clone();
        let (out, gb) = (worker.buffer("w").unwrap(), worker.buffer("w").unwrap());
        let init: Vec<f32> = (0..N).map(|i| 1.0 + (i as f32 * 0.37).sin()).collect();
        gb.write_at(0, falcon_engine::worker::f32_bytes(&init))
            .unwrap();
        worker.init("w", &gb).unwrap();
        worker.pull("w", &out, 0).unwrap();
        let mut p = vec![0f32; N];
        let mut next = vec![0f32; N];
        let mut later = vec![0f32; N];
        for t in 0..8 {
            out.read_at(0, falcon_engine::worker::f32_bytes_mut(&mut p))
                .unwrap();
            let g = grad(0, t, &p);
            gb.write_at(0, falcon_engine::worker::f32_bytes(&g))
                .unwrap();
            worker.push_pull("w", &gb, &out, t).unwrap();
            out.read_at(0, falcon_engine::worker::f32_bytes_mut(&mut next))
                .unwrap();
            worker.pull_slice("w", &mut later, t + 1).unwrap();
            assert_eq!(
                next, later,
                "{wire:?}, iteration {t}: the answer is the pushed values"
            );
            let moved = next.iter().zip(&p).filter(|(a, b)| a != b).count();
            assert!(
                moved > 900,
                "{wire:?}, iteration {t}: {moved} of 1000 values moved"
            );
            if wire == Wire::F32 {
                let off = (0..N).find(|&i| next[i].to_bits() != (p[i] - lr * g[i]).to_bits());
                assert_eq!(off, None, "iteration {t}: the first float off");
            }
        }
        assert_eq!(worker.clock(), 8);
        // A wrong clock or length is refused as for push and pull, and nothing is sent.
        assert!(matches!(
            worker.push_pull("w", &gb, &out, 3),
            Err(Error::BadClock { .. })
        ));
        let short = worker.buffer("b").unwrap();
        assert!(worker.push_pull("w", &gb, &short, 8).is_err());
        assert!(worker.push_pull("w", &short, &out, 8).is_err());
        worker.push_pull("w", &gb, &out, 8).unwrap();
        cluster.finish().unwrap();
    }
}

/// `W` workers pull and push tensor "b" `N` times, worker w pushing −(w+1) each time (so
/// its pushes add (w+1) to every element), each push sent again when `repeat` (a retry after
/// a lost acknowledgement). Checks that every push was applied exactly once; returns the
/// repeats the servers reported and the shards of "b".
fn count_every_push(policy: PolicySpec, w: u32, n: u64, repeat: bool) -> (u64, u64) {
    let mut c = cfg(2, w, policy);
    c.optimizer = Optimizer::Sgd { lr: 1.0 };
    c.aggregate = Aggregate::Sum;
    let cluster = LocalCluster::start(c, tensors()).unwrap();
    let threads: Vec<_> = cluster
        .workers
        .iter()
        .cloned()
        .map(|worker| {
            std::thread::spawn(move || {
                let mut p = vec![0f32; 10];
                let g = vec![-((worker.rank() + 1) as f32); 10];
                for t in 0..n {
                    worker.pull_slice("b", &mut p, t).unwrap();
                    worker.push_slice("b", &g, t).unwrap();
                    if repeat {
                        worker.repeat_last_push("b").unwrap();
                    }
                }
            })
        })
        .collect();
    for h in threads {
        h.join().unwrap();
    }
    let keymap = cluster.workers[0].keymap().clone();
    let report = cluster.finish().unwrap();
    let b = report.tensor(&keymap, "b").unwrap();
    let expect = (1..=w).map(|w| w as f32 * n as f32).sum::<f32>();
    assert!(
        b.iter().all(|&x| x == expect),
        "{policy:?}: every push applied exactly once: {b:?} vs {expect}"
    );
    let grads: u64 = report.servers.iter().map(|s| s.gradients).sum();
    let shards_b = keymap.shards_of(1).count() as u64;
    assert_eq!(grads, u64::from(w) * n * shards_b, "{policy:?}");
    let repeats = report.servers.iter().map(|s| s.duplicate_pushes).sum();
    (repeats, shards_b)
}

#[test]
fn a_host_crowded_with_the_jobs_nodes_parks_instead_of_spinning() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let spin = Duration::from_micros(30);
    for auto in [true, false] {
        let mut c = cfg(2, 2, PolicySpec::Bsp);
        c.transport.spin = spin;
        c.spin_auto = auto;
        let cluster = LocalCluster::start(c, tensors()).unwrap();
        for w in &cluster.workers {
            // Two servers and two workers, all on this host.
            assert_eq!(w.host_peers(), 4);
            let want = falcon_engine::config::host_spin(spin, auto, 4, cores);
            assert_eq!(w.spin(), want, "auto {auto}, {cores} cores");
            if auto && cores < 4 {
                assert_eq!(w.spin(), Duration::ZERO);
            }
        }
        // Steps go on whether the waits spin or park.
        let threads: Vec<_> = cluster
            .workers
            .iter()
            .cloned()
            .map(|worker| {
                std::thread::spawn(move || {
                    let mut p = vec![0f32; 10];
                    for t in 0..20 {
                        worker.pull_slice("b", &mut p, t).unwrap();
                        worker.push_slice("b", &[1.0; 10], t).unwrap();
                    }
                    worker.pull_slice("b", &mut p, 20).unwrap();
                    p
                })
            })
            .collect();
        let lr = JobConfig::default().optimizer.lr();
        for h in threads {
            let p = h.join().unwrap();
            assert!(p.iter().all(|&x| (x + 20.0 * lr).abs() < 1e-4), "{p:?}");
        }
        cluster.finish().unwrap();
    }
}

#[test]
fn asp_applies_every_push_exactly_once() {
    let (repeats, _) = count_every_push(PolicySpec::Asp, 4, 25, false);
    assert_eq!(repeats, 0);
}

#[test]
fn repeated_pushes_are_acknowledged_and_never_applied_twice() {
    // Every push is sent twice: the parameters count each gradient once, and the servers
    // report every repeat.
    for policy in [PolicySpec::Asp, PolicySpec::Bsp] {
        let (repeats, shards) = count_every_push(policy, 2, 10, true);
        assert_eq!(repeats, 2 * 10 * shards, "{policy:?}");
    }
}

#[test]
fn no_pull_ever_sees_a_shard_beyond_the_ssp_bound() {
    // Parameters count pushes: worker w adds 1 to element w. A pull at clock c must then see
    // every element ≥ c − s — checked on the values themselves, under random delays.
    const W: u32 = 4;
    const S: u64 = 2;
    const N: u64 = 30;
    let mut c = cfg(1, W, PolicySpec::Ssp { s: S });
    c.optimizer = Optimizer::Sgd { lr: 1.0 };
    c.mode = Some(UpdateMode::Async);
    let counts = vec![TensorSpec::new("count", W as u64)];
    let cluster = LocalCluster::start(c, counts).unwrap();
    let threads: Vec<_> = cluster
        .workers
        .iter()
        .cloned()
        .map(|worker| {
            std::thread::spawn(move || {
                let me = worker.rank() as usize;
                let slow = me == 0; // one persistent straggler
                let mut p = vec![0f32; W as usize];
                let mut g = vec![0f32; W as usize];
                g[me] = -1.0;
                let mut violations = 0;
                for t in 0..N {
                    worker.pull_slice("count", &mut p, t).unwrap();
                    let min = p.iter().cloned().fold(f32::INFINITY, f32::min) as u64;
                    if min + S < t {
                        violations += 1;
                    }
                    // The straggler is slow enough that a pioneer's request reaches the server before the
                    // straggler's next push even on a loaded host (at 3 ms it did not, once).
                    let pause = if slow { 8000 } else { fastrand::u64(0..500) };
                    std::thread::sleep(Duration::from_micros(pause));
                    worker.push_slice("count", &g, t).unwrap();
                }
                (violations, worker.stats())
            })
        })
        .collect();
    let mut slow_pulls = 0;
    for h in threads {
        let (v, stats) = h.join().unwrap();
        assert_eq!(v, 0, "a pull observed a shard beyond the staleness bound");
        slow_pulls += stats.slow_pulls;
    }
    let report = cluster.finish().unwrap();
    assert!(
        slow_pulls > 0,
        "the straggler must have made fast workers wait"
    );
    // A pull that failed the lock-free check may still be released at once if the straggler
    // caught up before the request arrived: parked ≤ asked, and some were parked.
    let delayed = report.servers[0].delayed_pulls;
    assert!(
        delayed > 0 && delayed <= slow_pulls,
        "delayed {delayed}, slow {slow_pulls}"
    );
}

#[test]
fn bad_input_gets_typed_errors() {
    let cluster = LocalCluster::start(cfg(1, 1, PolicySpec::Bsp), tensors()).unwrap();
    let w = &cluster.workers[0];
    let short = falcon_transport::Region::new(12).unwrap();
    assert!(matches!(
        w.push("w", &short, 0),
        Err(Error::WrongLength {
            expected: 1000,
            got: 3,
            ..
        })
    ));
    assert!(matches!(
        w.push_slice("nope", &[1.0], 0),
        Err(Error::UnknownTensor(_))
    ));
    let mut out = vec![0f32; 10];
    assert!(
        matches!(
            w.pull_slice("b", &mut out, 3),
            Err(Error::BadClock { got: 3, .. })
        ),
        "a clock from the future"
    );
    assert!(
        matches!(
            w.push_slice("b", &out, 5),
            Err(Error::BadClock { got: 5, .. })
        ),
        "pushes are consecutive"
    );
    // The worker is still fine.
    w.pull_slice("b", &mut out, 0).unwrap();
    w.push_slice("b", &out, 0).unwrap();
    cluster.finish().unwrap();
}

#[test]
fn rendezvous_refuses_wrong_tokens_and_duplicate_ranks() {
    let mut c = cfg(1, 2, PolicySpec::Bsp);
    let sched = falcon_engine::Scheduler::bind(c.clone()).unwrap();
    c.scheduler = sched.address();
    let s = std::thread::spawn(move || sched.run());
    let server = {
        let c = c.clone();
        std::thread::spawn(move || falcon_engine::Server::join(c, None, Default::default())?.run())
    };
    // Another job's token.
    let mut stale = c.clone();
    stale.token = "previous-job".into();
    let err = Worker::join(&stale, tensors(), None)
        .err()
        .expect("refused");
    assert!(
        matches!(&err, Error::Refused(r) if r.contains("token")),
        "{err}"
    );
    // Rank 0 taken, then a second rank 0.
    let first = {
        let c = c.clone();
        std::thread::spawn(move || Worker::join(&c, tensors(), Some(0)))
    };
    std::thread::sleep(Duration::from_millis(300));
    let err = Worker::join(&c, tensors(), Some(0)).err().expect("refused");
    assert!(
        matches!(&err, Error::Refused(r) if r.contains("duplicate rank")),
        "{err}"
    );
    let second = Worker::join(&c, tensors(), Some(1)).unwrap();
    let first = first.join().unwrap().unwrap();
    first.finish().unwrap();
    second.finish().unwrap();
    let report = s.join().unwrap().unwrap();
    assert_eq!(report.refused.len(), 2);
    server.join().unwrap().unwrap();
}

#[test]
fn an_unreachable_scheduler_is_a_prompt_error() {
    let mut c = cfg(1, 1, PolicySpec::Bsp);
    // A port nobody listens on, and nobody can take while the test runs: bound, not
    // listening (a port freed instead may be taken by another test's node meanwhile).
    let held = rustix::net::socket(
        rustix::net::AddressFamily::INET,
        rustix::net::SocketType::STREAM,
        None,
    )
    .unwrap();
    rustix::net::bind(&held, &std::net::SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
    let bound: std::net::SocketAddr = rustix::net::getsockname(&held).unwrap().try_into().unwrap();
    let port = bound.port();
    c.scheduler = format!("host=elsewhere;tcp=127.0.0.1:{port}");
    // Nodes retry an absent scheduler until their rendezvous deadline, then say why.
    c.rendezvous_timeout = Duration::from_secs(2);
    let start = std::time::Instant::now();
    let err = Worker::join(&c, tensors(), None).err().expect("fails");
    // The error says where it tried, how often and why it failed.
    assert!(
        matches!(
            err,
            Error::PeerGone {
                role: "scheduler",
                ..
            }
        ),
        "{err}"
    );
    let text = err.to_string();
    assert!(
        text.contains(&format!(
            "unreachable at host=elsewhere;tcp=127.0.0.1:{port}"
        )) && text.contains("attempts in 2.0 s")
            && text.contains("cannot reach"),
        "{text}"
    );
    assert!(start.elapsed() < Duration::from_secs(10));
    drop(held);
}

#[test]
fn dynsgd_scales_a_stale_gradient_by_one_over_staleness_plus_one() {
    let mut c = cfg(1, 2, PolicySpec::Asp);
    c.optimizer = Optimizer::Sgd { lr: 1.0 };
    c.scale = falcon_engine::update::ScaleSpec::DynSgd;
    let counts = vec![TensorSpec::new("x", 1)];
    let cluster = LocalCluster::start(c, counts).unwrap();
    let (w0, w1) = (&cluster.workers[0], &cluster.workers[1]);
    let mut v = [0f32];
    // Worker 0 reads version 0, then worker 1 makes three fresh updates of +1 each.
    w0.pull_slice("x", &mut v, 0).unwrap();
    for t in 0..3 {
        // A push is acknowledged on receipt and applied just after: pull until worker 1 sees
        // its own previous updates, so the gradient it pushes is fresh (d = 0).
        loop {
            w1.pull_slice("x", &mut v, t).unwrap();
            if v[0] == t as f32 {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        w1.push_slice("x", &[-1.0], t).unwrap();
    }
    // Worker 0's gradient is 3 versions stale: DynSGD applies it × 1/4.
    w0.push_slice("x", &[-1.0], 0).unwrap();
    let keymap = cluster.workers[0].keymap().clone();
    let report = cluster.finish().unwrap();
    assert_eq!(report.tensor(&keymap, "x").unwrap(), vec![3.25]);
    assert_eq!(report.servers[0].staleness_max, 3);
    assert_eq!(
        report.servers[0].staleness_sum, 3,
        "worker 1's updates were fresh"
    );
}

#[test]
fn a_pull_waits_for_a_straggler_longer_than_the_operation_timeout() {
    // The operation timeout bounds a single transfer; a BSP pull rightly waits as long as the
    // slowest worker takes. Liveness (heartbeats, closed links) ends waits, not a clock.
    let mut c = cfg(1, 2, PolicySpec::Bsp);
    c.transport.op_timeout = Duration::from_secs(1);
    let cluster = LocalCluster::start(c, tensors()).unwrap();
    let (w0, w1) = (cluster.workers[0].clone(), cluster.workers[1].clone());
    let mut b = vec![0f32; 10];
    w0.pull_slice("b", &mut b, 0).unwrap();
    w0.push_slice("b", &b, 0).unwrap();
    let straggler = std::thread::spawn(move || {
        let mut b = vec![0f32; 10];
        w1.pull_slice("b", &mut b, 0).unwrap();
        std::thread::sleep(Duration::from_secs(3));
        w1.push_slice("b", &b, 0).unwrap();
    });
    let start = std::time::Instant::now();
    w0.pull_slice("b", &mut b, 1).unwrap();
    assert!(
        start.elapsed() >= Duration::from_secs(2),
        "the pull waited for the straggler"
    );
    straggler.join().unwrap();
    let w = cluster.workers[0].clone();
    cluster.finish().unwrap();
    assert!(
        matches!(w.pull_slice("b", &mut b, 1), Err(Error::Config(_))),
        "no pulls after finish"
    );
}

#[test]
fn admission_is_challenge_response_and_answers_do_not_replay() {
    use falcon_engine::auth::{self, Purpose};
    use falcon_engine::proto::{Msg, Role};
    use falcon_transport::{Completion, Transport};

    let mut c = cfg(1, 1, PolicySpec::Bsp);
    let sched = falcon_engine::Scheduler::bind(c.clone()).unwrap();
    c.scheduler = sched.address();
    let s = std::thread::spawn(move || sched.run());
    let t = Transport::new(falcon_transport::TransportConfig {
        bind: None,
        ..c.transport_config()
    })
    .unwrap();
    let addr = c.scheduler.parse().unwrap();
    let next = |link: &falcon_transport::Link| loop {
        match t
            .cq()
            .wait(Some(Duration::from_secs(10)))
            .expect("an answer")
        {
            Completion::Message { link: l, data } if l == link.id() => {
                return Msg::decode(&data).unwrap();
            }
            _ => {}
        }
    };
    let hello = |proof: Vec<u8>| Msg::Hello {
        role: Role::Worker,
        rank: None,
        proof,
        addr: String::new(),
        tensors: tensors(),
    };
    // A hello without a challenge is refused.
    let l = t.connect(&addr).unwrap();
    l.send(&hello(vec![0; 32]).encode()).unwrap();
    assert!(matches!(next(&l), Msg::Refused { reason } if reason.contains("challenge")));
    // The right token, but the answer to another link's challenge (a replay), is refused.
    let first = t.connect(&addr).unwrap();
    first.send(&Msg::Knock.encode()).unwrap();
    let Msg::Challenge { nonce: n1 } = next(&first) else {
        panic!("expected a challenge")
    };
    let second = t.connect(&addr).unwrap();
    second.send(&Msg::Knock.encode()).unwrap();
    let Msg::Challenge { nonce: n2 } = next(&second) else {
        panic!("expected a challenge")
    };
    assert_ne!(n1, n2, "every link gets its own nonce");
    second
        .send(&hello(auth::answer("secret", Purpose::Hello, &n1)).encode())
        .unwrap();
    assert!(matches!(next(&second), Msg::Refused { .. }));
    // The answer to its own challenge is admitted (the job then starts without a server, so
    // the scheduler's rendezvous just keeps waiting; stop it by dropping the links).
    first
        .send(&hello(auth::answer("secret", Purpose::Hello, &n1)).encode())
        .unwrap();
    drop((l, first, second, t));
    drop(s);
}

/// `JobConfig::scheduler` as plain `IP:PORT` and `HOST:PORT` (a host name that resolves):
/// a server and a worker reach the scheduler by tcp and the job runs.
#[test]
fn the_scheduler_may_be_given_as_host_and_port() {
    let mut c = cfg(1, 1, PolicySpec::Bsp);
    c.optimizer = Optimizer::Sgd { lr: 0.5 };
    let sched = falcon_engine::Scheduler::bind(c.clone()).unwrap();
    let tcp = falcon_engine::launch::scheduler_address(&sched.address())
        .unwrap()
        .tcp
        .expect("the scheduler listens on tcp");
    assert!(tcp.ip().is_loopback(), "{tcp}");
    let s = std::thread::spawn(move || sched.run());
    let mut server_cfg = c.clone();
    server_cfg.scheduler = format!("127.0.0.1:{}", tcp.port());
    let server = std::thread::spawn(move || {
        falcon_engine::Server::join(server_cfg, None, Default::default())?.run()
    });
    c.scheduler = format!("localhost:{}", tcp.port());
    let w = Worker::join(&c, vec![TensorSpec::new("w", 4)], None).unwrap();
    let mut v = vec![0f32; 4];
    w.pull_slice("w", &mut v, 0).unwrap();
    assert_eq!(v, [0.0; 4]);
    w.push_slice("w", &[-1.0, -2.0, -3.0, -4.0], 0).unwrap();
    w.pull_slice("w", &mut v, 1).unwrap();
    assert_eq!(v, [0.5, 1.0, 1.5, 2.0]);
    w.finish().unwrap();
    server.join().unwrap().unwrap();
    s.join().unwrap().unwrap();
    // Neither an address nor the transport's text form: a typed error naming it.
    c.scheduler = "nowhere".into();
    let e = Worker::join(&c, tensors(), None).err().expect("refused");
    assert!(matches!(e, Error::Config(_)), "{e}");
    assert!(
        e.to_string().contains("scheduler address nowhere: no port"),
        "{e}"
    );
}

/// 16-bit values on the wire: a pull gives the servers' f32 values rounded, the servers apply
/// the rounded gradient to f32 weights, and initial values arrive exact — bit for bit the
/// reference arithmetic, over both media and both 16-bit formats.
#[test]
fn bf16_and_f16_on_the_wire_are_exactly_the_rounded_arithmetic() {
    use falcon_engine::precision::Wire;
    use falcon_transport::Medium;
    let lr = 0.5f32;
    let round = |w: Wire, v: &[f32]| w.decoded(&w.encoded(v));
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let init: Vec<f32> = (0..1000)
        .map(|i| 1.0 + (i as f32 * 0.37).sin() / 3.0)
        .collect();
    for medium in [Medium::Tcp, Medium::Shm] {
        for wire in [Wire::Bf16, Wire::F16] {
            let mut c = cfg(2, 1, PolicySpec::Bsp);
            c.optimizer = Optimizer::Sgd { lr };
            c.wire = wire;
            c.transport.medium = medium;
            let cluster = LocalCluster::start(c, tensors()).unwrap();
            let worker = cluster.workers[0].clone();
            let buf = worker.buffer("w").unwrap();
            buf.write_at(0, falcon_engine::worker::f32_bytes(&init))
                .unwrap();
            worker.init("w", &buf).unwrap();
            worker.barrier().unwrap();
            let mut master = init.clone();
            let mut p = vec![0f32; 1000];
            for t in 0..4u64 {
                worker.pull_slice("w", &mut p, t).unwrap();
                assert_eq!(
                    bits(&p),
                    bits(&round(wire, &master)),
                    "{wire:?} over {medium:?}: pull {t} is the f32 values rounded"
                );
                assert!(t > 0 || p != init, "{wire:?}: the values do travel rounded");
                let g: Vec<f32> = p.iter().map(|x| (x - 0.25) * 1.001).collect();
                worker.push_slice("w", &g, t).unwrap();
                worker.push_slice("b", &[0.0; 10], t).unwrap();
                for (m, gi) in master.iter_mut().zip(round(wire, &g)) {
                    *m -= lr * gi;
                }
            }
            worker.pull_slice("w", &mut p, 4).unwrap();
            assert_eq!(
                bits(&p),
                bits(&round(wire, &master)),
                "{wire:?} over {medium:?}"
            );
            cluster.finish().unwrap();
        }
    }
}

/// A tensor with its own 16-bit precision (a bfloat16 or float16 parameter's) travels as 16
/// bits in a job whose wire is f32, and exactly: two workers' gradients that are 16-bit
/// numbers arrive whole, the servers average them in f32 and the mean comes back rounded once
/// to the tensor's type (a float16 tensor's infinity stays infinite); the job's other tensors
/// stay f32, bit for bit.
#[test]
fn a_tensors_own_16_bit_precision_travels_exactly_beside_f32_tensors() {
    use falcon_engine::precision::Wire;
    use falcon_transport::Medium;
    let round = |w: Wire, v: &[f32]| w.decoded(&w.encoded(v));
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for medium in [Medium::Tcp, Medium::Shm] {
        for own in [Wire::Bf16, Wire::F16Native] {
            let mut c = cfg(2, 2, PolicySpec::Bsp);
            c.optimizer = Optimizer::Sgd { lr: 1.0 };
            c.transport.medium = medium;
            let specs = vec![
                TensorSpec {
                    wire: Some(own),
                    ..TensorSpec::new("h", 3000)
                },
                TensorSpec::new("f", 3000),
            ];
            let cluster = LocalCluster::start(c, specs).unwrap();
            let zeros = vec![0f32; 3000];
            // Gradients of 16-bit numbers; worker 1 sends an infinity in the last value.
            let grads: Vec<Vec<f32>> = (0..2u32)
                .map(|w| {
                    let g: Vec<f32> = (0..3000)
                        .map(|i| ((i as f32 + 1.0) * 0.173 + w as f32).sin() * 3.0)
                        .collect();
                    round(own, &g)
                })
                .map(|mut g| {
                    if own == Wire::F16Native {
                        g[2999] = 7e4; // over float16's range: its infinity
                    }
                    g
                })
                .collect();
            let f32_grads: Vec<Vec<f32>> = (0..2u32)
                .map(|w| {
                    (0..3000)
                        .map(|i| (i as f32 * 0.01 + w as f32).cos() / 3.0)
                        .collect()
                })
                .collect();
            std::thread::scope(|sc| {
                for (w, worker) in cluster.workers.iter().enumerate() {
                    let (g, f) = (&grads[w], &f32_grads[w]);
                    let zeros = &zeros;
                    sc.spawn(move || {
                        if w == 0 {
                            for t in ["h", "f"] {
                                let buf = worker.buffer(t).unwrap();
                                buf.write_at(0, falcon_engine::worker::f32_bytes(zeros))
                                    .unwrap();
                                worker.init(t, &buf).unwrap();
                            }
                        }
                        worker.barrier().unwrap();
                        worker.push_slice("h", g, 0).unwrap();
                        worker.push_slice("f", f, 0).unwrap();
                    });
                }
            });
            let worker = &cluster.workers[0];
            let (mut h, mut f) = (vec![0f32; 3000], vec![0f32; 3000]);
            worker.pull_slice("h", &mut h, 1).unwrap();
            worker.pull_slice("f", &mut f, 1).unwrap();
            // SGD at rate 1 from zeros: minus the mean of the two gradients (in f32), which a
            // 16-bit tensor's pull rounds once to its type.
            let mean = |a: &[f32], b: &[f32]| -> Vec<f32> {
                a.iter().zip(b).map(|(x, y)| 0.0 - (x + y) / 2.0).collect()
            };
            let widened: Vec<Vec<f32>> = grads.iter().map(|g| round(own, g)).collect();
            let want_h = round(own, &mean(&widened[0], &widened[1]));
            assert_eq!(
                bits(&h[..2999]),
                bits(&want_h[..2999]),
                "{own:?} over {medium:?}"
            );
            if own == Wire::F16Native {
                assert_eq!(h[2999], f32::NEG_INFINITY, "an overflow stays infinite");
            }
            assert_eq!(
                bits(&f),
                bits(&mean(&f32_grads[0], &f32_grads[1])),
                "f32 beside it"
            );
            cluster.finish().unwrap();
        }
    }
}

/// Over shm a large f32 gradient is not copied into the slot: the server reads it where the
/// worker holds it, under a synchronous step (copied out) and an asynchronous one (applied
/// where it lies), in a push-pull too; every push counts exactly once. Small shards, 16-bit
/// gradients, tcp and a worker with `shm_in_place` off keep the slot. The shards are large
/// enough for their applies to be shared with helper threads (two parts each).
#[test]
fn large_gradients_over_shm_are_read_in_the_workers_memory() {
    use falcon_engine::precision::Wire;
    use falcon_transport::Medium;
    const N: u64 = 8;
    const LEN: u64 = 1 << 18; // 1 MiB: two shards of 512 KiB, one a server
    // (medium, wire, policy, push_pull, JobConfig::shm_in_place, read in place)
    let cases = [
        (Medium::Shm, Wire::F32, PolicySpec::Bsp, false, true, true),
        (Medium::Shm, Wire::F32, PolicySpec::Asp, false, true, true),
        (Medium::Shm, Wire::F32, PolicySpec::Asp, true, true, true),
        (Medium::Shm, Wire::F32, PolicySpec::Bsp, true, true, true),
        (Medium::Shm, Wire::F32, PolicySpec::Asp, false, false, false),
        (Medium::Shm, Wire::Bf16, PolicySpec::Bsp, false, true, false),
        (Medium::Tcp, Wire::F32, PolicySpec::Bsp, false, true, false),
    ];
    for (medium, wire, policy, push_pull, allowed, in_place) in cases {
        let what = format!(
            "{policy:?} over {medium:?}, {wire:?}, push_pull {push_pull}, allowed {allowed}"
        );
        let mut c = cfg(2, 2, policy);
        c.shm_in_place = allowed;
        c.optimizer = Optimizer::Sgd { lr: 1.0 };
        c.aggregate = Aggregate::Sum;
        c.wire = wire;
        c.transport.medium = medium;
        c.max_shard_bytes = 512 << 10;
        c.helper_threads = Some(2);
        let specs = vec![TensorSpec::new("w", LEN), TensorSpec::new("b", 10)];
        let cluster = LocalCluster::start(c, specs).unwrap();
        let threads: Vec<_> = cluster
            .workers
            .iter()
            .cloned()
            .map(|worker| {
                std::thread::spawn(move || {
                    let out = worker.buffer("w").unwrap();
                    let grad = worker.buffer("w").unwrap();
                    // Whole numbers, exact in bf16 too: -(rank + 1) + i % 3.
                    let g: Vec<f32> = (0..LEN)
                        .map(|i| (i % 3) as f32 - (worker.rank() + 1) as f32)
                        .collect();
                    grad.write_at(0, falcon_engine::worker::f32_bytes(&g))
                        .unwrap();
                    if push_pull {
                        worker.pull("w", &out, 0).unwrap();
                    }
                    for t in 0..N {
                        if push_pull {
                            worker.push_pull("w", &grad, &out, t).unwrap();
                        } else {
                            worker.pull("w", &out, t).unwrap();
                            worker.push("w", &grad, t).unwrap();
                        }
                        worker.push_slice("b", &[1.0; 10], t).unwrap();
                    }
                    worker.stats()
                })
            })
            .collect();
        let stats: Vec<_> = threads.into_iter().map(|h| h.join().unwrap()).collect();
        let keymap = cluster.workers[0].keymap().clone();
        let shards_w = keymap.shards_of(0).count() as u64;
        assert_eq!(shards_w, 2, "{what}");
        let report = cluster.finish().unwrap();
        let w = report.tensor(&keymap, "w").unwrap();
        for (i, &x) in w.iter().enumerate() {
            // Σ over ranks 1, 2 of (rank − i % 3), N times, subtracted (lr 1).
            let want = N as f32 * (3.0 - 2.0 * (i % 3) as f32);
            assert_eq!(x, want, "{what}: w[{i}]");
        }
        let b = report.tensor(&keymap, "b").unwrap();
        assert!(b.iter().all(|&x| x == -2.0 * N as f32), "{what}: {b:?}");
        for st in &stats {
            // Every push of w read in place, none of b (10 floats: below the bound).
            let want = if in_place { N * shards_w } else { 0 };
            assert_eq!(st.pushes_in_place, want, "{what}");
        }
    }
}

/// A worker pushing from a fresh region every step does not pile up grants on its links: past
/// 16 regions a link its pushes go into the slot, and every one is applied.
#[test]
fn pushes_from_fresh_regions_stop_being_read_in_place_past_the_bound() {
    use falcon_transport::Medium;
    const N: u64 = 24;
    let mut c = cfg(1, 1, PolicySpec::Asp);
    c.optimizer = Optimizer::Sgd { lr: 1.0 };
    c.transport.medium = Medium::Shm;
    c.max_shard_bytes = 1 << 20;
    let specs = vec![TensorSpec::new("w", 1 << 15)]; // 128 KiB: one shard
    let cluster = LocalCluster::start(c, specs).unwrap();
    let worker = cluster.workers[0].clone();
    for t in 0..N {
        let grad = worker.buffer("w").unwrap();
        grad.write_at(0, falcon_engine::worker::f32_bytes(&vec![-1.0; 1 << 15]))
            .unwrap();
        worker.push("w", &grad, t).unwrap();
    }
    let st = worker.stats();
    assert_eq!(st.pushes, N);
    assert_eq!(st.pushes_in_place, 16, "{st:?}");
    let keymap = worker.keymap().clone();
    let report = cluster.finish().unwrap();
    let w = report.tensor(&keymap, "w").unwrap();
    assert!(w.iter().all(|&x| x == N as f32), "{:?}", &w[..4]);
}

/// A worker that names memory it does not hold for a push read in place (another node's key,
/// a region it never granted, a range past its region) has that push refused: nothing of it
/// is applied, the worker gets a typed error, and the server goes on serving the others.
#[test]
fn a_push_naming_memory_the_worker_does_not_hold_is_refused() {
    use falcon_engine::worker::ForgeSource;
    use falcon_transport::{Medium, RemoteKey};
    use std::sync::Arc;
    const LEN: u64 = 1 << 15; // 128 KiB: one shard, read in place
    let forgeries: [(&str, ForgeSource); 3] = [
        (
            "another node's key",
            Arc::new(|k: &mut RemoteKey, _: &mut u64| k.owner ^= 1),
        ),
        (
            "a region never granted",
            Arc::new(|k: &mut RemoteKey, _: &mut u64| k.region += 1000),
        ),
        (
            "a range past the region",
            Arc::new(|_: &mut RemoteKey, off: &mut u64| *off += 4),
        ),
    ];
    for (what, forge) in forgeries {
        let mut c = cfg(1, 2, PolicySpec::Asp);
        c.optimizer = Optimizer::Sgd { lr: 1.0 };
        c.transport.medium = Medium::Shm;
        c.transport.op_timeout = Duration::from_secs(2);
        c.max_shard_bytes = 1 << 20;
        let specs = vec![TensorSpec::new("w", LEN)];
        let cluster = LocalCluster::start(c, specs).unwrap();
        let liar = cluster.workers[0].clone();
        let honest = cluster.workers[1].clone();
        let ones = vec![-1.0f32; LEN as usize];
        let grad = liar.buffer("w").unwrap();
        grad.write_at(0, falcon_engine::worker::f32_bytes(&ones))
            .unwrap();
        liar.forge_in_place_sources(forge);
        let err = liar.push("w", &grad, 0).unwrap_err();
        assert!(matches!(err, Error::Timeout(..)), "{what}: {err}");
        assert_eq!(liar.stats().pushes_in_place, 1, "{what}");
        // The honest worker's pushes, read in place too, are all that is applied.
        for t in 0..3 {
            honest.push_slice("w", &ones, t).unwrap();
        }
        assert_eq!(honest.stats().pushes_in_place, 3, "{what}");
        let mut p = vec![0f32; LEN as usize];
        honest.pull_slice("w", &mut p, 3).unwrap();
        assert!(p.iter().all(|&x| x == 3.0), "{what}: {:?}", &p[..4]);
        drop(liar);
        let _ = cluster.finish();
    }
}

const ROWS: u64 = 500;
const DIM: u64 = 2;
const BATCH: usize = 16;

/// A training example of the row-sparse test: five feature ids hashed into rows
/// (collisions included), a value each, and the label the `truth` weights give.
fn example(truth: &[f32], rank: u32, step: u64, i: usize) -> (Vec<u64>, Vec<f32>, f32) {
    let mut r = fastrand::Rng::with_seed(u64::from(rank) * 1_000_003 + step * 101 + i as u64);
    let ids: Vec<u64> = (0..5).map(|_| r.u64(0..10_000)).collect();
    let rows: Vec<u64> = ids
        .iter()
        .map(|id| id.wrapping_mul(2_654_435_761) % ROWS)
        .collect();
    let vals: Vec<f32> = rows.iter().map(|_| r.f32()).collect();
    let score: f32 = rows
        .iter()
        .zip(&vals)
        .map(|(&f, v)| truth[(f * DIM) as usize] + truth[(f * DIM + 1) as usize] * v)
        .sum();
    (rows, vals, if score > 0.0 { 1.0 } else { 0.0 })
}

/// One worker's step: the rows its batch touches (in order, repeats kept) and their
/// gradients of the summed log-loss, given the weights `w(row, k)`.
fn step_grads(
    truth: &[f32],
    rank: u32,
    step: u64,
    w: &dyn Fn(u64, u64) -> f32,
) -> (Vec<u64>, Vec<f32>) {
    let (mut rows, mut grads) = (Vec::new(), Vec::new());
    for i in 0..BATCH {
        let (f, v, y) = example(truth, rank, step, i);
        let s: f32 = f.iter().zip(&v).map(|(&r, x)| w(r, 0) + w(r, 1) * x).sum();
        let p = 1.0 / (1.0 + (-s).exp());
        for (&r, x) in f.iter().zip(&v) {
            rows.push(r);
            grads.extend([p - y, (p - y) * x]);
        }
    }
    (rows, grads)
}

/// Row-sparse training: logistic regression on hashed features (each example names five
/// feature ids hashed into 500 rows of two weights, collisions included), two workers, two
/// servers with small shards (rows straddle them), BSP. Only the rows an example touches
/// travel; the servers sum duplicate rows. The run is bit for bit a dense single-process
/// reference, and it learns.
#[test]
fn row_sparse_logistic_regression_is_exactly_the_dense_reference() {
    const STEPS: u64 = 60;
    let lr = 0.5f32;
    let mut c = cfg(2, 2, PolicySpec::Bsp);
    c.optimizer = Optimizer::Sgd { lr };
    c.aggregate = Aggregate::Mean;
    c.max_shard_bytes = 1000; // 250 floats: shards cut rows
    let table = vec![TensorSpec::new("emb", ROWS * DIM)];
    let truth: std::sync::Arc<Vec<f32>> = {
        let mut r = fastrand::Rng::with_seed(11);
        std::sync::Arc::new((0..ROWS * DIM).map(|_| r.f32() * 2.0 - 1.0).collect())
    };
    let cluster = LocalCluster::start(c, table).unwrap();
    let threads: Vec<_> = cluster
        .workers
        .iter()
        .cloned()
        .map(|worker: Worker| {
            let truth = truth.clone();
            std::thread::spawn(move || {
                worker.barrier().unwrap();
                for t in 0..STEPS {
                    // The rows this step touches, pulled at clock t.
                    let (rows, _) = step_grads(&truth, worker.rank(), t, &|_, _| 0.0);
                    let mut uniq = rows.clone();
                    uniq.sort();
                    uniq.dedup();
                    let mut vals = vec![0f32; uniq.len() * DIM as usize];
                    worker.pull_rows("emb", DIM, &uniq, &mut vals, t).unwrap();
                    let at = |r: u64, k: u64| {
                        let i = uniq.binary_search(&r).unwrap();
                        vals[i * DIM as usize + k as usize]
                    };
                    let (rows, grads) = step_grads(&truth, worker.rank(), t, &at);
                    worker.push_rows("emb", DIM, &rows, &grads, t).unwrap();
                }
                let all: Vec<u64> = (0..ROWS).collect();
                let mut w = vec![0f32; (ROWS * DIM) as usize];
                worker.pull_rows("emb", DIM, &all, &mut w, STEPS).unwrap();
                worker.finish().unwrap();
                w
            })
        })
        .collect();
    let got: Vec<Vec<f32>> = threads.into_iter().map(|h| h.join().unwrap()).collect();
    cluster.finish().unwrap();
    // The reference: dense gradients (duplicates summed in order), the mean in rank order,
    // plain SGD.
    let mut w = vec![0f32; (ROWS * DIM) as usize];
    for t in 0..STEPS {
        let snapshot = w.clone();
        let at = |r: u64, k: u64| snapshot[(r * DIM + k) as usize];
        let dense: Vec<Vec<f32>> = (0..2)
            .map(|rank| {
                let (rows, grads) = step_grads(&truth, rank, t, &at);
                let mut g = vec![0f32; w.len()];
                for (i, &r) in rows.iter().enumerate() {
                    for k in 0..DIM as usize {
                        g[(r * DIM) as usize + k] += grads[i * DIM as usize + k];
                    }
                }
                g
            })
            .collect();
        for (i, wi) in w.iter_mut().enumerate() {
            let g = (dense[0][i] + dense[1][i]) * 0.5;
            *wi -= lr * g;
        }
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for g in &got {
        assert_eq!(bits(g), bits(&w), "bit for bit the dense reference");
    }
    // And it learnt: accuracy on fresh examples well above chance.
    let at = |r: u64, k: u64| w[(r * DIM + k) as usize];
    let mut right = 0;
    for i in 0..400 {
        let (f, v, y) = example(&truth, 9, 9, i);
        let s: f32 = f
            .iter()
            .zip(&v)
            .map(|(&r, x)| at(r, 0) + at(r, 1) * x)
            .sum();
        right += usize::from((s > 0.0) == (y > 0.5));
    }
    assert!(right > 280, "accuracy {right}/400");
}

/// Row pushes are refused with what is wrong: a row out of the table, a width that does not
/// divide the tensor, values of the wrong length, an optimizer that moves rows without a
/// gradient; so is a row pull whose answer could not be one message.
#[test]
fn row_pushes_refuse_bad_rows_and_optimizers_that_move_untouched_rows() {
    let mut c = cfg(1, 1, PolicySpec::Asp);
    c.optimizer = Optimizer::Sgd { lr: 0.1 };
    let cluster = LocalCluster::start(c, tensors()).unwrap();
    let w = &cluster.workers[0];
    let e = w.push_rows("w", 10, &[100], &[0.0; 10], 0).unwrap_err();
    assert!(
        e.to_string()
            .contains("row 100 of tensor \"w\": it has 100 rows of 10"),
        "{e}"
    );
    let e = w.push_rows("w", 7, &[1], &[0.0; 7], 0).unwrap_err();
    assert!(
        e.to_string()
            .contains("the row width must divide its length"),
        "{e}"
    );
    assert!(matches!(
        w.push_rows("w", 10, &[1, 2], &[0.0; 10], 0),
        Err(Error::WrongLength {
            expected: 20,
            got: 10,
            ..
        })
    ));
    assert!(matches!(
        w.push_rows("nope", 10, &[1], &[0.0; 10], 0),
        Err(Error::UnknownTensor(_))
    ));
    let mut out = [0f32; 10];
    assert!(w.pull_rows("w", 10, &[1000], &mut out, 0).is_err());
    // Nothing was pushed: the clock is still 0, and a good push goes through.
    w.push_rows("w", 10, &[3, 3], &[1.0; 20], 0).unwrap();
    w.pull_rows("w", 10, &[3], &mut out, 0).unwrap();
    cluster.finish().unwrap();
    let mut c = cfg(1, 1, PolicySpec::Asp);
    c.optimizer = Optimizer::Momentum { lr: 0.1, mu: 0.9 };
    let cluster = LocalCluster::start(c, tensors()).unwrap();
    let e = cluster.workers[0]
        .push_rows("w", 10, &[1], &[0.0; 10], 0)
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("(sgd or adagrad); this job's is momentum"),
        "{e}"
    );
    cluster.finish().unwrap();
    // A pull whose repeated rows would make an answer larger than one message may be is
    // refused by the server, which goes on serving.
    let mut c = cfg(1, 1, PolicySpec::Asp);
    c.optimizer = Optimizer::Sgd { lr: 0.1 };
    c.transport.max_message = 1 << 20;
    let cluster = LocalCluster::start(c, tensors()).unwrap();
    let w = &cluster.workers[0];
    let many = vec![3u64; 30_000];
    let mut out = vec![0f32; 300_000];
    let e = w.pull_rows("w", 10, &many, &mut out, 0).unwrap_err();
    assert!(
        e.to_string()
            .contains("a row pull of 300000 floats from shard 0: an answer holds at most 262144"),
        "{e}"
    );
    w.pull_rows("w", 10, &many[..100], &mut out[..1000], 0)
        .unwrap();
    cluster.finish().unwrap();
}

/// A worker keeps the last row request's split and indexes per tensor and reuses them for a
/// request of the same rows: a push of the rows just pulled lands where it should, and a
/// request of other rows (one row changed, or the same rows at another width) is split anew.
#[test]
fn row_requests_of_the_same_rows_reuse_their_plan_and_others_do_not() {
    let mut c = cfg(2, 1, PolicySpec::Asp);
    c.optimizer = Optimizer::Sgd { lr: 1.0 };
    c.max_shard_bytes = 400; // 100 floats: ten shards over two servers
    let cluster = LocalCluster::start(c, tensors()).unwrap();
    let w = &cluster.workers[0];
    // The reference: every float starts at 0; a push of g at float i makes it −g.
    let mut want = vec![0f32; 1000];
    let mut push = |clock: u64, dim: u64, rows: &[u64], grads: &[f32]| {
        w.push_rows("w", dim, rows, grads, clock).unwrap();
        for (i, &r) in rows.iter().enumerate() {
            for k in 0..dim as usize {
                want[r as usize * dim as usize + k] -= grads[i * dim as usize + k];
            }
        }
    };
    let grads = |n: usize, base: f32| (0..n).map(|i| base + i as f32).collect::<Vec<f32>>();
    let rows: Vec<u64> = vec![1, 7, 8, 30, 64, 99];
    let mut out = vec![0f32; 60];
    w.pull_rows("w", 10, &rows, &mut out, 0).unwrap();
    // The same rows: the plan is reused.
    push(0, 10, &rows, &grads(60, 1.0));
    // A wrong length is refused even where the plan is reused.
    assert!(matches!(
        w.pull_rows("w", 10, &rows, &mut out[..50], 1),
        Err(Error::WrongLength {
            expected: 60,
            got: 50,
            ..
        })
    ));
    // One row changed, the same length: a new plan.
    let other: Vec<u64> = vec![1, 7, 9, 30, 64, 99];
    push(1, 10, &other, &grads(60, 100.0));
    // The same rows at another width: other floats altogether.
    push(2, 5, &rows, &grads(30, 1000.0));
    push(3, 5, &rows, &grads(30, 2000.0));
    let all: Vec<u64> = (0..100).collect();
    let mut got = vec![0f32; 1000];
    w.pull_rows("w", 10, &all, &mut got, 4).unwrap();
    assert_eq!(got, want);
    // And the rows pulled once more by the cached plan read the same values.
    w.pull_rows("w", 10, &rows, &mut out, 4).unwrap();
    let expect: Vec<f32> = rows
        .iter()
        .flat_map(|&r| want[r as usize * 10..][..10].to_vec())
        .collect();
    assert_eq!(out, expect);
    cluster.finish().unwrap();
}
