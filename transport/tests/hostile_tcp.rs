//! Random bytes thrown at a live tcp listener, before any handshake: every such connection is
//! refused, the listener keeps accepting, and real peers still connect and move data.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::*;
use falcon_transport::{Completion, Medium, Region, RemoteKey};

#[test]
fn garbage_connections_are_refused_and_the_listener_survives() {
    let server = transport(7);
    let addr = server.address().tcp.expect("tcp listener");
    let mut rng = fastrand::Rng::with_seed(5);
    for round in 0..60 {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut junk = vec![0u8; rng.usize(1..300)];
        rng.fill(&mut junk);
        if round % 3 == 0 && junk.len() >= 6 {
            junk[..4].copy_from_slice(b"FLCN"); // right magic, then nonsense
        }
        let _ = s.write_all(&junk);
        if round % 2 == 0 {
            // Half of them hang up at once, half wait for the server to drop them.
            drop(s);
        } else {
            let mut buf = [0u8; 256];
            // The server answers with its hello (a header and its nonce), then closes: reading
            // reaches EOF or an error, never hangs (read timeout guards the test itself).
            let mut total = 0;
            loop {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => total += n,
                }
                assert!(total <= 80, "the server sends nothing but its hello");
            }
        }
    }
    assert!(
        server.accept(Some(Duration::from_millis(200))).is_err(),
        "no garbage connection became a link"
    );
    // A real peer still gets through and works.
    let client = transport(7);
    let link = client.connect_with(server.address(), Medium::Tcp).unwrap();
    let back = server.accept(Some(T)).unwrap();
    let region = Region::new(4096).unwrap();
    let key = back.grant(&region).unwrap();
    let src = Region::new(4096).unwrap();
    src.fill(7);
    let key = RemoteKey { ..key };
    link.write(&src, 0, &key, 0, 4096, Some(1)).unwrap();
    assert!(matches!(
        next(server.cq()),
        Completion::WriteImm { imm: 1, .. }
    ));
    let mut got = [0u8; 4096];
    region.read_at(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 7));
}
