//! The shard meta block's seqlock with real threads on ordinary heap memory: a writer
//! publishing updates, readers that must never accept a torn snapshot, and the lock-free
//! staleness check, which must never see a clock without the data it counts.
//!
//! The loom model (`tests/loom_meta.rs`) explores every interleaving of a small case; this
//! runs a longer one natively, and under Miri (`tools/miri.sh`), whose data-race detector and
//! weak-memory emulation check the same orderings on the code as compiled for production.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;

use crossbeam_utils::CachePadded;
use falcon_engine::meta::{LINE, Meta, Snapshot, meta_bytes};

/// Updates the writer publishes (fewer under Miri, which interprets every instruction).
const WRITES: u64 = if cfg!(miri) { 200 } else { 20_000 };
const WORKERS: usize = 2;

#[test]
fn readers_never_accept_a_torn_snapshot_and_clocks_imply_their_data() {
    let words: Arc<Vec<CachePadded<AtomicU64>>> = Arc::new(
        (0..2 + WORKERS)
            .map(|_| CachePadded::new(AtomicU64::new(0)))
            .collect(),
    );
    // The protected data: three words a write always sets to the same value. Relaxed
    // atomics, so that only the seqlock's orderings can make them agree.
    let data: Arc<[AtomicU64; 3]> = Arc::new(Default::default());
    let writer = {
        let (words, data) = (Arc::clone(&words), Arc::clone(&data));
        thread::spawn(move || {
            let meta = Meta::new(&words);
            for v in 1..=WRITES {
                meta.write(|m| {
                    for d in data.iter() {
                        d.store(v, Ordering::Relaxed);
                    }
                    for w in 0..WORKERS {
                        m.set_clock(w, v);
                    }
                    m.bump_version();
                });
            }
        })
    };
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (words, data) = (Arc::clone(&words), Arc::clone(&data));
            thread::spawn(move || {
                let meta = Meta::new(&words);
                let mut last = 0;
                let mut reads = 0u64;
                while last < WRITES {
                    let (d, clocks, version) = meta.read(|m| {
                        (
                            data.each_ref().map(|d| d.load(Ordering::Relaxed)),
                            [m.clock(0), m.clock(1)],
                            m.version(),
                        )
                    });
                    assert!(d.iter().all(|&x| x == d[0]), "torn read accepted: {d:?}");
                    assert_eq!(clocks, [d[0]; 2], "clocks count exactly the visible data");
                    assert_eq!(version, d[0]);
                    assert!(version >= last, "a reader never goes back in time");
                    last = version;
                    // The lock-free staleness check, outside the seqlock: a worker that sees
                    // the slowest clock at c acts on data at least that new.
                    let min = meta.min_clock(|_| true);
                    assert!(data[0].load(Ordering::Relaxed) >= min);
                    reads += 1;
                    thread::yield_now();
                }
                reads
            })
        })
        .collect();
    writer.join().unwrap();
    for r in readers {
        assert!(r.join().unwrap() > 0);
    }
    // What a one-sided read of the block would copy, once the writer is done.
    // SAFETY: `words` is a live Vec of atomics no thread writes any more; viewing its bytes
    // as `u8` is fine (any bit pattern is a valid u8).
    let bytes =
        unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), words.len() * LINE) };
    assert_eq!(bytes.len() as u64, meta_bytes(WORKERS as u32));
    let snap = Snapshot::parse(bytes, WORKERS as u32).unwrap();
    assert!(snap.stable());
    assert_eq!(snap.seq, 2 * WRITES);
    assert_eq!(snap.version, WRITES);
    assert_eq!(snap.clocks, vec![WRITES; WORKERS]);
}
