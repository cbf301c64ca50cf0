//! Server checkpoints: a server's shards, versions, clocks and exactly-once counters in one
//! file, written atomically (a temporary file, `fsync`, `rename`, `fsync` of the directory)
//! and checked on load (magic, format, length and a SHA-256 of the body). A server killed
//! with SIGKILL restarts from its last checkpoint; the file is either the previous one or the
//! new one, never a torn mix.
//!
//! Layout: `FALCONCK` · format (u32 LE) · body length (u64 LE) · SHA-256 of the body (32
//! bytes) · body (postcard of [`Checkpoint`]).

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::config::OnCheckpointFailure;
use crate::error::{Error, Result};

const MAGIC: &[u8; 8] = b"FALCONCK";
/// Bumped whenever [`Checkpoint`] changes shape.
const FORMAT: u32 = 3;
const HEADER: usize = 8 + 4 + 8 + 32;

/// Everything a server needs to resume its shards.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// The job (its transport-level hash): a checkpoint of another job is refused.
    pub job: u64,
    /// The run of the job (the scheduler's random instance id): an earlier run's checkpoint
    /// is never restored.
    pub instance: u64,
    /// The server's rank.
    pub rank: u32,
    /// Workers in the job.
    pub workers: u32,
    /// How many checkpoints this server had written, this one included.
    pub number: u64,
    /// Milliseconds since the Unix epoch when it was taken.
    pub taken_ms: u64,
    /// The server's shards, in local order.
    pub shards: Vec<ShardState>,
}

/// One shard's state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardState {
    /// Global shard id.
    pub id: u32,
    /// The parameters.
    pub params: Vec<f32>,
    /// Updates applied (the meta block's version).
    pub version: u64,
    /// Per worker, its clock in the meta block.
    pub clocks: Vec<u64>,
    /// Per worker, gradients received (the last applied sequence number).
    pub pushes: Vec<u64>,
    /// Per worker, transferred-task gradients applied (the last sequence number).
    pub helps: Vec<u64>,
    /// Per worker, sequence numbers passed over without a gradient.
    pub skipped: Vec<u64>,
    /// Per worker, the version last sent to it by a released pull.
    pub sent_version: Vec<u64>,
    /// Sync mode: the next clock to apply.
    pub next_apply: u64,
    /// Sync mode: gradients waiting for their clock's quorum, by clock, by worker.
    pub pending: Vec<(u64, Vec<Option<Vec<f32>>>)>,
    /// Sync mode: transferred tasks' gradients waiting for their step, summed, by clock.
    pub help_pending: Vec<(u64, Vec<f32>)>,
    /// Sync mode: late gradients for the next step applied (policies that fold): worker,
    /// their weighed sum, how many, the sum of their weights.
    pub folded: Vec<(u32, Vec<f32>, u32, f32)>,
    /// Whether the shard was initialized by a worker.
    pub initialized: bool,
    /// The optimizer's state: first and second moments and steps taken.
    pub opt_m: Vec<f32>,
    /// Second moments (Adam).
    pub opt_v: Vec<f32>,
    /// Optimizer steps taken.
    pub opt_step: u64,
}

/// The checkpoint file of server `rank` in `dir`.
pub fn path(dir: &Path, rank: u32) -> PathBuf {
    dir.join(format!("server-{rank}.ckpt"))
}

fn corrupt(path: &Path, why: impl std::fmt::Display) -> Error {
    Error::Checkpoint(format!("{}: {why}", path.display()))
}

/// Encodes a checkpoint: header and body.
pub fn encode(c: &Checkpoint) -> Result<Vec<u8>> {
    let body = postcard::to_stdvec(c).map_err(|e| Error::Checkpoint(format!("encode: {e}")))?;
    let mut out = Vec::with_capacity(HEADER + body.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT.to_le_bytes());
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&Sha256::digest(&body));
    out.extend_from_slice(&body);
    Ok(out)
}

/// Decodes and verifies a checkpoint read from `path` (named in errors). Never panics.
pub fn decode(bytes: &[u8], path: &Path) -> Result<Checkpoint> {
    if bytes.len() < HEADER {
        return Err(corrupt(
            path,
            format!("{} bytes, shorter than the header", bytes.len()),
        ));
    }
    if &bytes[..8] != MAGIC {
        return Err(corrupt(path, "not a falcon checkpoint (bad magic)"));
    }
    let format = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if format != FORMAT {
        return Err(corrupt(
            path,
            format!("format {format}; this build reads format {FORMAT}"),
        ));
    }
    let len = u64::from_le_bytes(bytes[12..20].try_into().expect("8 bytes"));
    let body = &bytes[HEADER..];
    if body.len() as u64 != len {
        return Err(corrupt(
            path,
            format!(
                "truncated or padded: header says {len} body bytes, file has {}",
                body.len()
            ),
        ));
    }
    if Sha256::digest(body).as_slice() != &bytes[20..52] {
        return Err(corrupt(path, "checksum mismatch"));
    }
    let c: Checkpoint = postcard::from_bytes(body).map_err(|e| corrupt(path, e))?;
    for s in &c.shards {
        let w = c.workers as usize;
        if [
            s.clocks.len(),
            s.pushes.len(),
            s.helps.len(),
            s.skipped.len(),
            s.sent_version.len(),
        ]
        .iter()
        .any(|&n| n != w)
            || s.pending.iter().any(|(_, g)| g.len() != w)
        {
            return Err(corrupt(
                path,
                format!("shard {}: per-worker state is not for {w} workers", s.id),
            ));
        }
    }
    Ok(c)
}

/// Writes `c` to `path` atomically: readers (a restarting server) see the old file or the
/// new one, whole.
pub fn save(path: &Path, c: &Checkpoint) -> Result<()> {
    write_atomic(path, &encode(c)?)
}

/// Writes `bytes` to `path` through a temporary file in the same directory, synced and
/// renamed over it; the directory is synced so the rename survives a crash. On every failure
/// (a full disk, a directory gone or replaced) the temporary file is removed: nothing is left
/// behind but the previous checkpoint, untouched.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |f| f.write_all(bytes))
}

/// The temporary file `write_atomic` writes `path` through (this process's own).
pub fn temp_path(path: &Path) -> PathBuf {
    path.with_extension(format!("tmp.{}", std::process::id()))
}

/// Removes a temporary file when dropped, unless it was renamed into place.
struct TempFile<'a>(Option<&'a Path>);

impl Drop for TempFile<'_> {
    fn drop(&mut self) {
        if let Some(p) = self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// [`write_atomic`], the temporary file filled by `fill`.
fn write_atomic_with(
    path: &Path,
    fill: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>,
) -> Result<()> {
    let io = |what: &str, e: std::io::Error| {
        Error::Checkpoint(format!("{what} {}: {e}", path.display()))
    };
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| io("create the directory of", e))?;
    let tmp = temp_path(path);
    let mut f = std::fs::File::create(&tmp).map_err(|e| io("create a temporary file for", e))?;
    // From here on, any failure removes the temporary file (a partial one on a full disk).
    let mut guard = TempFile(Some(&tmp));
    fill(&mut f).map_err(|e| io("write", e))?;
    f.sync_all().map_err(|e| io("sync", e))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(|e| io("rename into place", e))?;
    guard.0 = None;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Loads server `rank`'s checkpoint from `dir`: `Ok(None)` when there is none; an error when
/// one exists but is corrupt, of another job, or of another rank.
pub fn load(dir: &Path, rank: u32, job: u64, workers: u32) -> Result<Option<Checkpoint>> {
    let p = path(dir, rank);
    let bytes = match std::fs::read(&p) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(corrupt(&p, e)),
    };
    let c = decode(&bytes, &p)?;
    if c.job != job {
        return Err(corrupt(&p, "written by another job"));
    }
    if c.rank != rank || c.workers != workers {
        return Err(corrupt(
            &p,
            format!(
                "written by server {} of a job of {} workers; this is server {rank} of {workers}",
                c.rank, c.workers
            ),
        ));
    }
    Ok(Some(c))
}

/// Server `rank`'s checkpoint in `dir` for a resumed job: it must exist and be of this job
/// (its name: the configuration that wrote it) and of a job of `workers` workers, any run.
pub fn load_to_resume(dir: &Path, rank: u32, job: u64, workers: u32) -> Result<Checkpoint> {
    let p = path(dir, rank);
    let bytes = match std::fs::read(&p) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::Checkpoint(format!(
                "nothing to resume: {} holds no checkpoint of server {rank} ({} is missing)",
                dir.display(),
                p.display()
            )));
        }
        Err(e) => return Err(corrupt(&p, e)),
    };
    let c = decode(&bytes, &p)?;
    if c.job != job {
        return Err(Error::Checkpoint(format!(
            "{} is a checkpoint of another job: resume with the job (and settings) that wrote it",
            p.display()
        )));
    }
    if c.rank != rank || c.workers != workers {
        return Err(Error::Checkpoint(format!(
            "{} was written by server {} of a job of {} workers; this is server {rank} of {workers}",
            p.display(),
            c.rank,
            c.workers
        )));
    }
    Ok(c)
}

/// The scheduler's side of server `rank`'s `failures`-th failed checkpoint write: recorded in
/// `seen` (per server: its rank, failed writes, the last failure), logged when a server first
/// fails or fails otherwise than before (the server logs the rest, rate-limited), and under
/// [`OnCheckpointFailure::Stop`] the error that ends the job.
pub(crate) fn failure_reported(
    on_failure: OnCheckpointFailure,
    seen: &mut Vec<(u32, u64, String)>,
    rank: u32,
    failures: u64,
    reason: String,
) -> Option<Error> {
    let at = match seen.iter().position(|s| s.0 == rank) {
        Some(i) => i,
        None => {
            seen.push((rank, 0, String::new()));
            seen.sort_by_key(|s| s.0);
            seen.iter().position(|s| s.0 == rank).expect("just added")
        }
    };
    let entry = &mut seen[at];
    let new = entry.2 != reason;
    // Messages of one server arrive in order; a restarted server counts from 0 again.
    entry.1 = if failures > entry.1 {
        failures
    } else {
        entry.1 + 1
    };
    entry.2 = reason;
    match on_failure {
        OnCheckpointFailure::Stop => {
            let e = Error::CheckpointFailed {
                rank,
                failures: entry.1,
                reason: entry.2.clone(),
            };
            tracing::error!(target: "falcon_engine::scheduler", "scheduler: stopping the job: {e}");
            Some(e)
        }
        OnCheckpointFailure::Warn => {
            if new {
                tracing::warn!(
                    target: "falcon_engine::scheduler",
                    "scheduler: server {rank} could not write its checkpoint: {}; the job goes on (failures are counted in the report)",
                    entry.2
                );
            }
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Checkpoint {
        Checkpoint {
            job: 7,
            instance: 11,
            rank: 1,
            workers: 2,
            number: 3,
            taken_ms: 1,
            shards: vec![ShardState {
                id: 4,
                params: vec![1.0, -2.5, 3.25],
                version: 9,
                clocks: vec![5, 4],
                pushes: vec![5, 4],
                helps: vec![0, 1],
                skipped: vec![0, 2],
                sent_version: vec![8, 7],
                next_apply: 4,
                pending: vec![(4, vec![Some(vec![0.5, 0.5, 0.5]), None])],
                help_pending: vec![(4, vec![0.25, 0.0, -1.0])],
                folded: vec![(1, vec![1.0, 2.0, 3.0], 2, 0.75)],
                initialized: true,
                opt_m: vec![0.1, 0.2, 0.3],
                opt_v: vec![],
                opt_step: 9,
            }],
        }
    }

    fn dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "falcon-ckpt-test-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_checkpoint_round_trips_through_its_file() {
        let d = dir();
        let c = sample();
        save(&path(&d, 1), &c).unwrap();
        assert_eq!(load(&d, 1, 7, 2).unwrap(), Some(c));
        assert_eq!(load(&d, 0, 7, 2).unwrap(), None, "no file: no checkpoint");
        let left: Vec<_> = std::fs::read_dir(&d).unwrap().collect();
        assert_eq!(left.len(), 1, "no temporary file is left behind");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn every_corruption_is_a_typed_error_naming_the_file() {
        let d = dir();
        let p = path(&d, 1);
        let good = encode(&sample()).unwrap();
        let mut cases: Vec<(&str, Vec<u8>)> = vec![
            ("shorter than the header", good[..10].to_vec()),
            ("bad magic", {
                let mut b = good.clone();
                b[0] = b'X';
                b
            }),
            ("format", {
                let mut b = good.clone();
                b[8] = 99;
                b
            }),
            ("truncated", good[..good.len() - 1].to_vec()),
            ("checksum", {
                let mut b = good.clone();
                let n = b.len();
                b[n - 3] ^= 0x40;
                b
            }),
        ];
        // Every single-byte truncation is refused too.
        for n in 0..good.len() {
            cases.push(("", good[..n].to_vec()));
        }
        std::fs::create_dir_all(&d).unwrap();
        for (want, bytes) in cases {
            std::fs::write(&p, &bytes).unwrap();
            match load(&d, 1, 7, 2) {
                Err(Error::Checkpoint(m)) => {
                    assert!(m.contains(want), "{m:?} should say {want:?}");
                    assert!(m.contains("server-1.ckpt"), "{m:?} names the file");
                }
                other => panic!("{want}: {other:?}"),
            }
        }
        std::fs::remove_dir_all(&d).unwrap();
    }

    fn listing(d: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_failed_write_removes_its_temporary_file_and_keeps_the_previous_checkpoint() {
        let d = dir();
        let p = path(&d, 1);
        let c = sample();
        save(&p, &c).unwrap();
        // The disk fills up halfway through the write.
        let e = write_atomic_with(&p, |f| {
            f.write_all(b"FALCONCK partial")?;
            assert!(temp_path(&p).exists(), "written through the temporary file");
            Err(std::io::Error::new(
                std::io::ErrorKind::StorageFull,
                "No space left on device",
            ))
        })
        .unwrap_err();
        match &e {
            Error::Checkpoint(m) => {
                assert!(m.contains("write") && m.contains("No space left"), "{m}");
                assert!(m.contains("server-1.ckpt"), "{m} names the file");
            }
            other => panic!("{other}"),
        }
        assert_eq!(listing(&d), ["server-1.ckpt"], "no temporary file is left");
        assert_eq!(
            load(&d, 1, 7, 2).unwrap(),
            Some(c),
            "the previous one is intact"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_failed_rename_removes_its_temporary_file() {
        // Fails for root too: a file cannot be renamed over a non-empty directory.
        let d = dir();
        let p = path(&d, 1);
        std::fs::create_dir_all(p.join("blocker")).unwrap();
        let e = save(&p, &sample()).unwrap_err().to_string();
        assert!(
            e.contains("rename into place") && e.contains("server-1.ckpt"),
            "{e}"
        );
        assert_eq!(listing(&d), ["server-1.ckpt"], "no temporary file is left");
        assert!(p.is_dir());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_checkpoint_directory_replaced_by_a_file_is_a_typed_error() {
        let d = dir();
        std::fs::create_dir_all(&d).unwrap();
        let gone = d.join("ckpt");
        std::fs::write(&gone, b"not a directory").unwrap();
        match save(&path(&gone, 0), &sample()) {
            Err(Error::Checkpoint(m)) => {
                assert!(m.contains("create the directory of"), "{m}");
                assert!(m.contains("server-0.ckpt"), "{m}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(listing(&d), ["ckpt"], "nothing is left behind");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn the_scheduler_counts_each_servers_failures_and_stops_when_told() {
        use OnCheckpointFailure::{Stop, Warn};
        let mut seen = Vec::new();
        let full = || "write server-1.ckpt: No space left on device".to_string();
        assert!(failure_reported(Warn, &mut seen, 1, 1, full()).is_none());
        assert!(failure_reported(Warn, &mut seen, 0, 1, "gone".into()).is_none());
        assert!(failure_reported(Warn, &mut seen, 1, 2, full()).is_none());
        assert_eq!(seen, [(0, 1, "gone".to_string()), (1, 2, full())]);
        // A restarted server counts from 1 again; the job's count goes on.
        failure_reported(Warn, &mut seen, 1, 1, full());
        assert_eq!(seen[1].1, 3);
        match failure_reported(Stop, &mut seen, 0, 2, "gone".into()) {
            Some(
                e @ Error::CheckpointFailed {
                    rank: 0,
                    failures: 2,
                    ..
                },
            ) => {
                let m = e.to_string();
                assert!(
                    m.contains("server 0") && m.contains("gone") && m.contains("stopped"),
                    "{m}"
                );
            }
            other => panic!("{other:?}"),
        }
        assert_eq!("warn".parse::<OnCheckpointFailure>().unwrap(), Warn);
        assert_eq!(" Stop ".parse::<OnCheckpointFailure>().unwrap(), Stop);
        let e = "ignore"
            .parse::<OnCheckpointFailure>()
            .unwrap_err()
            .to_string();
        assert!(e.contains("'ignore'") && e.contains("warn, stop"), "{e}");
        assert_eq!(OnCheckpointFailure::default(), Warn);
    }

    #[test]
    fn a_checkpoint_of_another_job_or_shape_is_refused() {
        let d = dir();
        save(&path(&d, 1), &sample()).unwrap();
        let e = load(&d, 1, 8, 2).unwrap_err().to_string();
        assert!(e.contains("another job"), "{e}");
        let e = load(&d, 1, 7, 3).unwrap_err().to_string();
        assert!(e.contains("of 2 workers"), "{e}");
        // A body whose per-worker vectors disagree with `workers` (checksum recomputed).
        let mut c = sample();
        c.shards[0].clocks.push(1);
        save(&path(&d, 1), &c).unwrap();
        let e = load(&d, 1, 7, 2).unwrap_err().to_string();
        assert!(e.contains("not for 2 workers"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
