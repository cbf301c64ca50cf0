//! A shard's meta block read one-sided from a server's memory (`engine/src/meta.rs`
//! `Snapshot::parse`): the first two bytes the worker count, the rest the block.
#![no_main]

use falcon_engine::meta::Snapshot;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((w, block)) = data.split_first_chunk::<2>() else {
        return;
    };
    let workers = u32::from(u16::from_le_bytes(*w));
    if let Ok(s) = Snapshot::parse(block, workers) {
        assert_eq!(s.clocks.len(), workers as usize);
        let _ = s.stable();
        let _ = s.min_clock(|w| w % 2 == 0);
    }
});
