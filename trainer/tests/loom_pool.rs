//! Loom model of the elastic pool's exactly-once claim point, [`TaskSource`]: the owner's
//! pool slots claiming from the front and a thief (task transfer) stealing from the back race
//! on its one atomic word, and the owner resets it to the next iteration while a thief steals.
//!
//! The pool's persistent threads, channels and panics are not modelled (loom cannot run std
//! threads or crossbeam channels): the slots here are loom threads running the pool's claim
//! loop (`while let Some(task) = source.claim()`), which is all the pool adds to the source.
//!
//! Run: `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p falcon-trainer
//! --test loom_pool --release`.
#![cfg(loom)]

use std::ops::Range;

use falcon_trainer::pool::{Stolen, TaskSource, iteration_tag};
use loom::sync::Arc;
use loom::sync::atomic::{AtomicU64, Ordering};

/// Every interleaving with up to `LOOM_MAX_PREEMPTIONS` (default 4) forced context switches.
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(b.preemption_bound.unwrap_or(4));
    b.check(f);
}

/// A pool slot: claims until the source is empty.
fn claim_all(source: &TaskSource) -> Vec<usize> {
    let mut got = Vec::new();
    while let Some(task) = source.claim() {
        got.push(task);
    }
    got
}

/// Asserts that `handed` holds every index of `0..m` exactly once.
fn exactly_once(mut handed: Vec<usize>, m: usize) {
    handed.sort_unstable();
    assert_eq!(
        handed,
        (0..m).collect::<Vec<_>>(),
        "every task exactly once, none lost"
    );
}

#[test]
fn claimers_and_a_thief_hand_out_every_task_exactly_once() {
    const M: usize = 4;
    model(|| {
        let source = Arc::new(TaskSource::new(M).unwrap());
        let slots: Vec<_> = (0..2)
            .map(|_| {
                let source = Arc::clone(&source);
                loom::thread::spawn(move || claim_all(&source))
            })
            .collect();
        // The thief: two steals from the back, as a pioneer taking work twice.
        let mut handed = Vec::new();
        for max in [2, 1] {
            if let Some(Stolen { tag, tasks }) = source.steal(max) {
                assert_eq!(tag, 0);
                assert!(!tasks.is_empty() && tasks.len() <= max && tasks.end <= M);
                handed.extend(tasks);
            }
        }
        for slot in slots {
            let claimed = slot.join().unwrap();
            assert!(
                claimed.is_sorted(),
                "one slot claims from the front in order"
            );
            handed.extend(claimed);
        }
        assert_eq!(source.remaining(), 0);
        exactly_once(handed, M);
    });
}

#[test]
fn a_thief_racing_the_next_iteration_never_mixes_them() {
    // Iteration 0 has 3 tasks, iteration 1 has 2: a steal that mixed them up (tag of one,
    // indices of the other) shows as an index out of range or a task handed out twice.
    const M0: usize = 3;
    const M1: usize = 2;
    model(|| {
        let source = Arc::new(TaskSource::new(M0).unwrap());
        // The owner's data for the iteration (its batch): Relaxed, so only the source's
        // Release reset / Acquire hand-out can make it visible to a thief.
        let batch = Arc::new(AtomicU64::new(0));
        let thief = {
            let (source, batch) = (Arc::clone(&source), Arc::clone(&batch));
            loom::thread::spawn(move || {
                let mine = source.steal_for(0, 2);
                assert!(
                    mine.as_ref().is_none_or(|s| s.tag == 0),
                    "steal_for(0) hands out iteration 0's tasks only, even racing the reset"
                );
                let any = source.steal(1);
                let mut out: Vec<Stolen> = mine.into_iter().chain(any).collect();
                for s in &out {
                    // The owner writes iteration 1's data before the reset that publishes it
                    // (iteration 0's may already be overwritten: it is being dropped).
                    assert!(
                        batch.load(Ordering::Relaxed) >= u64::from(s.tag),
                        "a task of iteration {} handed out before its data is visible",
                        s.tag
                    );
                }
                out.sort_by_key(|s| s.tag);
                out
            })
        };
        // The owner: one task of iteration 0, then the boundary, then iteration 1.
        let first = source.claim();
        batch.store(1, Ordering::Relaxed);
        source.reset(1, M1).unwrap();
        let second: Vec<usize> = claim_all(&source);
        assert_eq!(source.tag(), iteration_tag(1));

        let stolen = thief.join().unwrap();
        let of = |tag: u32| -> Vec<Range<usize>> {
            stolen
                .iter()
                .filter(|s| s.tag == tag)
                .map(|s| s.tasks.clone())
                .collect()
        };
        assert!(stolen.iter().all(|s| s.tag <= 1));
        // Iteration 0: what was handed out was handed out once, inside 0..M0 (the rest was
        // dropped by the reset, by design).
        let mut it0: Vec<usize> = first
            .into_iter()
            .chain(of(0).into_iter().flatten())
            .collect();
        it0.sort_unstable();
        assert!(
            it0.windows(2).all(|w| w[0] < w[1]),
            "iteration 0 twice: {it0:?}"
        );
        assert!(it0.iter().all(|&t| t < M0));
        // Iteration 1: the owner claimed to the end, so every task went out exactly once.
        exactly_once(
            second
                .into_iter()
                .chain(of(1).into_iter().flatten())
                .collect(),
            M1,
        );
        for s in &stolen {
            assert!(s.is_for(u64::from(s.tag)));
        }
    });
}
