//! shm control packets (`transport/src/wire.rs` `CtlPacket::decode`): first byte the number
//! of descriptors that came with the packet, the rest the packet.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| falcon_transport::fuzzing::ctl_packet(data));
