//! Loom model of the shard meta block: the seqlock never lets a reader accept a torn
//! snapshot, and clocks published in a write section are seen with the data they count.
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p falcon-engine --test loom_meta --release`
//! (tools/test.sh does).
#![cfg(loom)]

use crossbeam_utils::CachePadded;
use falcon_engine::meta::Meta;
use loom::sync::Arc;
use loom::sync::atomic::{AtomicU64, Ordering};

/// A model checker bounded to 3 preemptions per execution: every interleaving with up to
/// three forced context switches (the bugs of this size of protocol need one or two), and a
/// run time CI can afford.
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(f);
}

fn block(workers: usize) -> Arc<Vec<CachePadded<AtomicU64>>> {
    Arc::new(
        (0..2 + workers)
            .map(|_| CachePadded::new(AtomicU64::new(0)))
            .collect(),
    )
}

#[test]
fn seqlock_reader_never_accepts_a_torn_snapshot() {
    model(|| {
        let words = block(1);
        // The protected data: two words that a write always sets to the same value.
        let data = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
        let (w2, d2) = (words.clone(), data.clone());
        let writer = loom::thread::spawn(move || {
            let meta = Meta::new(&w2);
            for v in 1..=2u64 {
                meta.write(|m| {
                    d2[0].store(v, Ordering::Relaxed);
                    d2[1].store(v, Ordering::Relaxed);
                    m.set_clock(0, v);
                    m.bump_version();
                });
            }
        });
        let meta = Meta::new(&words);
        let (a, b, clock, version) = meta.read(|m| {
            (
                data[0].load(Ordering::Relaxed),
                data[1].load(Ordering::Relaxed),
                m.clock(0),
                m.version(),
            )
        });
        assert_eq!(a, b, "torn read accepted");
        assert_eq!(
            clock, a,
            "the clock counts exactly the writes whose data is visible"
        );
        assert_eq!(version, a);
        writer.join().unwrap();
    });
}

#[test]
fn a_published_clock_implies_its_data() {
    model(|| {
        let words = block(2);
        let data = Arc::new(AtomicU64::new(0));
        let (w2, d2) = (words.clone(), data.clone());
        let writer = loom::thread::spawn(move || {
            let meta = Meta::new(&w2);
            meta.write(|m| {
                d2.store(42, Ordering::Relaxed);
                m.set_clock(1, 1);
            });
        });
        let meta = Meta::new(&words);
        // The lock-free staleness check: a worker that sees the clock may act on the data.
        if meta.min_clock(|w| w == 1) >= 1 {
            assert_eq!(data.load(Ordering::Relaxed), 42);
        }
        writer.join().unwrap();
    });
}
