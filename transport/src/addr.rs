//! Peer addresses and media.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;

use crate::error::Error;

/// A medium, or `Auto` to let falcon choose (same host → shm, else rdma if available, else tcp).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Medium {
    /// Choose by peer location.
    #[default]
    Auto,
    /// Shared memory (same host only).
    Shm,
    /// TCP.
    Tcp,
    /// RDMA verbs (feature `rdma`).
    Rdma,
}

impl Medium {
    /// The medium's name as used in configuration.
    pub fn name(self) -> &'static str {
        match self {
            Medium::Auto => "auto",
            Medium::Shm => "shm",
            Medium::Tcp => "tcp",
            Medium::Rdma => "rdma",
        }
    }
}

impl fmt::Display for Medium {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Medium {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "auto" => Medium::Auto,
            "shm" => Medium::Shm,
            "tcp" => Medium::Tcp,
            "rdma" => Medium::Rdma,
            other => {
                return Err(Error::Config(format!(
                    "unknown medium {other:?} (auto, shm, tcp, rdma)"
                )));
            }
        })
    }
}

/// Where a transport can be reached: its host identity, its advertised tcp address and, for
/// peers on the same host, its Unix socket. The text form (`Display`/`FromStr`) is
/// `host=H;tcp=IP:PORT;shm=/path`, each part optional but `host`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PeerAddr {
    /// Host identity (hostname and boot id): equal for processes sharing a kernel.
    pub host: String,
    /// Advertised tcp address.
    pub tcp: Option<SocketAddr>,
    /// Unix socket for shm peers.
    pub shm: Option<PathBuf>,
}

impl fmt::Display for PeerAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "host={}", self.host)?;
        if let Some(t) = self.tcp {
            write!(f, ";tcp={t}")?;
        }
        if let Some(p) = &self.shm {
            write!(f, ";shm={}", p.display())?;
        }
        Ok(())
    }
}

impl FromStr for PeerAddr {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        let (mut host, mut tcp, mut shm) = (None, None, None);
        for part in s.split(';').filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').ok_or_else(|| {
                Error::Config(format!("peer address part `{part}` is not key=value"))
            })?;
            match k {
                "host" => host = Some(v.to_string()),
                "tcp" => {
                    tcp = Some(
                        v.parse()
                            .map_err(|e| Error::Config(format!("peer tcp address `{v}`: {e}")))?,
                    )
                }
                "shm" => shm = Some(PathBuf::from(v)),
                _ => {
                    return Err(Error::Config(format!(
                        "unknown peer address key `{k}` (host, tcp, shm)"
                    )));
                }
            }
        }
        let host = host.ok_or_else(|| Error::Config(format!("peer address `{s}` has no host=")))?;
        if tcp.is_none() && shm.is_none() {
            return Err(Error::Config(format!(
                "peer address `{s}` names neither tcp= nor shm="
            )));
        }
        Ok(PeerAddr { host, tcp, shm })
    }
}

/// This host's identity: hostname plus the kernel boot id, so two containers that share a
/// hostname but not a kernel are told apart.
pub fn host_id() -> String {
    let uname = rustix::system::uname();
    let name = uname.nodename().to_string_lossy().into_owned();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let boot: String = boot.trim().chars().filter(|c| *c != '-').take(12).collect();
    format!("{name}-{boot}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_addr_round_trips() {
        let a = PeerAddr {
            host: "n1-abc".into(),
            tcp: Some("10.0.0.1:9000".parse().unwrap()),
            shm: Some("/run/falcon/x.sock".into()),
        };
        assert_eq!(a.to_string().parse::<PeerAddr>().unwrap(), a);
        assert!(
            "tcp=1.2.3.4:5".parse::<PeerAddr>().is_err(),
            "host is required"
        );
        assert!(
            "host=x".parse::<PeerAddr>().is_err(),
            "some medium is required"
        );
        assert!("host=x;tcp=nope".parse::<PeerAddr>().is_err());
        assert!("host=x;bogus=1".parse::<PeerAddr>().is_err());
        assert_eq!("TCP".parse::<Medium>().unwrap(), Medium::Tcp);
        assert!("carrier-pigeon".parse::<Medium>().is_err());
    }
}
