//! CPU quotas the kernel enforces (`falcon_engine::quota`, `falcon local --cpu-quota`): real
//! processes in control groups. Where cgroups are not writable here (no root, no CPU
//! controller), each test prints a `SKIPPED:` line saying why and passes.

use std::process::Command;
use std::time::Duration;

use falcon_engine::quota::CpuQuota;

const FALCON: &str = env!("CARGO_BIN_EXE_falcon");

/// A quota group for this test, or why there can be none here.
fn group(test: &str, cpus: f64) -> Option<CpuQuota> {
    match CpuQuota::new(&format!("falcon-{}-test-{test}", std::process::id()), cpus) {
        Ok(q) => Some(q),
        Err(e) => {
            println!("SKIPPED: {test}: no CPU quota can be made here: {e}");
            None
        }
    }
}

#[test]
fn a_busy_process_in_a_quota_group_is_throttled_and_the_group_removed_after() {
    let Some(q) = group("busy", 0.1) else {
        return;
    };
    let dir = q.dir().to_path_buf();
    let mut busy = Command::new("sh")
        .args(["-c", "while :; do :; done"])
        .spawn()
        .unwrap();
    q.add(busy.id()).unwrap();
    let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap();
    assert!(
        procs.lines().any(|l| l.trim() == busy.id().to_string()),
        "{procs}"
    );
    // A tenth of a CPU per 10 ms period: a process that never yields is held back in
    // (nearly) every period.
    let mut throttled = 0;
    for _ in 0..100 {
        std::thread::sleep(Duration::from_millis(50));
        throttled = q.throttled().unwrap_or(0);
        if throttled >= 3 {
            break;
        }
    }
    busy.kill().unwrap();
    busy.wait().unwrap();
    assert!(
        throttled >= 3,
        "the kernel held the process back in {throttled} periods"
    );
    drop(q);
    assert!(!dir.exists(), "{} is removed", dir.display());
}

/// A short synthetic `falcon local` job of 2 workers with `--cpu-quota quota`.
fn local_with_quota(quota: &str) -> std::process::Output {
    Command::new(FALCON)
        .args([
            "local",
            "--workers",
            "2",
            "--iters",
            "20",
            "--floats",
            "1024",
        ])
        .args(["--cpu-quota", quota])
        .output()
        .unwrap()
}

#[test]
fn falcon_local_holds_a_worker_to_its_quota_and_refuses_a_rank_it_lacks() {
    let out = local_with_quota("9:0.5");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("RANKS:CPUS") && err.contains("worker 9 is out of range"),
        "{err}"
    );

    let out = local_with_quota("1:0.5");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    if let Some(line) = text
        .lines()
        .find(|l| l.contains("SKIPPED: worker 1's CPU quota"))
    {
        println!("SKIPPED: falcon local's quota: {line}");
        return;
    }
    let line = text
        .lines()
        .find(|l| l.contains("worker 1 held to 0.5 CPUs"))
        .unwrap_or_else(|| panic!("no quota line:\n{text}"));
    // Removed once the job ended: the directory the line names is gone.
    let dir = line.rsplit('(').next().unwrap().trim_end_matches(')');
    assert!(!std::path::Path::new(dir).exists(), "{dir} is removed");
    assert!(!text.contains("worker 0 held"), "{text}");
}

#[test]
fn a_group_left_by_a_process_killed_outright_is_removed_by_the_next_one() {
    let Some(probe) = group("probe", 1.0) else {
        return;
    };
    // A pid that no longer runs: a child that has ended.
    let mut gone = Command::new("true").spawn().unwrap();
    gone.wait().unwrap();
    let stale = probe
        .dir()
        .parent()
        .unwrap()
        .join(format!("falcon-{}-worker7", gone.id()));
    std::fs::create_dir(&stale).unwrap();
    drop(probe);
    let Some(next) = group("next", 1.0) else {
        return;
    };
    assert!(!stale.exists(), "{} was swept", stale.display());
    drop(next);
}
