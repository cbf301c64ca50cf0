//! Loom model of the ring's protocol: a producer and a consumer on two threads, the cursors
//! loom atomics and the data area loom cells, so the model checker explores every
//! interleaving (up to the preemption bound) and flags any read of a byte that is not ordered
//! after its write (a "causality violation"), and any write over bytes still being read.
//!
//! Run: `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p falcon-transport
//! --lib --release ring::loom_model`.

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;

use super::{Cursor, KIND_MSG, Ring, RingMem};

impl Cursor for AtomicU64 {
    fn load(&self, order: Ordering) -> u64 {
        AtomicU64::load(self, order)
    }

    fn store(&self, value: u64, order: Ordering) {
        AtomicU64::store(self, value, order);
    }
}

/// A ring's memory as loom sees it: two atomic cursors and the data area as 16-byte cells
/// (records are 16-byte aligned, so a cell never holds bytes of two records).
struct LoomMem {
    tail: AtomicU64,
    head: AtomicU64,
    slots: Box<[UnsafeCell<[u8; 16]>]>,
}

// SAFETY: the cells are only accessed through loom's `with`/`with_mut`, which check that no
// two accesses on different threads are concurrent (unordered by happens-before) and fail the
// model if they are: that is the property under test.
unsafe impl Sync for LoomMem {}

impl LoomMem {
    /// Runs `f(slot, range in it, range in the caller's buffer)` for each cell that bytes
    /// `pos..pos + len` of the data area touch.
    fn each_slot(
        pos: u64,
        len: usize,
        mut f: impl FnMut(usize, std::ops::Range<usize>, std::ops::Range<usize>),
    ) {
        let mut done = 0;
        while done < len {
            let at = pos as usize + done;
            let (slot, off) = (at / 16, at % 16);
            let n = (16 - off).min(len - done);
            f(slot, off..off + n, done..done + n);
            done += n;
        }
    }
}

impl RingMem for LoomMem {
    type Cursor = AtomicU64;

    fn tail(&self) -> &AtomicU64 {
        &self.tail
    }

    fn head(&self) -> &AtomicU64 {
        &self.head
    }

    unsafe fn put(&self, pos: u64, src: &[u8]) {
        Self::each_slot(pos, src.len(), |slot, cell, buf| {
            self.slots[slot].with_mut(|p| {
                // SAFETY: loom hands out `p` for this access alone and fails the model if
                // another thread's access to the cell is concurrent with it.
                unsafe { (&mut *p)[cell].copy_from_slice(&src[buf]) }
            });
        });
    }

    unsafe fn get(&self, pos: u64, dst: &mut [u8]) {
        Self::each_slot(pos, dst.len(), |slot, cell, buf| {
            self.slots[slot].with(|p| {
                // SAFETY: as in `put`.
                dst[buf].copy_from_slice(unsafe { &(&*p)[cell] })
            });
        });
    }
}

fn loom_ring(cap: u64) -> Ring<LoomMem> {
    assert!(cap.is_power_of_two() && cap >= 64);
    Ring {
        mem: LoomMem {
            tail: AtomicU64::new(0),
            head: AtomicU64::new(0),
            slots: (0..cap / 16).map(|_| UnsafeCell::new([0; 16])).collect(),
        },
        cap,
    }
}

/// Every interleaving with up to `LOOM_MAX_PREEMPTIONS` (default 3) forced context switches:
/// the ordering bugs of a two-party protocol need one or two, and it keeps the run short.
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(b.preemption_bound.unwrap_or(3));
    b.check(f);
}

/// A 128-byte ring: payloads up to 16 bytes, records of 16 or 32 bytes.
const CAP: u64 = 128;

/// Payload lengths of the records pushed. Records 0–3 fill bytes 0..112; record 4 (32 bytes)
/// does not fit in the 16 left before the end, so it goes behind a PAD record, at 0 — over
/// bytes of records 0 and 1, which the consumer must have finished reading.
const LENS: [usize; 5] = [0, 9, 16, 1, 12];

/// Where the tail ends: the five records plus one 16-byte PAD.
const END: u64 = 16 + 3 * 32 + 16 + 32;

fn payload(i: usize) -> Vec<u8> {
    (0..LENS[i]).map(|b| (31 * i + b + 1) as u8).collect()
}

#[test]
fn records_arrive_once_in_order_intact_and_only_once_published() {
    model(|| {
        let ring = Arc::new(loom_ring(CAP));
        let producer = {
            let ring = Arc::clone(&ring);
            loom::thread::spawn(move || {
                for i in 0..LENS.len() {
                    while !ring.try_push(KIND_MSG, 0, i as u32, &payload(i)).unwrap() {
                        loom::thread::yield_now();
                    }
                }
            })
        };
        let mut next = 0;
        while next < LENS.len() {
            match ring
                .pop()
                .expect("a ring written by its producer is well formed")
            {
                Some(r) => {
                    assert_eq!(r.imm as usize, next, "FIFO order, nothing lost or repeated");
                    assert_eq!(r.kind, KIND_MSG);
                    assert_eq!(r.payload, payload(next), "record {next} arrived intact");
                    next += 1;
                }
                None => loom::thread::yield_now(),
            }
        }
        producer.join().unwrap();
        assert!(
            ring.pop().unwrap().is_none(),
            "nothing more than was pushed"
        );
        assert_eq!(
            ring.tail().load(Ordering::Relaxed),
            END,
            "the last record wrapped behind a PAD record"
        );
    });
}
