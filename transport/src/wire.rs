//! Wire formats: the tcp frame header and the shm control packet.
//!
//! Both are `#[repr(C)]` little-endian structs read and written with zerocopy: no parsing
//! code, no unaligned reads, and a decoder that validates every field before use.

use zerocopy::byteorder::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use crate::error::{Error, Result};

/// "FLCN" as a little-endian u32.
pub(crate) const MAGIC: u32 = u32::from_le_bytes(*b"FLCN");
/// Version of the wire protocol; bumped on any incompatible change.
pub(crate) const VERSION: u16 = 2;

/// Operations of a tcp frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub(crate) enum Op {
    /// Connection opener: `region` = job id, `offset` = node id, `imm` = the medium asked
    /// for; the payload is the sender's nonce (see `handshake`).
    Hello = 1,
    /// One-sided write: payload of `len` bytes into (`region`, `offset`); `imm` if flagged.
    Write = 2,
    /// Two-sided control message of `len` bytes.
    Send = 3,
    /// One-sided read request: `len` bytes at (`region`, `offset`), answered under `req`.
    ReadReq = 4,
    /// Read response: `len` bytes for request `req`.
    ReadResp = 5,
    /// The peer refuses something: `len` bytes of UTF-8 reason; `req` if it answers a read.
    Error = 6,
    /// Orderly close.
    Bye = 7,
    /// The handshake's proof that the sender knows the job token (see `handshake`).
    Proof = 8,
}

impl Op {
    fn from_u16(v: u16) -> Option<Op> {
        Some(match v {
            1 => Op::Hello,
            2 => Op::Write,
            3 => Op::Send,
            4 => Op::ReadReq,
            5 => Op::ReadResp,
            6 => Op::Error,
            7 => Op::Bye,
            8 => Op::Proof,
            _ => return None,
        })
    }
}

impl Op {
    /// The op's name, for messages.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Op::Hello => "hello",
            Op::Write => "write",
            Op::Send => "send",
            Op::ReadReq => "read request",
            Op::ReadResp => "read response",
            Op::Error => "error",
            Op::Bye => "goodbye",
            Op::Proof => "proof",
        }
    }
}

/// Frame flag: the write carries an immediate.
pub(crate) const FLAG_IMM: u32 = 1;

/// A tcp frame header (48 bytes), followed by `len` payload bytes for ops that carry one.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub(crate) struct FrameHeader {
    pub(crate) magic: U32,
    pub(crate) version: U16,
    pub(crate) op: U16,
    pub(crate) imm: U32,
    pub(crate) flags: U32,
    pub(crate) region: U64,
    pub(crate) offset: U64,
    pub(crate) len: U64,
    pub(crate) req: U64,
}

pub(crate) const FRAME_HEADER: usize = std::mem::size_of::<FrameHeader>();

impl FrameHeader {
    pub(crate) fn new(op: Op) -> FrameHeader {
        FrameHeader {
            magic: MAGIC.into(),
            version: VERSION.into(),
            op: (op as u16).into(),
            imm: 0.into(),
            flags: 0.into(),
            region: 0.into(),
            offset: 0.into(),
            len: 0.into(),
            req: 0.into(),
        }
    }

    /// Decodes and validates magic, version, op and flags.
    pub(crate) fn decode(raw: &[u8; FRAME_HEADER]) -> Result<(Op, FrameHeader)> {
        let h = FrameHeader::read_from_bytes(raw).expect("exact size");
        if h.magic.get() != MAGIC {
            return Err(Error::Malformed(format!(
                "frame magic {:#010x}",
                h.magic.get()
            )));
        }
        if h.version.get() != VERSION {
            return Err(Error::Version {
                theirs: h.version.get(),
                ours: VERSION,
            });
        }
        let op = Op::from_u16(h.op.get())
            .ok_or_else(|| Error::Malformed(format!("frame op {}", h.op.get())))?;
        if h.flags.get() & !FLAG_IMM != 0 || (h.flags.get() != 0 && op != Op::Write) {
            return Err(Error::Malformed(format!(
                "frame flags {:#x} on a {} frame",
                h.flags.get(),
                op.name()
            )));
        }
        Ok((op, h))
    }
}

/// Operations of an shm control packet (over the SOCK_SEQPACKET Unix socket).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub(crate) enum CtlOp {
    /// fds: [inbound ring, doorbell]; `a` = job, `b` = node id, `c` = ring capacity.
    Hello = 1,
    /// fds: [region]; `a` = region id, `b` = length.
    Grant = 2,
    /// `a` = region id.
    GrantAck = 3,
    /// `a` = region id.
    Revoke = 4,
    /// The peer refuses the connection; `a` = its job id.
    Refuse = 5,
    /// Orderly close.
    Bye = 6,
    /// fds: [message]; `a` = blob id, `b` = length. A control message too large for the ring;
    /// acknowledged with `GrantAck`, then named in the ring by a `KIND_BLOB` record.
    Blob = 7,
}

impl CtlOp {
    fn from_u16(v: u16) -> Option<CtlOp> {
        Some(match v {
            1 => CtlOp::Hello,
            2 => CtlOp::Grant,
            3 => CtlOp::GrantAck,
            4 => CtlOp::Revoke,
            5 => CtlOp::Refuse,
            6 => CtlOp::Bye,
            7 => CtlOp::Blob,
            _ => return None,
        })
    }

    /// How many descriptors a packet of this op must carry.
    pub(crate) fn fds(self) -> usize {
        match self {
            CtlOp::Hello => 2,
            CtlOp::Grant | CtlOp::Blob => 1,
            _ => 0,
        }
    }
}

/// An shm control packet (40 bytes).
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub(crate) struct CtlPacket {
    pub(crate) magic: U32,
    pub(crate) version: U16,
    pub(crate) op: U16,
    pub(crate) a: U64,
    pub(crate) b: U64,
    pub(crate) c: U64,
    pub(crate) reserved: U64,
}

pub(crate) const CTL_PACKET: usize = std::mem::size_of::<CtlPacket>();

impl CtlPacket {
    pub(crate) fn new(op: CtlOp, a: u64, b: u64, c: u64) -> CtlPacket {
        CtlPacket {
            magic: MAGIC.into(),
            version: VERSION.into(),
            op: (op as u16).into(),
            a: a.into(),
            b: b.into(),
            c: c.into(),
            reserved: 0.into(),
        }
    }

    /// Decodes a packet of exactly `CTL_PACKET` bytes carrying `nfds` descriptors.
    pub(crate) fn decode(raw: &[u8], nfds: usize) -> Result<(CtlOp, CtlPacket)> {
        let p = CtlPacket::read_from_bytes(raw).map_err(|_| {
            Error::Malformed(format!(
                "control packet of {} bytes, expected {CTL_PACKET}",
                raw.len()
            ))
        })?;
        if p.magic.get() != MAGIC {
            return Err(Error::Malformed(format!(
                "control packet magic {:#010x}",
                p.magic.get()
            )));
        }
        if p.version.get() != VERSION {
            return Err(Error::Version {
                theirs: p.version.get(),
                ours: VERSION,
            });
        }
        let op = CtlOp::from_u16(p.op.get())
            .ok_or_else(|| Error::Malformed(format!("control packet op {}", p.op.get())))?;
        if op.fds() != nfds {
            return Err(Error::Malformed(format!(
                "{op:?} packet with {nfds} descriptors, expected {}",
                op.fds()
            )));
        }
        Ok((op, p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_header_round_trips_and_rejects_garbage() {
        let mut h = FrameHeader::new(Op::Write);
        h.len = (5u64 << 32).into();
        h.flags = FLAG_IMM.into();
        let raw: [u8; FRAME_HEADER] = h.as_bytes().try_into().unwrap();
        let (op, back) = FrameHeader::decode(&raw).unwrap();
        assert_eq!(op, Op::Write);
        assert_eq!(back.len.get(), 5u64 << 32, "lengths are u64 on the wire");

        let mut bad = raw;
        bad[0] ^= 1;
        assert!(matches!(
            FrameHeader::decode(&bad),
            Err(Error::Malformed(_))
        ));
        let mut bad = raw;
        bad[4] = 9;
        assert!(matches!(
            FrameHeader::decode(&bad),
            Err(Error::Version { theirs: 9, .. })
        ));
        let mut bad = raw;
        bad[6] = 200;
        assert!(matches!(
            FrameHeader::decode(&bad),
            Err(Error::Malformed(_))
        ));
        let mut h2 = FrameHeader::new(Op::Send);
        h2.flags = FLAG_IMM.into();
        let raw2: [u8; FRAME_HEADER] = h2.as_bytes().try_into().unwrap();
        assert!(
            FrameHeader::decode(&raw2).is_err(),
            "imm flag only on writes"
        );
    }

    #[test]
    fn random_headers_never_panic() {
        let mut rng = fastrand::Rng::with_seed(7);
        for _ in 0..100_000 {
            let mut raw = [0u8; FRAME_HEADER];
            rng.fill(&mut raw);
            if rng.bool() {
                raw[..4].copy_from_slice(&MAGIC.to_le_bytes());
                raw[4..6].copy_from_slice(&VERSION.to_le_bytes());
            }
            let _ = FrameHeader::decode(&raw);
            let n = rng.usize(0..=CTL_PACKET + 4);
            let _ = CtlPacket::decode(&raw[..n.min(FRAME_HEADER)], rng.usize(0..3));
        }
    }
}
