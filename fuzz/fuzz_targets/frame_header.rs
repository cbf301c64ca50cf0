//! tcp frame headers (`transport/src/wire.rs` `FrameHeader::decode`) and the bounds check a
//! write or read request then passes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| falcon_transport::fuzzing::frame_header(data));
