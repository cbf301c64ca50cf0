//! Fuzzing seam: entry points through which the cargo-fuzz targets in `fuzz/` reach this
//! crate's private decoders. Not part of the API (hidden from the documentation, no
//! stability promise); nothing else should call it.
//!
//! Each function takes hostile bytes, must return without panicking whatever they are, and
//! asserts the properties that are cheap to check (a failed assertion is a crash the fuzzer
//! reports). The regression tests of the decoders replay what the fuzzer found.

use std::cell::RefCell;

use zerocopy::IntoBytes;

use crate::error::{Error, check_bounds};
use crate::ring::{KIND_MSG, Ring};
use crate::wire::{CTL_PACKET, CtlPacket, FRAME_HEADER, FrameHeader, Op};

/// The region length the frame target checks incoming bounds against.
const REGION: u64 = 1 << 20;

/// A tcp frame header as the link's reader sees it: the first 48 bytes (zero-padded) are
/// decoded; an accepted header must re-encode to the same bytes, and a write or read request
/// that passes the bounds check must lie inside the region.
pub fn frame_header(data: &[u8]) {
    let mut raw = [0u8; FRAME_HEADER];
    let n = data.len().min(FRAME_HEADER);
    raw[..n].copy_from_slice(&data[..n]);
    let Ok((op, h)) = FrameHeader::decode(&raw) else {
        return;
    };
    assert_eq!(
        h.as_bytes(),
        &raw[..],
        "an accepted header re-encodes as read"
    );
    assert_eq!(op as u16, h.op.get());
    let (offset, len) = (h.offset.get(), h.len.get());
    match op {
        Op::Write | Op::ReadReq | Op::Part => {
            if check_bounds("fuzzed frame", offset, len, REGION).is_ok() {
                assert!(
                    offset <= REGION && len <= REGION - offset,
                    "bounds check let through"
                );
            }
        }
        Op::Hello
        | Op::Send
        | Op::ReadResp
        | Op::Error
        | Op::Bye
        | Op::Proof
        | Op::Lanes
        | Op::Bind => {}
    }
}

/// An shm control packet: the first byte says how many descriptors came with it (0 to 3),
/// the rest is the packet. An accepted packet is exactly 40 bytes with the descriptor count
/// its op requires.
pub fn ctl_packet(data: &[u8]) {
    let Some((&nfds, raw)) = data.split_first() else {
        return;
    };
    let nfds = usize::from(nfds % 4);
    if let Ok((op, p)) = CtlPacket::decode(raw, nfds) {
        assert_eq!(raw.len(), CTL_PACKET);
        assert_eq!(op.fds(), nfds);
        assert_eq!(p.as_bytes(), raw, "an accepted packet re-encodes as read");
    }
}

thread_local! {
    /// One ring for the whole run: making a memfd per input would dominate the time.
    static RING: RefCell<Option<Ring>> = const { RefCell::new(None) };
}

/// An shm ring whose shared memory a hostile peer wrote: the first 8 bytes are the consumer's
/// `head`, the next 8 the producer's `tail` (little-endian), the rest the start of the data
/// area (4 KiB; the remainder zeroed). The consumer pops until the ring is empty or an error
/// (every error must be `Malformed`, every record fit the ring), then the producer pushes a
/// record against the same cursors (it must refuse, not overrun, when there is no room).
pub fn ring_records(data: &[u8]) {
    RING.with(|cell| {
        let mut slot = cell.borrow_mut();
        let ring = match slot.as_mut() {
            Some(r) => r,
            None => slot.insert(Ring::create(4096).expect("create a 4 KiB ring")),
        };
        let word = |i: usize| {
            let mut b = [0u8; 8];
            if let Some(src) = data.get(i..) {
                let n = src.len().min(8);
                b[..n].copy_from_slice(&src[..n]);
            }
            u64::from_le_bytes(b)
        };
        let (head, tail) = (word(0), word(8));
        let mut area = vec![0u8; ring.capacity() as usize];
        if let Some(body) = data.get(16..) {
            let n = body.len().min(area.len());
            area[..n].copy_from_slice(&body[..n]);
        }
        ring.scribble(head, tail, &area);
        // Each successful pop consumes at least one record (≥ 16 bytes) of the ≤ 4 KiB
        // published, so this many pops always reach the end.
        for _ in 0..=ring.capacity() / 16 {
            match ring.pop() {
                Ok(Some(r)) => assert!(r.payload.len() as u64 <= ring.capacity()),
                Ok(None) => break,
                Err(Error::Malformed(_)) => break,
                Err(e) => panic!("ring pop gave a {e:?}, not Malformed"),
            }
        }
        ring.scribble(head, tail, &area);
        let len = usize::from(data.first().copied().unwrap_or(0)) * 4;
        let _ = ring.try_push(KIND_MSG, 0, 7, &vec![0xAB; len]);
    });
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    /// The fuzz targets' committed seeds (`fuzz/seeds`) and a few hostile inputs go through the
    /// seam in a plain `cargo test` too, so a change that breaks a property shows without
    /// nightly or `tools/fuzz.sh`.
    #[test]
    #[cfg_attr(miri, ignore = "maps a memfd and reads the seed files")]
    fn fuzz_seeds_and_hostile_inputs_pass_the_seam() {
        let seeds = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds");
        type Target = fn(&[u8]);
        let targets: [(&str, Target); 3] = [
            ("frame_header", frame_header),
            ("ctl_packet", ctl_packet),
            ("ring_records", ring_records),
        ];
        for (target, run) in targets {
            let mut n = 0;
            for entry in std::fs::read_dir(seeds.join(target)).expect("the seeds are committed") {
                run(&std::fs::read(entry.unwrap().path()).unwrap());
                n += 1;
            }
            assert!(n > 0, "no seeds for {target}");
            for hostile in [
                &[][..],
                &[0xff; 7][..],
                &[0xff; 64][..],
                &[0; 4200][..],
                &u64::MAX.to_le_bytes(),
            ] {
                run(hostile);
            }
        }
    }
}
