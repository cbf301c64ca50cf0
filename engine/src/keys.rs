//! Keys: named tensors cut into shards and placed on servers.
//!
//! Every server works: a tensor is cut into at least one slice per server (slices of at least
//! [`MIN_SLICE_BYTES`], so a tiny tensor stays whole) and into slices of at most the largest
//! shard size, as ps-lite splits every request over all servers. Placement is by size,
//! least-loaded first, and deterministic: the same tensors and server count give the same map
//! on every process. Round-robin placement is the hot-spot complaint users of TF and BytePS
//! file most; placing the biggest shards first on the least-loaded server keeps the bytes per
//! server within one shard of each other.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::precision::Wire;

/// Default largest shard: 4 MiB.
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 4 << 20;

/// The smallest slice a tensor is cut into to spread it over the servers: 16 KiB. A tensor
/// under two such slices stays whole (a shard's fixed costs — a message, an acknowledgement,
/// a meta block — would outweigh what its server adds).
pub const MIN_SLICE_BYTES: u64 = 16 << 10;

/// A named tensor of f32 values.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSpec {
    /// Unique name.
    pub name: String,
    /// Length in f32 elements.
    pub len: u64,
    /// Its own precision on the wire, where its values are 16-bit numbers held as f32 (a
    /// bfloat16 or float16 parameter: [`Wire::Bf16`], [`Wire::F16Native`]): its gradients
    /// and values then travel as 16 bits, exactly. `None`: the job's (`FALCON_WIRE`).
    pub wire: Option<Wire>,
}

impl TensorSpec {
    /// A tensor of `len` f32 values travelling in the job's precision.
    pub fn new(name: impl Into<String>, len: u64) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            len,
            wire: None,
        }
    }

    /// The precision its gradients and values travel in, in a job whose wire is `job`.
    pub fn wire_in(&self, job: Wire) -> Wire {
        self.wire.unwrap_or(job)
    }
}

/// One shard: a contiguous range of one tensor, owned by one server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardSpec {
    /// Global shard id (index into `KeyMap::shards`).
    pub id: u32,
    /// Index of its tensor in `KeyMap::tensors`.
    pub tensor: u32,
    /// First element within the tensor.
    pub offset: u64,
    /// Length in elements.
    pub len: u64,
    /// Owning server rank.
    pub server: u32,
}

impl ShardSpec {
    /// Length in bytes.
    pub fn bytes(&self) -> u64 {
        self.len * 4
    }
}

/// Every tensor and shard of a job.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyMap {
    /// The tensors, in registration order.
    pub tensors: Vec<TensorSpec>,
    /// The shards, grouped by tensor, in tensor order.
    pub shards: Vec<ShardSpec>,
    /// Number of servers.
    pub servers: u32,
}

impl KeyMap {
    /// Floats held by server `rank` (all its shards together).
    pub fn floats_on(&self, rank: u32) -> u64 {
        self.shards
            .iter()
            .filter(|s| s.server == rank)
            .map(|s| s.len)
            .sum()
    }

    /// The largest message server `rank` takes from an attached worker: twice a plain row
    /// index naming every float it holds (16 bytes a float), and never less than
    /// `control`, the cap on control messages. A row pull larger than this is refused by the
    /// worker before it goes; a peer that sends one anyway loses its link.
    pub fn worker_message_cap(&self, rank: u32, control: u64) -> u64 {
        control.max(
            self.floats_on(rank)
                .saturating_mul(16)
                .saturating_add(64 << 10),
        )
    }

    /// Checks a key map received from a peer: shard ids are their indices, every shard lies
    /// inside its tensor and on one of the `servers`, sizes fit in memory arithmetic, and the
    /// shards of each tensor cover it. A hostile or corrupt book is a typed error, never a
    /// panic later.
    pub fn validate(&self, servers: usize) -> Result<()> {
        let bad = |why: String| Err(Error::Config(format!("malformed key map: {why}")));
        if self.servers as usize != servers {
            return bad(format!(
                "{} servers in the key map, {servers} in the address book",
                self.servers
            ));
        }
        let mut covered = vec![0u64; self.tensors.len()];
        for (i, s) in self.shards.iter().enumerate() {
            let Some(t) = self.tensors.get(s.tensor as usize) else {
                return bad(format!("shard {i} names tensor {}", s.tensor));
            };
            let end = s.offset.checked_add(s.len);
            if s.id as usize != i
                || s.server as usize >= servers
                || s.len == 0
                || s.len > (u64::MAX >> 3)
                || end.is_none_or(|e| e > t.len)
                || s.offset != covered[s.tensor as usize]
            {
                return bad(format!("shard {i} ({s:?}) of tensor {:?}", t.name));
            }
            covered[s.tensor as usize] = s.offset + s.len;
        }
        if let Some((t, _)) = self
            .tensors
            .iter()
            .zip(&covered)
            .find(|(t, c)| t.len != **c)
        {
            return bad(format!("tensor {:?} is not covered by its shards", t.name));
        }
        Ok(())
    }

    /// Cuts `tensors` into shards of at most `max_shard_bytes`, each tensor into at least one
    /// slice per server where its slices stay at least [`MIN_SLICE_BYTES`], and places them on
    /// `servers`.
    pub fn plan(tensors: Vec<TensorSpec>, servers: u32, max_shard_bytes: u64) -> Result<KeyMap> {
        if servers == 0 {
            return Err(Error::Config("a job needs at least one server".into()));
        }
        if max_shard_bytes < 4 {
            return Err(Error::Config(
                "the largest shard must hold at least one float".into(),
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for t in &tensors {
            if t.len == 0 {
                return Err(Error::Config(format!("tensor {:?} is empty", t.name)));
            }
            if !seen.insert(&t.name) {
                return Err(Error::Config(format!(
                    "tensor {:?} is registered twice",
                    t.name
                )));
            }
        }
        let max_elems = max_shard_bytes / 4;
        let min_elems = (MIN_SLICE_BYTES / 4).min(max_elems);
        let mut shards = Vec::new();
        for (ti, t) in tensors.iter().enumerate() {
            // Near-equal pieces whose sizes differ by at most one: ceil(len / max) of them, or
            // one per server when that many pieces of at least the floor fit.
            let spread = (t.len / min_elems).clamp(1, u64::from(servers));
            let n = t.len.div_ceil(max_elems).max(spread);
            let (base, extra) = (t.len / n, t.len % n);
            let mut offset = 0;
            for k in 0..n {
                let len = base + u64::from(k < extra);
                shards.push(ShardSpec {
                    id: shards.len() as u32,
                    tensor: ti as u32,
                    offset,
                    len,
                    server: 0,
                });
                offset += len;
            }
        }
        // Biggest first (ties by id), each on the least-loaded server (ties by rank).
        let mut order: Vec<usize> = (0..shards.len()).collect();
        order.sort_by(|&a, &b| shards[b].len.cmp(&shards[a].len).then(a.cmp(&b)));
        let mut load = vec![0u64; servers as usize];
        for i in order {
            let (server, _) = load
                .iter()
                .enumerate()
                .min_by(|a, b| a.1.cmp(b.1).then(a.0.cmp(&b.0)))
                .expect("servers > 0");
            shards[i].server = server as u32;
            load[server] += shards[i].bytes();
        }
        Ok(KeyMap {
            tensors,
            shards,
            servers,
        })
    }

    /// Bytes of parameters each server holds.
    pub fn bytes_per_server(&self) -> Vec<u64> {
        let mut b = vec![0u64; self.servers as usize];
        for s in &self.shards {
            b[s.server as usize] += s.bytes();
        }
        b
    }

    /// The tensor index of `name`.
    pub fn tensor(&self, name: &str) -> Result<usize> {
        self.tensors
            .iter()
            .position(|t| t.name == name)
            .ok_or_else(|| Error::UnknownTensor(name.to_string()))
    }

    /// The shards of tensor `t`, in order.
    pub fn shards_of(&self, t: usize) -> impl Iterator<Item = &ShardSpec> {
        self.shards.iter().filter(move |s| s.tensor as usize == t)
    }

    /// The shards owned by `server`, in id order.
    pub fn shards_on(&self, server: u32) -> impl Iterator<Item = &ShardSpec> {
        self.shards.iter().filter(move |s| s.server == server)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_received_key_map_is_validated() {
        let tensors = vec![TensorSpec::new("w", 1000), TensorSpec::new("b", 10)];
        let good = KeyMap::plan(tensors, 2, 1024).unwrap();
        good.validate(2).unwrap();
        assert!(
            good.validate(3).is_err(),
            "server count must agree with the book"
        );
        let broken: [fn(&mut KeyMap); 6] = [
            |k| k.shards[0].server = 7,
            |k| k.shards[1].id = 0,
            |k| k.shards[0].offset = 1,
            |k| k.shards[0].len = u64::MAX,
            |k| k.shards[0].tensor = 9,
            |k| {
                k.shards.pop();
            },
        ];
        for (n, f) in broken.iter().enumerate() {
            let mut k = good.clone();
            f(&mut k);
            let e = k.validate(2).unwrap_err();
            assert!(e.to_string().contains("malformed key map"), "case {n}: {e}");
        }
    }

    fn t(name: &str, len: u64) -> TensorSpec {
        TensorSpec::new(name, len)
    }

    #[test]
    fn shards_cover_every_element_once_and_respect_the_limit() {
        let map = KeyMap::plan(
            vec![t("a", 1_000_003), t("b", 7), t("c", 2_500_000)],
            3,
            1 << 20,
        )
        .unwrap();
        for (ti, tensor) in map.tensors.iter().enumerate() {
            let mut next = 0;
            for s in map.shards_of(ti) {
                assert_eq!(s.offset, next, "contiguous");
                assert!(s.bytes() <= 1 << 20);
                next += s.len;
            }
            assert_eq!(next, tensor.len, "covers the tensor");
        }
        assert_eq!(
            map.bytes_per_server().iter().sum::<u64>(),
            (1_000_003 + 7 + 2_500_000) * 4
        );
    }

    #[test]
    fn placement_is_balanced_and_deterministic() {
        let tensors: Vec<_> = (0..20)
            .map(|i| t(&format!("w{i}"), 1000 + i * 37_000))
            .collect();
        let a = KeyMap::plan(tensors.clone(), 4, 1 << 20).unwrap();
        let b = KeyMap::plan(tensors, 4, 1 << 20).unwrap();
        assert_eq!(a, b, "deterministic");
        let loads = a.bytes_per_server();
        let biggest = a.shards.iter().map(|s| s.bytes()).max().unwrap();
        let (lo, hi) = (loads.iter().min().unwrap(), loads.iter().max().unwrap());
        assert!(
            hi - lo <= biggest,
            "greedy by size keeps servers within one shard: {loads:?}"
        );
    }

    #[test]
    fn one_big_tensor_is_spread_over_every_server() {
        // The round-robin failure mode: one large tensor on one server.
        let map = KeyMap::plan(vec![t("embedding", 16 << 20), t("bias", 10)], 4, 4 << 20).unwrap();
        assert!(
            map.bytes_per_server().iter().all(|&b| b >= 15 << 20),
            "{:?}",
            map.bytes_per_server()
        );
    }

    #[test]
    fn every_server_holds_a_share_of_a_small_model() {
        // The default `falcon train` model: 203 530 floats (814 KB), under one 4 MiB shard.
        let map = KeyMap::plan(vec![t("params", 203_530)], 2, 4 << 20).unwrap();
        assert_eq!(map.bytes_per_server(), vec![407_060, 407_060]);
        let map = KeyMap::plan(vec![t("params", 203_530)], 3, 4 << 20).unwrap();
        let b = map.bytes_per_server();
        assert!(b.iter().all(|&x| x >= 271_372), "{b:?}");
        // A tensor under two slices of the floor stays whole.
        let tiny = KeyMap::plan(vec![t("bias", 10), t("w", 4096)], 4, 4 << 20).unwrap();
        assert_eq!(tiny.shards.len(), 2);
        // Between: as many slices of at least the floor as fit, up to one per server.
        let mid = KeyMap::plan(vec![t("w", 3 * 4096 + 5)], 8, 4 << 20).unwrap();
        assert_eq!(mid.shards.len(), 3);
        assert!(mid.shards.iter().all(|s| s.bytes() >= MIN_SLICE_BYTES));
        let servers: std::collections::HashSet<u32> = mid.shards.iter().map(|s| s.server).collect();
        assert_eq!(servers.len(), 3, "each slice on its own server");
    }

    #[test]
    fn bad_specs_are_refused() {
        assert!(KeyMap::plan(vec![t("a", 1)], 0, 1024).is_err());
        assert!(KeyMap::plan(vec![t("a", 0)], 1, 1024).is_err());
        assert!(KeyMap::plan(vec![t("a", 1), t("a", 2)], 1, 1024).is_err());
        let map = KeyMap::plan(vec![t("a", 1)], 1, 1024).unwrap();
        assert!(matches!(map.tensor("nope"), Err(Error::UnknownTensor(_))));
    }
}
