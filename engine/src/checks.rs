//! Checks of a job's setting values, shared by [`crate::launch`] (the environment of a role)
//! and the `falcon` command line (its flags and configuration file): each value on its own,
//! and the values that only make sense together (a policy and the worker count, a suspicion
//! timeout and the heartbeat interval).
//!
//! Every refusal says what is wrong and what is allowed.

use std::time::Duration;

use crate::sync::PolicySpec;

/// A value refused on its own.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadValue {
    /// Not a number of the kind asked for.
    #[error("not {kind}")]
    NotANumber {
        /// What was expected, e.g. "a number".
        kind: &'static str,
    },
    /// A number out of its range.
    #[error("{what} must be {allowed}; {value} is not")]
    OutOfRange {
        /// What the number is.
        what: &'static str,
        /// Its allowed range, in words.
        allowed: &'static str,
        /// The value given.
        value: String,
    },
}

/// `s` (trimmed) read as a number of type `T`; `kind` says what was expected when it is not
/// one, e.g. "a whole number".
pub fn number<T: std::str::FromStr>(s: &str, kind: &'static str) -> Result<T, BadValue> {
    s.trim().parse().map_err(|_| BadValue::NotANumber { kind })
}

/// A learning rate: finite and > 0.
pub fn learning_rate(s: &str) -> Result<f32, BadValue> {
    let lr: f32 = number(s, "a number")?;
    if lr.is_finite() && lr > 0.0 {
        Ok(lr)
    } else {
        Err(BadValue::OutOfRange {
            what: "the learning rate",
            allowed: "a finite number greater than 0 (e.g. 0.05)",
            value: s.trim().to_string(),
        })
    }
}

/// A count of at least 1 (iterations, threads, workers, servers, batch, tasks, runs).
pub fn at_least_one_u64(s: &str) -> Result<u64, BadValue> {
    let n: u64 = number(s, "a whole number")?;
    if n >= 1 {
        Ok(n)
    } else {
        Err(BadValue::OutOfRange {
            what: "the count",
            allowed: "at least 1",
            value: s.trim().to_string(),
        })
    }
}

/// [`at_least_one_u64`] as a `u32`.
pub fn at_least_one_u32(s: &str) -> Result<u32, BadValue> {
    let n = at_least_one_u64(s)?;
    u32::try_from(n).map_err(|_| BadValue::OutOfRange {
        what: "the count",
        allowed: "between 1 and 4294967295",
        value: s.trim().to_string(),
    })
}

/// [`at_least_one_u64`] as a `usize`.
pub fn at_least_one_usize(s: &str) -> Result<usize, BadValue> {
    let n = at_least_one_u64(s)?;
    usize::try_from(n).map_err(|_| BadValue::OutOfRange {
        what: "the count",
        allowed: "a count this machine can address",
        value: s.trim().to_string(),
    })
}

/// A largest shard in bytes: at least 4 (one float).
pub fn shard_bytes(s: &str) -> Result<u64, BadValue> {
    let n: u64 = number(s, "a whole number of bytes")?;
    if n >= 4 {
        Ok(n)
    } else {
        Err(BadValue::OutOfRange {
            what: "the largest shard",
            allowed: "at least 4 bytes (one float)",
            value: format!("{n} bytes"),
        })
    }
}

/// A whole number ≥ 0 (a seed).
pub fn whole(s: &str) -> Result<u64, BadValue> {
    number(s, "a whole number ≥ 0")
}

/// The smallest heartbeat interval accepted.
pub const MIN_HEARTBEAT_MS: u64 = 10;

/// A heartbeat interval in milliseconds: at least [`MIN_HEARTBEAT_MS`].
pub fn heartbeat_ms(s: &str) -> Result<u64, BadValue> {
    let ms: u64 = number(s, "a whole number of milliseconds")?;
    if ms >= MIN_HEARTBEAT_MS {
        Ok(ms)
    } else {
        Err(BadValue::OutOfRange {
            what: "the heartbeat interval",
            allowed: "at least 10 ms",
            value: format!("{ms} ms"),
        })
    }
}

/// A checkpoint interval in milliseconds: at least 10.
pub fn checkpoint_ms(s: &str) -> Result<u64, BadValue> {
    let ms: u64 = number(s, "a whole number of milliseconds")?;
    if ms >= 10 {
        Ok(ms)
    } else {
        Err(BadValue::OutOfRange {
            what: "the checkpoint interval",
            allowed: "at least 10 ms",
            value: format!("{ms} ms"),
        })
    }
}

/// A timeout in milliseconds: at least 1 (0 would fail every wait at once).
pub fn timeout_ms(s: &str) -> Result<u64, BadValue> {
    let ms: u64 = number(s, "a whole number of milliseconds")?;
    if ms >= 1 {
        Ok(ms)
    } else {
        Err(BadValue::OutOfRange {
            what: "a timeout",
            allowed: "at least 1 ms (0 would give up at once)",
            value: "0 ms".into(),
        })
    }
}

/// How long a hand-off spins before it parks, in microseconds: 0 (park at once) to 10 000.
pub fn spin_us(s: &str) -> Result<u64, BadValue> {
    let us: u64 = number(s, "a whole number of microseconds")?;
    if us <= 10_000 {
        Ok(us)
    } else {
        Err(BadValue::OutOfRange {
            what: "a spin",
            allowed: "0 to 10000 µs (longer burns a core for nothing)",
            value: format!("{us} µs"),
        })
    }
}

// The bound `helper_threads` names in its refusal.
const _: () = assert!(falcon_transport::spread::MAX_HELPERS == 16);

/// A number of helper threads: 0 to [`falcon_transport::spread::MAX_HELPERS`].
pub fn helper_threads(s: &str) -> Result<usize, BadValue> {
    let n: usize = number(s, "a whole number of threads")?;
    let most = falcon_transport::spread::MAX_HELPERS;
    if n <= most {
        Ok(n)
    } else {
        Err(BadValue::OutOfRange {
            what: "a number of helper threads",
            allowed: "0 to 16",
            value: n.to_string(),
        })
    }
}

// The bound `tcp_streams` names in its refusal.
const _: () = assert!(falcon_transport::MAX_TCP_STREAMS == 8);

/// A number of TCP connections per link: 1 to [`falcon_transport::MAX_TCP_STREAMS`].
pub fn tcp_streams(s: &str) -> Result<u32, BadValue> {
    let n: u32 = number(s, "a whole number of connections")?;
    if (1..=falcon_transport::MAX_TCP_STREAMS).contains(&n) {
        Ok(n)
    } else {
        Err(BadValue::OutOfRange {
            what: "a number of tcp connections per link",
            allowed: "1 to 8",
            value: n.to_string(),
        })
    }
}

/// A suspicion timeout in milliseconds; 0 means never.
pub fn suspicion_ms(s: &str) -> Result<u64, BadValue> {
    number(s, "a whole number of milliseconds (0: never)")
}

/// A TCP port: a whole number from 0 to 65535.
pub fn port(s: &str) -> Result<u16, BadValue> {
    number(s, "a port (a whole number from 0 to 65535)")
}

/// Values that are wrong together.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Conflict {
    /// Sync-opt with as many backups as workers or more.
    #[error(
        "policy {policy} with {workers} worker(s): the backups must be fewer than the workers \
         (0 to {max}), since the first workers − backups gradients of each step count"
    )]
    Backups {
        /// The policy as given.
        policy: String,
        /// Its backups.
        backups: u32,
        /// The job's workers.
        workers: u32,
        /// The most backups allowed.
        max: u32,
    },
    /// A job without a server or without a worker.
    #[error("{workers} worker(s) and {servers} server(s): a job needs at least one of each")]
    NoRoles {
        /// The job's servers.
        servers: u32,
        /// The job's workers.
        workers: u32,
    },
    /// A suspicion timeout not longer than the heartbeat interval.
    #[error(
        "suspicion timeout {suspicion_ms} ms with heartbeats every {heartbeat_ms} ms: the \
         suspicion timeout must be longer than the heartbeat interval (a few intervals, \
         e.g. {suggest} ms), or 0 to never declare a silent role dead"
    )]
    Suspicion {
        /// The suspicion timeout.
        suspicion_ms: u64,
        /// The heartbeat interval.
        heartbeat_ms: u64,
        /// A sensible value.
        suggest: u64,
    },
}

/// A job has at least one server and one worker.
pub fn roles_fit(servers: u32, workers: u32) -> Result<(), Conflict> {
    if servers == 0 || workers == 0 {
        return Err(Conflict::NoRoles { servers, workers });
    }
    Ok(())
}

/// Sync-opt's backups must be fewer than the workers (the engine would otherwise quietly
/// use workers − 1). `text` is the policy as given, for the message.
pub fn policy_fits(policy: &PolicySpec, text: &str, workers: u32) -> Result<(), Conflict> {
    if let PolicySpec::SyncOpt { backups, .. } = *policy
        && backups >= workers
    {
        return Err(Conflict::Backups {
            policy: text.trim().to_string(),
            backups,
            workers,
            max: workers.saturating_sub(1),
        });
    }
    Ok(())
}

/// A suspicion timeout (`None`: never) must be longer than the heartbeat interval.
pub fn suspicion_fits(heartbeat: Duration, suspicion: Option<Duration>) -> Result<(), Conflict> {
    if let Some(s) = suspicion
        && s <= heartbeat
    {
        let hb = heartbeat.as_millis() as u64;
        return Err(Conflict::Suspicion {
            suspicion_ms: s.as_millis() as u64,
            heartbeat_ms: hb,
            suggest: (hb * 5).max(1000),
        });
    }
    Ok(())
}

/// The workers a `RANKS` text names, for a job of `workers`: a rank `N`, a range `A-B`
/// (inclusive) or `*` (every worker), as `(first, last)`. Shared by every per-worker setting
/// (`FALCON_HETERO`'s entries, CPU quotas); the error says what is wrong.
pub fn worker_ranks(ranks: &str, workers: u32) -> Result<(u32, u32), String> {
    let rank = |text: &str| -> Result<u32, String> {
        text.trim().parse::<u32>().map_err(|_| {
            format!(
                "`{}` is not a worker rank (a whole number, a range A-B or *)",
                text.trim()
            )
        })
    };
    let (lo, hi) = match ranks.trim() {
        "*" => (0, workers.saturating_sub(1)),
        r => match r.split_once('-') {
            Some((a, b)) => (rank(a)?, rank(b)?),
            None => {
                let n = rank(r)?;
                (n, n)
            }
        },
    };
    if lo > hi {
        return Err(format!(
            "the range {lo}-{hi} is empty (write A-B with A ≤ B)"
        ));
    }
    if workers == 0 || hi >= workers {
        return Err(format!(
            "worker {hi} is out of range: this job has {workers} worker(s), ranks 0 to {}",
            workers.saturating_sub(1)
        ));
    }
    Ok((lo, hi))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn learning_rates_must_be_finite_and_positive() {
        assert_eq!(learning_rate("0.05").unwrap(), 0.05);
        assert_eq!(learning_rate(" 0.5 ").unwrap(), 0.5);
        for bad in ["nan", "NaN", "inf", "-inf", "0", "-0.1"] {
            let e = learning_rate(bad).unwrap_err().to_string();
            assert_eq!(
                e,
                format!(
                    "the learning rate must be a finite number greater than 0 (e.g. 0.05); {bad} is not"
                )
            );
        }
        assert_eq!(learning_rate("x").unwrap_err().to_string(), "not a number");
    }

    #[test]
    fn counts_timeouts_heartbeats_and_ports() {
        assert!(at_least_one_u64("0").is_err());
        assert_eq!(at_least_one_u32("3").unwrap(), 3);
        assert!(at_least_one_u32("4294967296").is_err());
        assert_eq!(at_least_one_usize("7").unwrap(), 7);
        assert_eq!(
            heartbeat_ms("9").unwrap_err().to_string(),
            "the heartbeat interval must be at least 10 ms; 9 ms is not"
        );
        assert_eq!(heartbeat_ms("10").unwrap(), 10);
        assert_eq!(
            timeout_ms("0").unwrap_err().to_string(),
            "a timeout must be at least 1 ms (0 would give up at once); 0 ms is not"
        );
        assert_eq!(suspicion_ms("0").unwrap(), 0);
        assert_eq!(checkpoint_ms("10").unwrap(), 10);
        assert!(checkpoint_ms("9").is_err());
        assert_eq!(shard_bytes("4").unwrap(), 4);
        assert!(shard_bytes("3").is_err());
        assert_eq!(whole("0").unwrap(), 0);
        assert_eq!(port("9000").unwrap(), 9000);
        assert_eq!(
            port("65536").unwrap_err().to_string(),
            "not a port (a whole number from 0 to 65535)"
        );
    }

    #[test]
    fn syncopt_backups_must_be_fewer_than_the_workers() {
        let p: PolicySpec = "syncopt(10)".parse().unwrap();
        let e = policy_fits(&p, "syncopt(10)", 4).unwrap_err().to_string();
        assert!(e.contains("syncopt(10) with 4 worker(s)"), "{e}");
        assert!(e.contains("fewer than the workers (0 to 3)"), "{e}");
        assert!(policy_fits(&p, "syncopt(10)", 11).is_ok());
        let p: PolicySpec = "syncopt(3)".parse().unwrap();
        assert!(policy_fits(&p, "syncopt(3)", 4).is_ok());
        assert!(policy_fits(&p, "syncopt(3)", 3).is_err());
    }

    #[test]
    fn a_suspicion_timeout_must_outlast_the_heartbeat() {
        let hb = Duration::from_millis(1000);
        let e = suspicion_fits(hb, Some(Duration::from_millis(500)))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(
                "must be longer than the heartbeat interval (a few intervals, e.g. 5000 ms)"
            ),
            "{e}"
        );
        assert!(suspicion_fits(hb, None).is_ok());
        assert!(suspicion_fits(hb, Some(Duration::from_millis(1001))).is_ok());
    }
}
