//! The shm ring's records (`transport/src/ring.rs`) read from shared memory a hostile peer
//! wrote: bytes 0..8 the consumer's head, 8..16 the producer's tail, the rest the data area.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| falcon_transport::fuzzing::ring_records(data));
