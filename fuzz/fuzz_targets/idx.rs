//! The IDX reader (`trainer/src/data.rs` `Idx::parse`, then `Split::from_idx`). The first
//! byte picks the mode: bit 0 the dimension count asked for (1: labels, 3: images), bit 1
//! whether the rest is gzip-compressed before parsing (so the gzip path sees valid streams,
//! not only corrupt ones; raw bytes starting 1f 8b reach it corrupt), bit 2 whether the rest
//! is an images file and a labels file (split at the offset in the next two bytes) built into
//! a split.
#![no_main]

use std::io::Write;

use falcon_trainer::data::{Idx, Split};
use libfuzzer_sys::fuzz_target;

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(bytes).expect("in memory");
    e.finish().expect("in memory")
}

fn parse(bytes: &[u8], dims: usize, gz: bool) -> Option<Idx> {
    let packed;
    let bytes = if gz {
        packed = gzip(bytes);
        &packed[..]
    } else {
        bytes
    };
    let idx = Idx::parse(bytes, dims, "fuzz").ok()?;
    assert_eq!(idx.dims.len(), dims);
    assert_eq!(
        idx.dims.iter().product::<usize>(),
        idx.data.len(),
        "the data is exactly what the header promises"
    );
    Some(idx)
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let gz = mode & 2 != 0;
    if mode & 4 == 0 {
        let dims = if mode & 1 == 0 { 1 } else { 3 };
        let _ = parse(rest, dims, gz);
        return;
    }
    let Some((at, rest)) = rest.split_first_chunk::<2>() else {
        return;
    };
    let at = usize::from(u16::from_le_bytes(*at)).min(rest.len());
    let (images, labels) = rest.split_at(at);
    if let (Some(images), Some(labels)) = (parse(images, 3, gz), parse(labels, 1, gz))
        && let Ok(split) = Split::from_idx(images, labels)
    {
        assert!(!split.is_empty());
        assert_eq!(split.images.len(), split.len() * split.features());
        for i in 0..split.len() {
            assert!(usize::from(split.label(i)) < falcon_trainer::data::CLASSES);
            assert_eq!(split.image(i).len(), split.features());
        }
    }
});
