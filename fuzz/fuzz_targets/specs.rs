//! Configuration strings: the first byte picks the parser, the rest is its input.
//!
//! | mode | parser | property |
//! |---|---|---|
//! | 0 | `PolicySpec` (engine) | none beyond no panic |
//! | 1 | `ScaleSpec` (engine) | an accepted ConSGD factor is finite and > 0 |
//! | 2 | `Hetero::parse` (trainer), `trace(…)` left out | `parse(h.to_string()) == h` |
//! | 3 | a heterogeneity trace file's text (`Hetero::load_trace`) | factors finite, ≥ 1 |
//! | 4 | `ModelSpec` (trainer) | `parse(m.to_string()) == m` |
//! | 5 | `Role` (engine), `Medium` (transport) | none beyond no panic |
//! | 6 | `PeerAddr` (transport; the rendezvous address) | `parse(a.to_string()) == a` |
//! | 7 | the serde forms (JSON) of `Hetero`, `ModelSpec`, `PolicySpec` | as mode 2 |
#![no_main]

use std::time::Duration;

use falcon_engine::proto::Role;
use falcon_engine::sync::PolicySpec;
use falcon_engine::update::ScaleSpec;
use falcon_trainer::hetero::Hetero;
use falcon_trainer::model::ModelSpec;
use falcon_transport::{Medium, PeerAddr};
use libfuzzer_sys::fuzz_target;

/// `trace(…)` reads the file it names: from fuzzed text that could be any file (or a FIFO),
/// so mode 2 leaves it out and mode 3 feeds the trace reader a file of fuzzed contents.
fn names_a_trace(s: &str) -> bool {
    s.split_once('(')
        .is_some_and(|(name, _)| name.trim().eq_ignore_ascii_case("trace"))
}

/// A parsed spec prints back to itself, and its delays are durations for any iteration and
/// compute time (the worker sleeps them: a spec that parses must not panic there).
fn hetero_checks(h: &Hetero) {
    if !matches!(h, Hetero::Trace { .. }) {
        let text = h.to_string();
        let back = Hetero::parse(&text).unwrap_or_else(|e| panic!("{text:?} does not parse: {e}"));
        assert_eq!(&back, h, "parse(h.to_string()) == h for {text:?}");
    }
    let _ = h.per_task();
    for compute in [
        Duration::ZERO,
        Duration::from_millis(3),
        Duration::from_secs(3600),
    ] {
        for iter in [0, 1, 7, u64::MAX] {
            let _ = h.delay(42, iter, compute);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let text = String::from_utf8_lossy(rest);
    let s = text.as_ref();
    match mode % 8 {
        0 => {
            if let Ok(p) = s.parse::<PolicySpec>() {
                // What a server then does with it: one instance per shard.
                let _ = p.build(4);
                let _ = p.build_for(1, 7);
                let _ = p.job_barriers();
            }
        }
        1 => {
            if let Ok(spec) = s.parse::<ScaleSpec>() {
                if let ScaleSpec::ConSgd { factor } = spec {
                    assert!(factor.is_finite() && factor > 0.0);
                }
                let rule = spec.build();
                let _ = (rule.scale(0), rule.scale(u64::MAX));
            }
        }
        2 => {
            if !names_a_trace(s)
                && let Ok(h) = Hetero::parse(s)
            {
                hetero_checks(&h);
            }
        }
        3 => {
            let shm = std::path::Path::new("/dev/shm");
            let dir = if shm.is_dir() {
                shm.to_owned()
            } else {
                std::env::temp_dir()
            };
            let path = dir.join(format!("falcon-fuzz-trace-{}.txt", std::process::id()));
            // The first byte after the mode names the worker (of a metrics file) when odd.
            let (worker, body) = match rest.split_first() {
                Some((&w, body)) if w % 2 == 1 => (Some(u32::from(w / 2)), body),
                Some((_, body)) => (None, body),
                None => (None, rest),
            };
            std::fs::write(&path, body).expect("write the trace file");
            if let Ok(h) = Hetero::load_trace(&path, worker) {
                if let Hetero::Trace { factors, .. } = &h {
                    assert!(!factors.is_empty());
                    assert!(factors.iter().all(|f| f.is_finite() && *f >= 1.0));
                }
                hetero_checks(&h);
            }
        }
        4 => {
            if let Ok(m) = s.parse::<ModelSpec>() {
                let text = m.to_string();
                assert_eq!(
                    text.parse::<ModelSpec>().ok().as_ref(),
                    Some(&m),
                    "{text:?}"
                );
                // Building checks the sizes; it allocates no parameters.
                let _ = m.build();
            }
        }
        5 => {
            let _ = s.parse::<Role>();
            let _ = s.parse::<Medium>();
        }
        6 => {
            if let Ok(a) = s.parse::<PeerAddr>() {
                let text = a.to_string();
                assert_eq!(text.parse::<PeerAddr>().ok(), Some(a), "{text:?}");
            }
        }
        _ => {
            // A JSON string naming a trace reads that file: as in mode 2, left out.
            if !s.contains("trace")
                && let Ok(h) = serde_json::from_str::<Hetero>(s)
            {
                hetero_checks(&h);
            }
            let _ = serde_json::from_str::<ModelSpec>(s);
            let _ = serde_json::from_str::<PolicySpec>(s);
        }
    }
});
