//! CPU quotas for processes: a slow machine the kernel enforces. A [`CpuQuota`] is a control
//! group of its own with a CPU bandwidth limit — cgroup v1's `cpu` controller
//! (`cpu.cfs_quota_us` over `cpu.cfs_period_us`) or cgroup v2's `cpu.max`, whichever the
//! host mounts — that processes are moved into; it is removed when dropped (once its
//! processes have ended). Where neither is mounted or writable (no root, a read-only
//! `/sys/fs/cgroup`), making one is an [`Error::Os`] or [`Error::Config`] that says so, and
//! callers skip visibly.
//!
//! [`Mounts`] finds the controller from `/proc/self/mountinfo` and `/proc/self/cgroup`
//! (pure parsing, tested on text); the rest is the thin I/O that writes the files.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The period of the bandwidth limit, in µs: 10 ms, a tenth of the kernel's default. Within
/// a period a process runs until its quota is spent and then waits for the next one; at the
/// default a quarter-speed worker would stop for 75 ms at a time, answering nothing (not even
/// a helper asking for its tasks), where a slow machine is slow evenly. A shorter period
/// spreads the same share finely (the kernel accepts 1 ms and up).
pub const PERIOD_US: u64 = 10_000;

/// Where the CPU controller is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mounts {
    /// The directory new groups go in: the controller's mount point joined with this
    /// process's own group in that hierarchy.
    pub parent: PathBuf,
    /// cgroup v2 (`cpu.max`) rather than v1 (`cpu.cfs_quota_us`).
    pub v2: bool,
}

impl Mounts {
    /// The CPU controller in `mountinfo` (`/proc/self/mountinfo`'s text) with this process's
    /// groups `cgroups` (`/proc/self/cgroup`'s); `controllers(dir)` reads a v2 directory's
    /// `cgroup.controllers`. v1's `cpu` controller first (a hybrid host keeps it there),
    /// else a v2 hierarchy whose controllers include `cpu`.
    pub fn find(
        mountinfo: &str,
        cgroups: &str,
        controllers: impl Fn(&Path) -> Option<String>,
    ) -> Option<Mounts> {
        let mut v2 = None;
        for line in mountinfo.lines() {
            // ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER
            let Some((left, right)) = line.split_once(" - ") else {
                continue;
            };
            let (Some(point), mut rest) = (left.split(' ').nth(4), right.split(' ')) else {
                continue;
            };
            let point = unescape(point);
            match (rest.next(), rest.nth(1)) {
                (Some("cgroup"), Some(opts)) if opts.split(',').any(|o| o == "cpu") => {
                    let own = own_group(cgroups, |c| c.split(',').any(|x| x == "cpu"));
                    return Some(Mounts {
                        parent: join(&point, own.as_deref().unwrap_or("/")),
                        v2: false,
                    });
                }
                (Some("cgroup2"), _) if v2.is_none() => {
                    let own = own_group(cgroups, str::is_empty);
                    let parent = join(&point, own.as_deref().unwrap_or("/"));
                    let has_cpu = controllers(&parent)
                        .is_some_and(|c| c.split_whitespace().any(|x| x == "cpu"));
                    if has_cpu {
                        v2 = Some(Mounts { parent, v2: true });
                    }
                }
                _ => {}
            }
        }
        v2
    }

    /// The CPUs this process's own group may use at once (its quota over its period),
    /// `read(file)` giving a file of that group; `None` where it has no limit.
    pub fn own_cpus(&self, read: impl Fn(&str) -> Option<String>) -> Option<f64> {
        let (quota, period) = if self.v2 {
            let max = read("cpu.max")?;
            let mut f = max.split_whitespace();
            (
                f.next()?.parse::<f64>().ok()?,
                f.next()?.parse::<f64>().ok()?,
            )
        } else {
            let n = |f: &str| read(f)?.trim().parse::<f64>().ok();
            (n("cpu.cfs_quota_us")?, n("cpu.cfs_period_us")?)
        };
        (quota > 0.0 && period > 0.0).then(|| quota / period)
    }

    /// The host's, read from `/proc`.
    pub fn of_this_host() -> Option<Mounts> {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
        let cgroups = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        Mounts::find(&mountinfo, &cgroups, |d| {
            std::fs::read_to_string(d.join("cgroup.controllers")).ok()
        })
    }
}

/// The CPUs this process may use at once under its control group's quota; `None` where it
/// has none or the host mounts no CPU controller.
pub fn own_cpus() -> Option<f64> {
    let m = Mounts::of_this_host()?;
    m.own_cpus(|f| std::fs::read_to_string(m.parent.join(f)).ok())
}

/// This process's group in the hierarchy whose controller list matches `which`
/// (`/proc/self/cgroup`: `ID:CONTROLLERS:PATH`; v2's line has none).
fn own_group(cgroups: &str, which: impl Fn(&str) -> bool) -> Option<String> {
    cgroups.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, ctl, path) = (f.next()?, f.next()?, f.next()?);
        which(ctl).then(|| path.to_string())
    })
}

fn join(point: &str, group: &str) -> PathBuf {
    Path::new(point).join(group.trim_start_matches('/'))
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && let Ok(v) = u8::from_str_radix(&s[i + 1..i + 4], 8)
        {
            out.push(v);
            i += 4;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Removes the groups falcon made for a process that is gone without removing them (one
/// killed outright): empty directories `falcon-<pid>-…` under `parent` whose `pid` no longer
/// runs. A group that still holds processes cannot be removed and is left alone.
fn sweep_stale(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("falcon-"))
            .and_then(|n| n.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir(e.path());
        }
    }
}

/// A control group with a CPU bandwidth limit of `cpus` CPUs (0.25: a quarter of one CPU's
/// time per period, whatever the host's load), removed when dropped.
#[derive(Debug)]
pub struct CpuQuota {
    dir: PathBuf,
    cpus: f64,
}

impl CpuQuota {
    /// Makes group `name` (a file name: letters, digits, `-`, `_`, `.`) limited to `cpus`
    /// CPUs (finite, > 0) under this host's CPU controller. Name it `falcon-<your pid>-…`:
    /// such groups left behind by a process killed outright are removed by the next one made.
    pub fn new(name: &str, cpus: f64) -> Result<CpuQuota> {
        if !(cpus.is_finite() && cpus > 0.0) {
            return Err(Error::Config(format!(
                "a CPU quota is a number of CPUs > 0 (0.25: a quarter of one), not {cpus}"
            )));
        }
        if name.is_empty()
            || name.starts_with('.')
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return Err(Error::Config(format!(
                "a CPU quota's group name is letters, digits, '-', '_' and '.', not {name:?}"
            )));
        }
        let Some(m) = Mounts::of_this_host() else {
            return Err(Error::Config(
                "CPU quotas need a cgroup CPU controller (v1 `cpu` or v2 with `cpu` in \
                 cgroup.controllers); this host mounts neither"
                    .into(),
            ));
        };
        sweep_stale(&m.parent);
        let dir = m.parent.join(name);
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            // A group of this name left by a run killed before it could remove it: reused
            // when no process is in it (its limits are written anew below).
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
                if let Some(pid) = procs.split_whitespace().next() {
                    return Err(Error::Config(format!(
                        "the CPU-quota group {} is in use (process {pid} is in it): give this \
                         quota another name",
                        dir.display()
                    )));
                }
            }
            Err(e) => {
                return Err(Error::os(
                    format!(
                        "making the CPU-quota group {} (cgroups are writable by root, or where \
                         a delegated hierarchy allows)",
                        dir.display()
                    ),
                    e,
                ));
            }
        }
        let q = CpuQuota { dir, cpus };
        let quota = ((cpus * PERIOD_US as f64).round() as u64).max(1000);
        let written = if m.v2 {
            q.write("cpu.max", &format!("{quota} {PERIOD_US}"))
        } else {
            q.write("cpu.cfs_period_us", &PERIOD_US.to_string())
                .and_then(|()| q.write("cpu.cfs_quota_us", &quota.to_string()))
        };
        written.map(|()| q)
    }

    fn write(&self, file: &str, text: &str) -> Result<()> {
        std::fs::write(self.dir.join(file), text).map_err(|e| {
            Error::os(
                format!("writing {text:?} to {}", self.dir.join(file).display()),
                e,
            )
        })
    }

    /// Moves process `pid` (with its threads) into the group.
    pub fn add(&self, pid: u32) -> Result<()> {
        self.write("cgroup.procs", &pid.to_string())
    }

    /// Moves process `pid` out of the group, back into the group the new groups are made
    /// in (a process that held itself to a quota leaves before the group is removed).
    pub fn release(&self, pid: u32) -> Result<()> {
        let parent = self.dir.parent().unwrap_or(&self.dir).join("cgroup.procs");
        std::fs::write(&parent, pid.to_string())
            .map_err(|e| Error::os(format!("moving process {pid} to {}", parent.display()), e))
    }

    /// Its directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Its CPUs.
    pub fn cpus(&self) -> f64 {
        self.cpus
    }

    /// How many periods the kernel held its processes back at the quota (`cpu.stat`'s
    /// `nr_throttled`, v1 and v2 alike; `None` where it cannot be read).
    pub fn throttled(&self) -> Option<u64> {
        let stat = std::fs::read_to_string(self.dir.join("cpu.stat")).ok()?;
        stat.lines()
            .find_map(|l| l.strip_prefix("nr_throttled ")?.trim().parse().ok())
    }
}

impl Drop for CpuQuota {
    fn drop(&mut self) {
        // A group can be removed once it holds no process: the quota ends with it, so the
        // processes still in it (a caller that put itself in, or did not wait for them) go
        // back to the group new ones are made in, and the group is removed.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() || !self.dir.exists() {
                return;
            }
            if let Ok(procs) = std::fs::read_to_string(self.dir.join("cgroup.procs")) {
                for pid in procs
                    .split_whitespace()
                    .filter_map(|p| p.parse::<u32>().ok())
                {
                    let _ = self.release(pid);
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        tracing::warn!(
            "the CPU-quota group {} still holds processes; left in place",
            self.dir.display()
        );
    }
}

/// Parses `RANKS:CPUS[,RANKS:CPUS...]` (RANKS: N, A-B or *; CPUS > 0): each worker rank's
/// quota, for `workers` workers; a rank named twice takes the last.
pub fn parse_quotas(text: &str, workers: u32) -> Result<Vec<Option<f64>>> {
    let err = |why: String| {
        Error::Config(format!(
            "CPU quotas {text:?}: {why}; the form: RANKS:CPUS[,RANKS:CPUS...], RANKS N, A-B or *, \
             CPUS a number > 0 (3:0.25 holds worker 3 to a quarter of one CPU)"
        ))
    };
    let mut out = vec![None; workers as usize];
    for part in text
        .split([',', ';'])
        .map(str::trim)
        .filter(|p| !p.is_empty())
    {
        let (ranks, cpus) = part
            .split_once(':')
            .ok_or_else(|| err(format!("{part:?} has no ':'")))?;
        let cpus: f64 = cpus
            .trim()
            .parse()
            .ok()
            .filter(|c: &f64| c.is_finite() && *c > 0.0)
            .ok_or_else(|| err(format!("{cpus:?} is not a number of CPUs > 0")))?;
        let (lo, hi) = crate::checks::worker_ranks(ranks, workers).map_err(err)?;
        for q in &mut out[lo as usize..=hi as usize] {
            *q = Some(cpus);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const V1: &str = "\
25 30 0:22 / /sys rw,nosuid - sysfs sysfs rw
31 25 0:27 / /sys/fs/cgroup ro - tmpfs tmpfs ro,mode=755
33 31 0:29 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw
36 31 0:32 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct
37 31 0:33 / /sys/fs/cgroup/cpuset rw - cgroup cgroup rw,cpuset";

    #[test]
    fn a_groups_quota_is_read_in_cpus() {
        fn files(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
            let owned: Vec<(String, String)> = pairs
                .iter()
                .map(|(n, t)| (n.to_string(), t.to_string()))
                .collect();
            move |f| owned.iter().find(|(n, _)| n == f).map(|(_, t)| t.clone())
        }
        let v1 = Mounts {
            parent: "/g".into(),
            v2: false,
        };
        let v2 = Mounts {
            parent: "/g".into(),
            v2: true,
        };
        let half = [
            ("cpu.cfs_quota_us", "5000\n"),
            ("cpu.cfs_period_us", "10000\n"),
        ];
        assert_eq!(v1.own_cpus(files(&half)), Some(0.5));
        let none = [
            ("cpu.cfs_quota_us", "-1\n"),
            ("cpu.cfs_period_us", "100000\n"),
        ];
        assert_eq!(v1.own_cpus(files(&none)), None);
        assert_eq!(
            v2.own_cpus(files(&[("cpu.max", "150000 100000\n")])),
            Some(1.5)
        );
        assert_eq!(v2.own_cpus(files(&[("cpu.max", "max 100000\n")])), None);
        assert_eq!(v2.own_cpus(files(&[])), None);
    }

    #[test]
    fn the_cpu_controller_is_found_in_v1_v2_and_hybrid_hosts() {
        let none = |_: &Path| None;
        // Hybrid: v1's cpu first, joined with this process's own group there.
        let m = Mounts::find(V1, "4:cpu,cpuacct:/job/a\n0::/user.slice", none).unwrap();
        assert_eq!(
            m,
            Mounts {
                parent: "/sys/fs/cgroup/cpu,cpuacct/job/a".into(),
                v2: false
            }
        );
        // cpuset alone is not cpu.
        let only_cpuset = V1.replace("rw,cpu,cpuacct", "rw,cpuacct");
        assert_eq!(Mounts::find(&only_cpuset, "", none), None);
        // Pure v2: the unified hierarchy, where cgroup.controllers lists cpu.
        let v2 = "29 1 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate";
        let with =
            |d: &Path| (d == Path::new("/sys/fs/cgroup/svc")).then(|| "cpuset cpu io".into());
        assert_eq!(
            Mounts::find(v2, "0::/svc\n", with),
            Some(Mounts {
                parent: "/sys/fs/cgroup/svc".into(),
                v2: true
            })
        );
        let without = |_: &Path| Some("io memory".to_string());
        assert_eq!(Mounts::find(v2, "0::/svc\n", without), None);
        // Escaped mount points.
        let esc = "36 31 0:32 / /sys/fs/my\\040cg rw - cgroup cgroup rw,cpu";
        assert_eq!(
            Mounts::find(esc, "", none).unwrap().parent,
            PathBuf::from("/sys/fs/my cg")
        );
    }

    #[test]
    fn quotas_parse_per_rank_and_refuse_with_the_form() {
        assert_eq!(
            parse_quotas("3:0.25", 4).unwrap(),
            vec![None, None, None, Some(0.25)]
        );
        assert_eq!(
            parse_quotas("*:1, 0-1:0.5", 3).unwrap(),
            vec![Some(0.5), Some(0.5), Some(1.0)]
        );
        for bad in ["3", "4:1", "a:1", "1:0", "1:-2", "1:nan", "2-1:1", "1:x"] {
            let e = parse_quotas(bad, 4).unwrap_err().to_string();
            assert!(e.contains("RANKS:CPUS"), "{bad}: {e}");
        }
        assert!(CpuQuota::new("x", 0.0).is_err());
        assert!(CpuQuota::new("../x", 1.0).is_err());
    }
}
