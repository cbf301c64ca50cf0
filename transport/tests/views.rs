//! The typed views the transport gives over regions: floats copied out of a slot, the floats of
//! a shard with one local writer, and padded atomic words.

use std::sync::atomic::Ordering;

use falcon_transport::{F32Region, Region};

#[test]
fn floats_copied_out_of_a_region_are_the_bytes_written_and_bounds_are_checked() {
    let r = Region::new(4096).unwrap();
    let vals: Vec<f32> = (0..10).map(|i| i as f32 * 0.5 - 1.0).collect();
    let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    r.write_at(8, &bytes).unwrap();
    assert_eq!(r.read_f32_vec(8, 10).unwrap(), vals);
    assert!(r.read_f32_vec(0, 0).unwrap().is_empty());
    let e = r.read_f32_vec(4096 - 8, 3).unwrap_err();
    assert!(e.to_string().contains("region read"), "{e}");
    assert!(
        r.read_f32_vec(0, usize::MAX / 2).is_err(),
        "an overflowing length is refused"
    );
}

#[test]
fn a_float_region_is_written_through_its_one_mutable_view() {
    let mut f = F32Region::new(5).unwrap();
    assert_eq!(f.len(), 5);
    assert!(!f.is_empty());
    assert_eq!(f.values(), &[0.0; 5]);
    f.values_mut().copy_from_slice(&[1.0, 2.0, 3.0, 4.0, 5.0]);
    // What a peer's one-sided read of the region sees.
    let mut b = [0u8; 20];
    f.region().read_at(0, &mut b).unwrap();
    assert_eq!(&b[4..8], &2.0f32.to_ne_bytes());
    assert_eq!(f.values()[4], 5.0);
    assert!(F32Region::new(0).unwrap().is_empty());
}

#[test]
fn padded_atomics_cover_whole_lines_and_are_what_the_bytes_say() {
    let r = Region::new(4096).unwrap();
    let words = r.padded_atomics();
    let line = std::mem::size_of::<crossbeam_utils::CachePadded<std::sync::atomic::AtomicU64>>();
    assert_eq!(words.len(), 4096 / line);
    words[1].store(0x0102_0304_0506_0708, Ordering::Release);
    let mut b = [0u8; 8];
    r.read_at(line as u64, &mut b).unwrap();
    assert_eq!(u64::from_ne_bytes(b), 0x0102_0304_0506_0708);
}
