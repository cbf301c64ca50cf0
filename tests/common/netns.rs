//! Hosts on one machine for the network-fault tests: a network namespace per host, each
//! joined by a veth pair to a bridge in a namespace of its own (the switch), one private
//! subnet; roles run inside their host's namespace (`ip netns exec NS falcon role`), their
//! output read line by line as it comes, with the time it came.
//!
//! The switch's port toward each host is where the network misbehaves:
//! - latency and loss: `tc netem` on every port where the kernel has it; where it does not,
//!   loss alone with an nftables rule on the bridge (`numgen random`), and a `SKIPPED:` line
//!   says the latency is not emulated;
//! - a bandwidth cap (to pace a job in wall-clock time): `tbf` on the ports, or netem's rate;
//! - a partition: an nftables table on the bridge dropping every frame from and to the
//!   host's port, as a failed switch port would (both directions, nothing told to either
//!   side); healing deletes the table. Without nft, the port is set down (and up to heal).
//!
//! Names are unique per test process and net (`fnt<pid>-<n>-…`); namespaces left by test
//! processes that no longer exist are removed when a net is made. Everything is removed in
//! `Drop`, and the roles are killed first.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::common::{FALCON, Job, number_after};

/// Writes a line to the test's stderr directly: the test harness does not capture it, so
/// skip notices and figures show in every run, `--nocapture` or not.
pub fn say(line: &str) {
    let mut e = std::io::stderr().lock();
    let _ = writeln!(e, "{line}");
    let _ = e.flush();
}

/// Says a test (or part of it) is skipped, and why, on a line of its own starting with
/// `SKIPPED:` (after a line break: the harness may be mid-line when tests run in parallel).
pub fn skip(test: &str, why: &str) {
    say(&format!("\nSKIPPED: {test}: {why}"));
}

/// One network test at a time in this process: their timing must not depend on the others'
/// load (the machine may have 2 cores).
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

fn run(args: &[&str]) -> Result<String, String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("`{}`: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "`{}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Runs `nft -f -` inside `ns` with `rules` on stdin.
fn nft(ns: &str, rules: &str) -> Result<(), String> {
    let mut c = Command::new("ip")
        .args(["netns", "exec", ns, "nft", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("nft: {e}"))?;
    c.stdin
        .take()
        .expect("piped")
        .write_all(rules.as_bytes())
        .map_err(|e| format!("nft: {e}"))?;
    let out = c.wait_with_output().map_err(|e| format!("nft: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "nft in {ns} failed: {}\n{rules}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|e| e == "0"))
        })
        .unwrap_or(false)
}

/// Deletes namespaces of earlier test processes (`fnt<pid>-…`) whose process is gone.
fn sweep_stale() {
    let Ok(list) = run(&["ip", "netns", "list"]) else {
        return;
    };
    for name in list.lines().filter_map(|l| l.split_whitespace().next()) {
        let Some(pid) = name
            .strip_prefix("fnt")
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = run(&["ip", "netns", "del", name]);
        }
    }
}

pub struct Host {
    pub label: String,
    pub ns: String,
    pub ip: String,
    /// The switch's port toward this host.
    port: String,
}

/// What the network does to packets, in words, and what could not be emulated.
#[derive(Default)]
pub struct Impairment {
    /// Applied, in words.
    pub applied: Vec<String>,
    /// Not emulated here, with why (each said on a `SKIPPED:` line).
    pub skipped: Vec<String>,
    /// Loss through nftables (its counter counts the drops).
    pub nft_loss: bool,
}

pub struct Net {
    pub tag: String,
    switch: String,
    pub hosts: Vec<Host>,
    /// Namespaces made so far (removed in `Drop`).
    made: Vec<String>,
    pub nft: bool,
    cut: Vec<usize>,
}

impl Net {
    /// A switch and one host per label, on 10.231.0.0/24 (host i at .i+1). `Err` says why
    /// the hosts cannot be made here (the caller skips, visibly).
    pub fn new(labels: &[&str]) -> Result<Net, String> {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        if !is_root() {
            return Err("not root: network namespaces need CAP_SYS_ADMIN".into());
        }
        run(&["ip", "-V"]).map_err(|e| format!("no usable `ip` (iproute2): {e}"))?;
        sweep_stale();
        let tag = format!(
            "fnt{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let mut net = Net {
            switch: format!("{tag}-sw"),
            tag,
            hosts: Vec::new(),
            made: Vec::new(),
            nft: false,
            cut: Vec::new(),
        };
        let sw = net.switch.clone();
        net.add_ns(&sw)?;
        run(&["ip", "-n", &sw, "link", "set", "lo", "up"])?;
        run(&["ip", "-n", &sw, "link", "add", "br0", "type", "bridge"])?;
        run(&["ip", "-n", &sw, "link", "set", "br0", "up"])?;
        for (i, label) in labels.iter().enumerate() {
            let ns = format!("{}-{label}", net.tag);
            net.add_ns(&ns)?;
            let port = format!("p{i}");
            let ip = format!("10.231.0.{}", i + 1);
            run(&[
                "ip", "-n", &sw, "link", "add", &port, "type", "veth", "peer", "name", "eth0",
                "netns", &ns,
            ])?;
            run(&["ip", "-n", &sw, "link", "set", &port, "master", "br0", "up"])?;
            run(&["ip", "-n", &ns, "link", "set", "lo", "up"])?;
            run(&[
                "ip",
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{ip}/24"),
                "dev",
                "eth0",
            ])?;
            run(&["ip", "-n", &ns, "link", "set", "eth0", "up"])?;
            net.hosts.push(Host {
                label: label.to_string(),
                ns,
                ip,
                port,
            });
        }
        net.nft = run(&["ip", "netns", "exec", &sw, "nft", "list", "ruleset"]).is_ok();
        Ok(net)
    }

    fn add_ns(&mut self, ns: &str) -> Result<(), String> {
        // A namespace of this name can only be a leftover of this very process's id.
        let _ = run(&["ip", "netns", "del", ns]);
        run(&["ip", "netns", "add", ns])
            .map_err(|e| format!("cannot create network namespaces: {e}"))?;
        self.made.push(ns.to_string());
        Ok(())
    }

    pub fn host(&self, label: &str) -> usize {
        self.hosts
            .iter()
            .position(|h| h.label == label)
            .unwrap_or_else(|| panic!("no host {label}"))
    }

    /// Latency 2 ms ± 1 ms and 0.5 % loss on every port (netem), or what of it this kernel
    /// can do.
    pub fn impair(&mut self) -> Impairment {
        let mut imp = Impairment::default();
        let sw = self.switch.clone();
        let netem = |port: &str| {
            run(&[
                "tc", "-n", &sw, "qdisc", "add", "dev", port, "root", "netem", "delay", "2ms",
                "1ms", "loss", "0.5%",
            ])
        };
        match netem(&self.hosts[0].port) {
            Ok(_) => {
                for h in &self.hosts[1..] {
                    if let Err(e) = netem(&h.port) {
                        panic!("netem worked on one port and not on {}: {e}", h.port);
                    }
                }
                imp.applied.push(
                    "latency 2 ms ± 1 ms and loss 0.5 % on every switch port (tc netem)".into(),
                );
                return imp;
            }
            // Where netem must be (the test guest, whose stock kernel has it), its absence
            // is a failure, not a skip.
            Err(e) if std::env::var("FALCON_NETNS_REQUIRE_NETEM").as_deref() == Ok("1") => {
                panic!("FALCON_NETNS_REQUIRE_NETEM=1, but netem failed: {e}")
            }
            Err(e) => imp.skipped.push(format!(
                "latency not emulated (2 ms ± 1 ms wanted): this kernel has no netem qdisc ({e}); \
                 no other qdisc here delays packets (tbf/htb only shape rates); tools/test.sh \
                 runs this test again in the test guest, whose kernel has netem"
            )),
        }
        if self.nft {
            match nft(
                &sw,
                "table bridge falcon_loss {\n  chain forward {\n    type filter hook forward priority 0; policy accept;\n    ether type ip numgen random mod 1000 < 5 counter drop\n  }\n}\n",
            ) {
                Ok(()) => {
                    imp.nft_loss = true;
                    imp.applied.push(
                        "loss 0.5 % of IPv4 frames crossing the switch (nftables numgen random)"
                            .into(),
                    );
                }
                Err(e) => imp.skipped.push(format!("packet loss not emulated: {e}")),
            }
        } else {
            imp.skipped.push(
                "packet loss not emulated: no netem and no `nft` (apt-get install nftables)".into(),
            );
        }
        imp
    }

    /// A bandwidth cap of `rate` (tc's units, e.g. `10mbit`) on the switch's ports toward
    /// `hosts` (tbf): it paces a job in wall-clock time, whatever the machine's load. Not
    /// with `impair` (one root qdisc per port).
    pub fn cap(&mut self, rate: &str, hosts: &[usize]) -> String {
        for &h in hosts {
            run(&[
                "tc",
                "-n",
                &self.switch,
                "qdisc",
                "add",
                "dev",
                &self.hosts[h].port,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "32kb",
                "latency",
                "400ms",
            ])
            .unwrap_or_else(|e| panic!("tbf: {e}"));
        }
        format!("{rate} toward {} (tbf)", self.labels(hosts))
    }

    fn labels(&self, which: &[usize]) -> String {
        which
            .iter()
            .map(|&i| format!("host {}", self.hosts[i].label))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// IPv4 frames the loss rule dropped so far.
    pub fn loss_drops(&self) -> u64 {
        run(&[
            "ip",
            "netns",
            "exec",
            &self.switch,
            "nft",
            "list",
            "table",
            "bridge",
            "falcon_loss",
        ])
        .ok()
        .and_then(|t| number_after(&t, "counter packets"))
        .unwrap_or(0)
    }

    /// How a partition is made here, in words.
    pub fn partition_means(&self) -> &'static str {
        if self.nft {
            "nftables on the switch drops every frame from and to the host's port"
        } else {
            "the switch's port toward the host is set down (no nft here)"
        }
    }

    /// Cuts host `h` off: nothing from or to it crosses the switch.
    pub fn partition(&mut self, h: usize) {
        let port = &self.hosts[h].port;
        if self.nft {
            nft(
                &self.switch,
                &format!(
                    "table bridge falcon_cut_{h} {{\n  chain forward {{\n    type filter hook forward priority -10; policy accept;\n    iifname \"{port}\" counter drop\n    oifname \"{port}\" counter drop\n  }}\n}}\n"
                ),
            )
            .unwrap_or_else(|e| panic!("partition: {e}"));
        } else {
            run(&["ip", "-n", &self.switch, "link", "set", port, "down"])
                .unwrap_or_else(|e| panic!("partition: {e}"));
        }
        self.cut.push(h);
    }

    /// Heals host `h`'s partition; returns, in words, the frames dropped while it lasted
    /// (counted with nft only).
    pub fn heal(&mut self, h: usize) -> String {
        self.cut.retain(|&c| c != h);
        if self.nft {
            let table = format!("falcon_cut_{h}");
            let dropped = run(&[
                "ip",
                "netns",
                "exec",
                &self.switch,
                "nft",
                "list",
                "table",
                "bridge",
                &table,
            ])
            .map(|t| {
                t.lines()
                    .filter_map(|l| number_after(l, "counter packets"))
                    .sum::<u64>()
            })
            .unwrap_or(0);
            run(&[
                "ip",
                "netns",
                "exec",
                &self.switch,
                "nft",
                "delete",
                "table",
                "bridge",
                &table,
            ])
            .unwrap_or_else(|e| panic!("heal: {e}"));
            format!("{dropped} frames dropped meanwhile")
        } else {
            let port = &self.hosts[h].port;
            run(&["ip", "-n", &self.switch, "link", "set", port, "up"])
                .unwrap_or_else(|e| panic!("heal: {e}"));
            "its port down meanwhile".into()
        }
    }

    /// TCP segments retransmitted by host `h`'s kernel so far.
    pub fn retransmits(&self, h: usize) -> u64 {
        let Ok(snmp) = run(&[
            "ip",
            "netns",
            "exec",
            &self.hosts[h].ns,
            "cat",
            "/proc/net/snmp",
        ]) else {
            return 0;
        };
        let tcp: Vec<&str> = snmp.lines().filter(|l| l.starts_with("Tcp:")).collect();
        if tcp.len() < 2 {
            return 0;
        }
        let names: Vec<&str> = tcp[0].split_whitespace().collect();
        let values: Vec<&str> = tcp[1].split_whitespace().collect();
        names
            .iter()
            .position(|n| *n == "RetransSegs")
            .and_then(|i| values.get(i)?.parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // Hosts first: their veths go with them, then the switch.
        for ns in self.made.iter().rev() {
            let _ = run(&["ip", "netns", "del", ns]);
        }
    }
}

type Lines = Arc<Mutex<Vec<(Instant, String)>>>;

/// A role's process; its output collected as it comes. Killed in `Drop`.
pub struct Proc {
    pub what: String,
    pub started: Instant,
    child: Child,
    status: Option<ExitStatus>,
    out: Lines,
    err: Lines,
    readers: Vec<JoinHandle<()>>,
}

impl Proc {
    pub fn spawn(mut cmd: Command, what: &str) -> Proc {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {what}: {e}"));
        let out: Lines = Arc::default();
        let err: Lines = Arc::default();
        let mut readers = Vec::new();
        let so = child.stdout.take().expect("piped");
        let se = child.stderr.take().expect("piped");
        for (pipe, lines) in [
            (Box::new(so) as Box<dyn std::io::Read + Send>, out.clone()),
            (Box::new(se), err.clone()),
        ] {
            readers.push(std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines() {
                    let Ok(line) = line else { break };
                    lines.lock().unwrap().push((Instant::now(), line));
                }
            }));
        }
        Proc {
            what: what.to_string(),
            started: Instant::now(),
            child,
            status: None,
            out,
            err,
            readers,
        }
    }

    /// Its exit status, if it has ended.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().unwrap();
        }
        self.status
    }

    /// Waits up to `limit` for it to end (it is not killed if it does not).
    pub fn wait(&mut self, limit: Duration) -> Option<ExitStatus> {
        let end = Instant::now() + limit;
        while Instant::now() < end {
            if let Some(s) = self.exited() {
                self.drain();
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// After it ended: lets the readers take the rest of its output.
    fn drain(&mut self) {
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
    }

    pub fn kill(&mut self) {
        if self.exited().is_none() {
            let _ = self.child.kill();
            self.status = self.child.wait().ok();
        }
        self.drain();
    }

    fn text(lines: &Lines) -> String {
        let l = lines.lock().unwrap();
        let mut s = String::new();
        for (_, line) in l.iter() {
            s.push_str(line);
            s.push('\n');
        }
        s
    }

    pub fn stdout(&self) -> String {
        Self::text(&self.out)
    }

    pub fn stderr(&self) -> String {
        Self::text(&self.err)
    }

    /// When a line containing `needle` came (stdout or stderr), if one did.
    pub fn seen(&self, needle: &str) -> Option<Instant> {
        [&self.out, &self.err]
            .iter()
            .filter_map(|lines| {
                lines
                    .lock()
                    .unwrap()
                    .iter()
                    .find(|(_, l)| l.contains(needle))
                    .map(|(t, _)| *t)
            })
            .min()
    }

    /// Every line (stdout and stderr) containing `needle`.
    pub fn lines_with(&self, needle: &str) -> Vec<String> {
        let mut v = Vec::new();
        for lines in [&self.out, &self.err] {
            v.extend(
                lines
                    .lock()
                    .unwrap()
                    .iter()
                    .filter(|(_, l)| l.contains(needle))
                    .map(|(_, l)| l.clone()),
            );
        }
        v
    }

    /// The last line on stdout containing `needle`.
    pub fn last_with(&self, needle: &str) -> Option<String> {
        self.out
            .lock()
            .unwrap()
            .iter()
            .rev()
            .find(|(_, l)| l.contains(needle))
            .map(|(_, l)| l.clone())
    }

    /// Its output, for a failure message.
    pub fn dump(&mut self) -> String {
        let status = self.exited();
        format!(
            "----- {} ({}) -----\n{}{}",
            self.what,
            status.map_or("still running".to_string(), |s| s.to_string()),
            self.stdout(),
            self.stderr()
        )
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Whether `setpriv --pdeathsig` is there to tie the roles' lives to the test's.
fn pdeathsig() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| run(&["setpriv", "--pdeathsig", "KILL", "true"]).is_ok())
}

/// A job whose roles run on the hosts of a net. Roles are killed before the net goes.
pub struct Cluster {
    pub procs: Vec<Proc>,
    pub job: Job,
    pub net: Net,
    pub t0: Instant,
}

impl Cluster {
    /// The scheduler's address is the first host's.
    pub fn new(net: Net, job: Job) -> Cluster {
        Cluster {
            procs: Vec::new(),
            job,
            net,
            t0: Instant::now(),
        }
    }

    /// Starts a role on host `h`; returns its index in `procs`.
    pub fn start(&mut self, role: &str, rank: Option<u32>, h: usize) -> usize {
        let host = &self.net.hosts[h];
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &host.ns]);
        // Killed with this test's thread should the test itself be killed (util-linux).
        if pdeathsig() {
            c.args(["setpriv", "--pdeathsig", "KILL"]);
        }
        c.args([FALCON, "role"])
            .envs(self.job.vars.iter().map(|(k, v)| (k, v)))
            .env("DMLC_ROLE", role)
            .env("DMLC_PS_ROOT_URI", &self.net.hosts[0].ip)
            .env("DMLC_NODE_HOST", &host.ip)
            // Every host here shares the kernel's host id: without this, roles on different
            // "hosts" would pick shared memory and the network would not be used.
            .env("FALCON_MEDIUM", "tcp")
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1");
        let what = match rank {
            Some(r) => {
                c.env("FALCON_RANK", r.to_string());
                format!("{role} {r} on host {}", host.label)
            }
            None => format!("{role} on host {}", host.label),
        };
        let n = self.procs.iter().filter(|p| p.what == what).count();
        let what = if n > 0 {
            format!("{what} (restart {n})")
        } else {
            what
        };
        self.procs.push(Proc::spawn(c, &what));
        self.procs.len() - 1
    }

    pub fn secs(&self, t: Instant) -> f64 {
        t.saturating_duration_since(self.t0).as_secs_f64()
    }

    /// Every role's output, for a failure message.
    pub fn dump(&mut self) -> String {
        self.procs
            .iter_mut()
            .map(|p| p.dump())
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Fails the test with `why` and every role's output.
    pub fn fail(&mut self, why: &str) -> ! {
        for p in &mut self.procs {
            p.kill();
        }
        let all = self.dump();
        panic!("{why}\n{all}");
    }

    /// Waits up to `limit` for a line containing any of `needles` from role `i`; returns
    /// when the first came.
    pub fn wait_any(&mut self, i: usize, needles: &[&str], limit: Duration) -> Option<Instant> {
        let end = Instant::now() + limit;
        let seen = |p: &Proc| needles.iter().filter_map(|n| p.seen(n)).min();
        loop {
            if let Some(t) = seen(&self.procs[i]) {
                return Some(t);
            }
            if Instant::now() > end || self.procs[i].exited().is_some() {
                // One more look: the line may have come with the exit.
                self.procs[i].wait(Duration::from_millis(200));
                return seen(&self.procs[i]);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits for role `i` to end successfully, within `limit`.
    pub fn succeeds(&mut self, i: usize, limit: Duration) {
        match self.procs[i].wait(limit) {
            Some(s) if s.success() => {}
            Some(s) => {
                let what = self.procs[i].what.clone();
                self.fail(&format!("{what} failed ({s})"))
            }
            None => {
                let what = self.procs[i].what.clone();
                self.fail(&format!("{what} did not finish within {limit:?}"))
            }
        }
    }
}
