//! Real network faults between hosts, on one machine: every host a network namespace on a
//! bridge (see `common/netns.rs`), every role a real `falcon role` process inside its host,
//! started from ps-lite's variables with its host's address.
//!
//! 1. A BSP job over three hosts, with 2 ms ± 1 ms latency and 0.5 % loss (or what of it the
//!    kernel can emulate; the rest is said on a `SKIPPED:` line), ends with the exact result.
//! 2. A worker host cut off longer than the suspicion timeout is evicted; once the partition
//!    heals the worker rejoins under its rank at the current clock; the result is exact.
//!    The evicted process may rejoin by itself, or end with an error saying it was evicted
//!    (see `told_why`) and be started again under its rank, as a launcher restarting a
//!    failed process would; an error that does not say why fails the test.
//! 3. A server host cut off longer than the suspicion timeout is fenced and comes back from
//!    its checkpoint (never two servers for one rank); the result is exact, the updates the
//!    checkpoint lost accounted for. The fenced process may come back by itself, or end and
//!    be started again under its rank on its host (only once it has ended).
//!
//! Every test runs the `count` workload (every gradient −1, step 0.125: the parameters count
//! what was applied) and checks every shard's account on the servers' reports.
//! Tests 2 and 3 pace the job with a bandwidth cap toward the workers' hosts, so the job is
//! still running when the cut-off host comes back, however loaded the machine is.
//!
//! Without root or iproute2 (or where namespaces cannot be made) each test prints a line
//! starting with `SKIPPED:` and passes. `FALCON_NETNS=0` skips them the same way (the
//! workspace stage of `tools/test.sh` sets it: they run in a stage of their own).
//! Figures are printed on lines starting with `netns:`.

mod common;
#[path = "common/netns.rs"]
mod netns;

use std::time::{Duration, Instant};

use common::{Job, first_parameter, number_after};
use netns::{Cluster, Net, say, serial, skip};

/// The hosts, or `None` after saying why not.
fn hosts(test: &str, labels: &[&str]) -> Option<Net> {
    if std::env::var("FALCON_NETNS").as_deref() == Ok("0") {
        skip(
            test,
            "FALCON_NETNS=0 (the network-namespace tests run in a stage of their own)",
        );
        return None;
    }
    match Net::new(labels) {
        Ok(net) => Some(net),
        Err(why) => {
            skip(test, &format!("no hosts of network namespaces here: {why}"));
            None
        }
    }
}

/// One shard's account, from a server's report.
#[derive(Debug)]
struct Account {
    line: String,
    /// Its first parameter over the step (0.125): gradients applied, or steps under BSP.
    counted: f64,
    /// Sequence numbers applied or passed over (all workers).
    seqs: u64,
    skipped: u64,
}

fn accounts(server: &str) -> Vec<Account> {
    server
        .lines()
        .filter(|l| l.contains(" first parameter "))
        .map(|l| {
            let first = first_parameter(l);
            Account {
                line: l.to_string(),
                counted: first / 0.125,
                seqs: number_after(l, "sequence numbers").unwrap(),
                skipped: number_after(l, "applied +").unwrap(),
            }
        })
        .collect()
}

/// The gradients a server's report says it applied.
fn gradients(server: &str, rank: u32) -> u64 {
    number_after(server, &format!("server {rank}:")).expect("the server's summary")
}

/// The count workload under BSP: every gradient is −1, a step applies the mean of its
/// gradients with step 0.125, so each shard's first parameter is 0.125 × the steps applied:
/// exactly `iters`, whoever was evicted or rejoined (a step applies with the live workers).
/// Every sequence number of every worker is applied once or passed over once; the server
/// received the applied ones. Returns the sequence numbers passed over.
fn check_bsp(server: &str, rank: u32, workers: u64, iters: u64) -> Result<u64, String> {
    let acc = accounts(server);
    if acc.is_empty() {
        return Err(format!("server {rank} reports no shards"));
    }
    let mut applied = 0;
    let mut skipped = 0;
    for a in &acc {
        if a.counted != iters as f64 {
            return Err(format!(
                "{iters} steps expected, the values count {}: {}",
                a.counted, a.line
            ));
        }
        if a.seqs != workers * iters {
            return Err(format!(
                "{} sequence numbers expected: {}",
                workers * iters,
                a.line
            ));
        }
        applied += a.seqs - a.skipped;
        skipped += a.skipped;
    }
    let g = gradients(server, rank);
    if g != applied {
        return Err(format!(
            "server {rank} received {g} gradients; its shards account for {applied}"
        ));
    }
    Ok(skipped)
}

/// The count workload under an asynchronous policy: each gradient applied on its own adds
/// 0.125, so the values count the gradients applied, which must be the sequence numbers not
/// passed over (no more: none applied twice; no fewer). Returns those passed over.
fn check_async(server: &str, rank: u32, workers: u64, iters: u64) -> Result<u64, String> {
    let acc = accounts(server);
    if acc.is_empty() {
        return Err(format!("server {rank} reports no shards"));
    }
    let mut skipped = 0;
    for a in &acc {
        if a.counted != (a.seqs - a.skipped) as f64 {
            return Err(format!(
                "the values count {} gradients, the sequence numbers {}: {}",
                a.counted,
                a.seqs - a.skipped,
                a.line
            ));
        }
        if a.seqs != workers * iters {
            return Err(format!(
                "{} sequence numbers expected: {}",
                workers * iters,
                a.line
            ));
        }
        skipped += a.skipped;
    }
    Ok(skipped)
}

/// The updates a restarted server says its checkpoint lost (0 if it did not restart).
fn lost_updates(server: &str) -> u64 {
    server
        .lines()
        .find(|l| l.contains("acknowledged updates lost"))
        .and_then(|l| l.rsplit("; ").next()?.split(' ').next()?.parse().ok())
        .unwrap_or(0)
}

/// Worker 0's last reported iteration (it reports every 25).
fn progress(c: &Cluster, w0: usize) -> Option<u64> {
    c.procs[w0]
        .last_with("worker 0 iteration")
        .and_then(|l| number_after(&l, "iteration"))
}

fn wait_progress(c: &mut Cluster, w0: usize, at_least: u64, limit: Duration) {
    let end = Instant::now() + limit;
    while progress(c, w0).is_none_or(|p| p < at_least) {
        if Instant::now() > end || c.procs[w0].exited().is_some() {
            c.fail(&format!("worker 0 did not reach iteration {at_least}"));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Does an evicted role's output say so? Any of: "evict", "fence", "declared dead",
/// "declared it dead", "declared this", "suspected" (case aside). Today's engine says only
/// "scheduler 0 is gone: link closed".
fn told_why(stderr: &str) -> bool {
    let e = stderr.to_lowercase();
    [
        "evict",
        "fence",
        "declared dead",
        "declared it dead",
        "declared this",
        "suspected",
    ]
    .iter()
    .any(|k| e.contains(k))
}

fn last_lines(text: &str, n: usize) -> String {
    let v: Vec<&str> = text.lines().collect();
    v[v.len().saturating_sub(n)..].join("\n")
}

#[test]
fn a_bsp_job_over_three_hosts_with_latency_and_loss_is_exact() {
    let _one = serial();
    let test = "netns bsp over three hosts";
    let Some(mut net) = hosts(test, &["a", "b", "c"]) else {
        return;
    };
    let imp = net.impair();
    for s in &imp.skipped {
        skip(test, s);
    }
    for a in &imp.applied {
        say(&format!("netns: {test}: {a}"));
    }
    let (workers, iters) = (4u64, 200u64);
    let job = Job::new(
        "netns-bsp",
        1,
        workers as u32,
        &[
            ("FALCON_POLICY", "bsp"),
            ("FALCON_WORKLOAD", "count"),
            ("FALCON_ITERS", &iters.to_string()),
            ("FALCON_FLOATS", "4096"),
            ("FALCON_MAX_SHARD_BYTES", "4096"),
            // Loss stalls a link for a retransmission now and then: no one is suspected here.
            ("FALCON_SUSPICION_MS", "5000"),
        ],
    );
    let mut c = Cluster::new(net, job);
    let (a, b, hc) = (0, 1, 2);
    let sched = c.start("scheduler", None, a);
    let server = c.start("server", Some(0), a);
    let ws: Vec<usize> = (0..workers as u32)
        .map(|r| c.start("worker", Some(r), if r < 2 { b } else { hc }))
        .collect();
    for &w in &ws {
        c.succeeds(w, Duration::from_secs(60));
    }
    let secs = c.t0.elapsed().as_secs_f64();
    c.succeeds(server, Duration::from_secs(20));
    c.succeeds(sched, Duration::from_secs(20));
    let out = c.procs[server].stdout();
    let skipped = check_bsp(&out, 0, workers, iters).unwrap_or_else(|e| c.fail(&e));
    assert_eq!(skipped, 0, "nobody left, nothing passed over:\n{out}");
    let reconnects: u64 = ws
        .iter()
        .filter_map(|&w| number_after(&c.procs[w].stdout(), "reconnects "))
        .sum();
    let dups = number_after(&out, "dropped gradients, ").unwrap_or(0);
    let retrans: Vec<String> = (0..3)
        .map(|h| format!("{} {}", c.net.hosts[h].label, c.net.retransmits(h)))
        .collect();
    say(&format!(
        "netns: {test}: {workers} workers × {iters} iterations finished in {secs:.2} s, exact \
         ({iters} steps on every shard); {} frames dropped by the loss rule; TCP retransmissions \
         per host: {}; {reconnects} reconnects, {dups} duplicate pushes",
        c.net.loss_drops(),
        retrans.join(", ")
    ));
    if imp.nft_loss {
        assert!(c.net.loss_drops() > 0, "the loss rule dropped frames");
    }
}

#[test]
fn an_evicted_worker_host_rejoins_after_the_partition_heals() {
    let _one = serial();
    let test = "netns worker partition";
    let Some(mut net) = hosts(test, &["a", "b", "c"]) else {
        return;
    };
    let (a, b, hc) = (0, 1, 2);
    let cap = net.cap("10mbit", &[b, hc]);
    say(&format!(
        "netns: {test}: {cap}; partition: {}",
        net.partition_means()
    ));
    let (workers, iters) = (2u64, 600u64);
    let job = Job::new(
        "netns-evict",
        1,
        workers as u32,
        &[
            ("FALCON_POLICY", "bsp"),
            ("FALCON_WORKLOAD", "count"),
            ("FALCON_ITERS", &iters.to_string()),
            ("FALCON_FLOATS", "4096"),
            ("FALCON_MAX_SHARD_BYTES", "4096"),
            ("FALCON_HEARTBEAT_MS", "300"),
            ("FALCON_SUSPICION_MS", "1500"),
            ("FALCON_RECOVERY_TIMEOUT_MS", "20000"),
        ],
    );
    let mut c = Cluster::new(net, job);
    let sched = c.start("scheduler", None, a);
    let server = c.start("server", Some(0), a);
    let w0 = c.start("worker", Some(0), b);
    let mut w1 = c.start("worker", Some(1), hc);
    wait_progress(&mut c, w0, 50, Duration::from_secs(30));
    let cut_at = progress(&c, w0).unwrap();
    c.net.partition(hc);
    let cut = Instant::now();
    let Some(detected) = c.wait_any(
        sched,
        &["worker 1 silent for", "worker 1 evicted"],
        Duration::from_secs(10),
    ) else {
        c.fail("the scheduler did not declare the cut-off worker silent within 10 s");
    };
    std::thread::sleep(Duration::from_millis(500));
    let gone_before_heal = c.procs[w1].exited().is_some();
    let dropped = c.net.heal(hc);
    let healed = Instant::now();
    say(&format!(
        "netns: {test}: host c cut off at worker 0's iteration {cut_at}; the scheduler \
         declared worker 1 silent after {:.2} s (suspicion 1.5 s, heartbeats 0.3 s); healed \
         {:.2} s after the cut ({dropped})",
        (detected - cut).as_secs_f64(),
        (healed - cut).as_secs_f64()
    ));
    // The evicted worker either rejoins by itself, or ends saying it was evicted and is
    // started again under its rank (as a launcher restarting a failed process would).
    let end = Instant::now() + Duration::from_secs(45);
    let mut restarted = false;
    while c.procs[sched].exited().is_none() && Instant::now() < end {
        if let Some(s) = c.procs[w1].exited()
            && !s.success()
            && !restarted
        {
            let after = healed.elapsed().as_secs_f64();
            c.procs[w1].wait(Duration::from_secs(1));
            let err = c.procs[w1].stderr();
            say(&format!(
                "netns: {test}: the evicted worker 1 ended {} ({s}); its last words:\n{}",
                if gone_before_heal {
                    "during the partition".to_string()
                } else {
                    format!("{after:.2} s after the heal")
                },
                last_lines(&err, 4)
            ));
            if !told_why(&err) {
                c.fail("the evicted worker ended without being told it was evicted");
            }
            w1 = c.start("worker", Some(1), hc);
            restarted = true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for i in [w0, w1, server, sched] {
        c.succeeds(i, Duration::from_secs(30));
    }
    let secs = c.t0.elapsed().as_secs_f64();
    let Some(rejoined) = c.procs[sched].seen("worker 1 rejoined the job") else {
        c.fail("the scheduler never said worker 1 rejoined");
    };
    let out = c.procs[sched].stdout();
    let done = out
        .lines()
        .find(|l| l.contains("job done"))
        .unwrap_or_default()
        .to_string();
    if !done.contains("dead: [worker 1]; rejoined: [worker 1]") {
        c.fail(&format!(
            "the scheduler reports the eviction and the rejoin: {done}"
        ));
    }
    let sout = c.procs[server].stdout();
    let skipped = check_bsp(&sout, 0, workers, iters).unwrap_or_else(|e| c.fail(&e));
    if skipped == 0 {
        c.fail("worker 1 rejoined at the current clock: some of its clocks are passed over");
    }
    say(&format!(
        "netns: {test}: worker 1 {} and the scheduler admitted it {:.2} s after the heal; \
         job finished in {secs:.2} s, exact ({iters} steps on every shard); worker 1's \
         sequence numbers passed over (the clocks it missed, over all shards): {skipped}",
        if restarted {
            "was restarted under its rank"
        } else {
            "rejoined by itself"
        },
        rejoined.saturating_duration_since(healed).as_secs_f64()
    ));
}

#[test]
fn a_partitioned_server_host_is_fenced_and_recovers_from_its_checkpoint() {
    let _one = serial();
    let test = "netns server partition";
    let Some(mut net) = hosts(test, &["a", "s", "b", "c"]) else {
        return;
    };
    let (a, hs, b, hc) = (0, 1, 2, 3);
    let cap = net.cap("10mbit", &[b, hc]);
    say(&format!(
        "netns: {test}: {cap}; partition: {}",
        net.partition_means()
    ));
    let (workers, iters) = (2u64, 400u64);
    // SSP(2): each gradient is applied on its own, so the values of the restarted server's
    // shards count exactly the updates its checkpoint kept (under BSP a step that lost some
    // of its gradients still moves by one step: the count would be a bound, not exact).
    let job = Job::new(
        "netns-fence",
        2,
        workers as u32,
        &[
            ("FALCON_POLICY", "ssp(2)"),
            ("FALCON_WORKLOAD", "count"),
            ("FALCON_ITERS", &iters.to_string()),
            ("FALCON_FLOATS", "4096"),
            ("FALCON_MAX_SHARD_BYTES", "4096"),
            ("FALCON_HEARTBEAT_MS", "300"),
            ("FALCON_SUSPICION_MS", "1500"),
            ("FALCON_CHECKPOINT_MS", "100"),
            ("FALCON_RECOVERY_TIMEOUT_MS", "20000"),
        ],
    );
    let ckpt = job.dir.join("server-1.ckpt");
    let mut c = Cluster::new(net, job);
    let sched = c.start("scheduler", None, a);
    let s0 = c.start("server", Some(0), a);
    let mut s1 = c.start("server", Some(1), hs);
    let w0 = c.start("worker", Some(0), b);
    let w1 = c.start("worker", Some(1), hc);
    wait_progress(&mut c, w0, 50, Duration::from_secs(30));
    let until = Instant::now() + Duration::from_secs(10);
    while !ckpt.exists() {
        if Instant::now() > until {
            c.fail(&format!("no checkpoint at {}", ckpt.display()));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let cut_at = progress(&c, w0).unwrap();
    c.net.partition(hs);
    let cut = Instant::now();
    let Some(detected) = c.wait_any(
        sched,
        &["server 1 silent for", "server 1 evicted", "server 1 fenced"],
        Duration::from_secs(10),
    ) else {
        c.fail("the scheduler did not declare the cut-off server silent within 10 s");
    };
    std::thread::sleep(Duration::from_millis(500));
    let gone_before_heal = c.procs[s1].exited().is_some();
    let dropped = c.net.heal(hs);
    let healed = Instant::now();
    say(&format!(
        "netns: {test}: host s cut off at worker 0's iteration {cut_at}; the scheduler \
         declared server 1 silent after {:.2} s; healed {:.2} s after the cut ({dropped})",
        (detected - cut).as_secs_f64(),
        (healed - cut).as_secs_f64()
    ));
    // The fenced server ends (it is started again under its rank once it has: never two
    // processes for one rank), or comes back by itself.
    let end = Instant::now() + Duration::from_secs(45);
    let mut old_ended: Option<Instant> = None;
    while c.procs[sched].exited().is_none() && Instant::now() < end {
        if old_ended.is_none()
            && let Some(s) = c.procs[s1].exited()
            && !s.success()
        {
            old_ended = Some(Instant::now());
            let after = healed.elapsed().as_secs_f64();
            c.procs[s1].wait(Duration::from_secs(1));
            let err = c.procs[s1].stderr();
            say(&format!(
                "netns: {test}: the cut-off server 1 ended {} ({s}); its last words:\n{}",
                if gone_before_heal {
                    "during the partition".to_string()
                } else {
                    format!("{after:.2} s after the heal")
                },
                last_lines(&err, 4)
            ));
            s1 = c.start("server", Some(1), hs);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for i in [w0, w1, s0, s1, sched] {
        c.succeeds(i, Duration::from_secs(30));
    }
    let secs = c.t0.elapsed().as_secs_f64();
    let admitted = c.procs[sched].lines_with("server 1 rejoined the job");
    let Some(rejoined) = c.procs[sched].seen("server 1 rejoined the job") else {
        c.fail("the scheduler never said server 1 came back");
    };
    if admitted.len() != 1 {
        c.fail(&format!("server 1 admitted once: {admitted:?}"));
    }
    if let Some(t) = old_ended
        && rejoined < t
    {
        c.fail("a new server 1 was admitted while the old one still ran");
    }
    let out = c.procs[sched].stdout();
    let done = out
        .lines()
        .find(|l| l.contains("job done"))
        .unwrap_or_default()
        .to_string();
    if !done.contains("dead: [server 1]; rejoined: [server 1]") {
        c.fail(&format!(
            "the scheduler reports the fencing and the return: {done}"
        ));
    }
    if old_ended.is_none() && !c.procs[s1].stderr().contains("fenced by the scheduler") {
        c.fail("server 1 came back without saying it was fenced");
    }
    let (o0, o1) = (c.procs[s0].stdout(), c.procs[s1].stdout());
    let k0 = check_async(&o0, 0, workers, iters).unwrap_or_else(|e| c.fail(&e));
    let k1 = check_async(&o1, 1, workers, iters).unwrap_or_else(|e| c.fail(&e));
    let lost = lost_updates(&o1);
    if k0 != 0 || lost_updates(&o0) != 0 {
        c.fail("server 0 ran through: nothing lost, nothing passed over");
    }
    if k1 != lost {
        c.fail(&format!(
            "server 1's shards passed over {k1} sequence numbers; it says its checkpoint lost {lost}"
        ));
    }
    let from = o1
        .lines()
        .find(|l| l.contains("restarted from checkpoint"))
        .unwrap_or("server 1: no checkpoint line")
        .to_string();
    say(&format!(
        "netns: {test}: server 1 {} and was admitted again {:.2} s after the heal; job \
         finished in {secs:.2} s, exact (every gradient applied once or lost with the \
         checkpoint); {from}",
        if old_ended.is_some() {
            "was fenced, ended and was started again under its rank"
        } else {
            "came back by itself"
        },
        rejoined.saturating_duration_since(healed).as_secs_f64()
    ));
}
