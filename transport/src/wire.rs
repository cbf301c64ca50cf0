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
pub(crate) const VERSION: u16 = 3;

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
    /// A piece of a split write, on any connection of a link: `len` bytes into (`region`,
    /// `offset`); `req` = the split write's id (see [`FLAG_PARTS`]).
    Part = 9,
    /// On a link's first connection, from the side that connected: the link's other
    /// connections follow, joining under key `req`; `imm` = how many.
    Lanes = 10,
    /// The first frame on one of a link's other connections: it joins the link whose key is
    /// `req`, as connection `imm`.
    Bind = 11,
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
            9 => Op::Part,
            10 => Op::Lanes,
            11 => Op::Bind,
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
            Op::Part => "split-write piece",
            Op::Lanes => "lanes",
            Op::Bind => "bind",
        }
    }
}

/// Frame flag: the write carries an immediate.
pub(crate) const FLAG_IMM: u32 = 1;
/// Frame flag: the write is the first piece of a split write whose other pieces come as
/// [`Op::Part`] frames with the same `req`, on the link's other connections; bits 8..16 of
/// the flags say how many pieces there are in all (2 to [`MAX_LANES`]). Its completion (the
/// immediate) is delivered once every piece has landed.
pub(crate) const FLAG_PARTS: u32 = 2;
/// Where a split write's piece count sits in the flags.
const PARTS_SHIFT: u32 = 8;
const PARTS_MASK: u32 = 0xff << PARTS_SHIFT;

/// The most connections one tcp link uses (its first and the others together).
pub(crate) const MAX_LANES: u32 = 8;

/// Payloads cut into pieces line up on this many bytes.
const PIECE_ALIGN: u64 = 4096;

/// The flags of a split write's first piece: `imm` flagged or not, `parts` pieces in all.
pub(crate) fn parts_flags(imm: bool, parts: u32) -> u32 {
    (if imm { FLAG_IMM } else { 0 }) | FLAG_PARTS | (parts << PARTS_SHIFT)
}

/// How many pieces a write's flags announce (1: not split).
pub(crate) fn parts_of(flags: u32) -> u32 {
    if flags & FLAG_PARTS == 0 {
        1
    } else {
        (flags & PARTS_MASK) >> PARTS_SHIFT
    }
}

/// Piece `i` of `total` bytes cut into `parts` (offset, length): equal pieces on
/// [`PIECE_ALIGN`] boundaries, the last one shorter. Both ends of a link cut the same way, so
/// a receiver can check that a piece is one of the plan's.
pub(crate) fn piece(total: u64, parts: u32, i: u32) -> (u64, u64) {
    let parts = u64::from(parts.max(1));
    let chunk = total.div_ceil(parts).div_ceil(PIECE_ALIGN) * PIECE_ALIGN;
    let at = (chunk * u64::from(i)).min(total);
    (at, chunk.min(total - at))
}

/// Which piece of `total` bytes cut into `parts` starts at `offset` with `len` bytes, if any
/// (an empty piece never counts).
pub(crate) fn piece_index(total: u64, parts: u32, offset: u64, len: u64) -> Option<u32> {
    (0..parts).find(|&i| len > 0 && piece(total, parts, i) == (offset, len))
}

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
        let flags = h.flags.get();
        let parts = parts_of(flags);
        let split_ok =
            flags & FLAG_PARTS == 0 && flags & PARTS_MASK == 0 || (2..=MAX_LANES).contains(&parts);
        if flags & !(FLAG_IMM | FLAG_PARTS | PARTS_MASK) != 0
            || !split_ok
            || (flags != 0 && op != Op::Write)
        {
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
    fn a_split_plan_covers_every_byte_once_on_page_boundaries() {
        for total in [
            256u64 << 10,
            (256 << 10) + 1,
            5 << 20,
            (8 << 20) + 4099,
            64 << 20,
        ] {
            for parts in 2..=MAX_LANES {
                let mut at = 0;
                for i in 0..parts {
                    let (off, len) = piece(total, parts, i);
                    assert_eq!(off, at, "{total} in {parts}: piece {i} follows the last");
                    assert!(len > 0, "{total} in {parts}: piece {i} is not empty");
                    assert_eq!(off % PIECE_ALIGN, 0);
                    assert_eq!(piece_index(total, parts, off, len), Some(i));
                    at += len;
                }
                assert_eq!(at, total, "{total} in {parts}: the pieces add up");
                assert_eq!(
                    piece_index(total, parts, 1, 10),
                    None,
                    "not a piece of the plan"
                );
            }
        }
    }

    #[test]
    fn split_flags_are_checked() {
        let raw = |op: Op, flags: u32| {
            let mut h = FrameHeader::new(op);
            h.flags = flags.into();
            let raw: [u8; FRAME_HEADER] = h.as_bytes().try_into().unwrap();
            FrameHeader::decode(&raw).map(|(_, h)| parts_of(h.flags.get()))
        };
        assert_eq!(raw(Op::Write, parts_flags(true, 2)).unwrap(), 2);
        assert_eq!(
            raw(Op::Write, parts_flags(false, MAX_LANES)).unwrap(),
            MAX_LANES
        );
        assert_eq!(raw(Op::Write, FLAG_IMM).unwrap(), 1);
        for bad in [
            FLAG_PARTS,
            FLAG_PARTS | (1 << PARTS_SHIFT),
            FLAG_PARTS | ((MAX_LANES + 1) << PARTS_SHIFT),
            2 << PARTS_SHIFT,
            1 << 20,
        ] {
            assert!(
                matches!(raw(Op::Write, bad), Err(Error::Malformed(_))),
                "{bad:#x}"
            );
        }
        assert!(matches!(
            raw(Op::Part, parts_flags(false, 2)),
            Err(Error::Malformed(_))
        ));
    }

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
