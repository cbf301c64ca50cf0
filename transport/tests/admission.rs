//! The tcp admission wall, from outside: a connection becomes a link only after proving the
//! job token; the whole handshake has one deadline; a full wall still lets a newcomer from a
//! less represented address in; a link is handed out before its first message.

mod common;

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::*;
use falcon_transport::{Completion, Error, Medium, Transport, TransportConfig};

fn with(token: &str, cfg: TransportConfig) -> Transport {
    Transport::new(TransportConfig {
        job: 7,
        token: token.into(),
        ..cfg
    })
    .expect("transport")
}

/// A raw connection from `source` (an address on the loopback network).
fn connect_from(source: &str, to: SocketAddr) -> TcpStream {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    let src: SocketAddr = format!("{source}:0").parse().unwrap();
    s.bind(&src.into()).unwrap();
    s.connect(&to.into()).unwrap();
    s.into()
}

#[test]
fn only_a_peer_with_the_token_becomes_a_link() {
    let server = with("s3cret", TransportConfig::default());
    let stranger = with("guess", TransportConfig::default());
    match stranger.connect_with(server.address(), Medium::Tcp) {
        Err(Error::Refused(why)) => assert!(why.contains("wrong job token"), "{why}"),
        other => panic!("a wrong token is refused with the reason: {other:?}"),
    }
    assert!(
        server.accept(Some(Duration::from_millis(300))).is_err(),
        "the stranger never became a link"
    );
    assert_eq!(server.admission().refused, 1);
    // One connection per link, so that one admission is one link.
    let friend = with(
        "s3cret",
        TransportConfig {
            tcp_streams: 1,
            ..TransportConfig::default()
        },
    );
    let link = friend.connect_with(server.address(), Medium::Tcp).unwrap();
    // The accepted link is handed out before its first message: both are there, in order.
    link.send(b"first").unwrap();
    let back = server.accept(Some(T)).expect("admitted");
    match next(server.cq()) {
        Completion::Message { link, data } => {
            assert_eq!(link, back.id());
            assert_eq!(data, b"first");
        }
        other => panic!("expected the first message, got {other:?}"),
    }
    assert_eq!(server.admission().admitted, 1);
}

#[test]
fn a_silent_or_trickling_peer_is_dropped_at_the_one_deadline() {
    let server = with(
        "k",
        TransportConfig {
            handshake_timeout: Duration::from_millis(400),
            ..TransportConfig::default()
        },
    );
    let to = server.address().tcp.unwrap();
    let start = Instant::now();
    let mut silent = TcpStream::connect(to).unwrap();
    let mut trickle = TcpStream::connect(to).unwrap();
    // The trickler sends a byte every 100 ms: a per-read timeout would never fire.
    let t = std::thread::spawn(move || {
        use std::io::Write;
        for _ in 0..30 {
            if trickle.write_all(b"F").is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    silent
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut buf = [0u8; 256];
    let mut got = 0;
    loop {
        match silent.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
    }
    let closed = start.elapsed();
    assert_eq!(
        got, 80,
        "it was greeted (a hello and its nonce), nothing more"
    );
    assert!(
        closed >= Duration::from_millis(400) && closed < Duration::from_secs(3),
        "dropped at the deadline: {closed:?}"
    );
    t.join().unwrap();
    let a = server.admission();
    assert_eq!(
        (a.timed_out, a.admitted, a.pending),
        (2, 0, 0),
        "both dropped: {a:?}"
    );
}

#[test]
fn a_full_wall_still_lets_a_less_represented_address_in() {
    let server = with(
        "k",
        TransportConfig {
            max_handshakes: 4,
            max_handshakes_per_source: 4,
            ..TransportConfig::default()
        },
    );
    let to = server.address().tcp.unwrap();
    // One address fills the wall with silent connections.
    let flood: Vec<TcpStream> = (0..6).map(|_| connect_from("127.0.0.2", to)).collect();
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(server.admission().pending, 4, "the wall is full");
    assert_eq!(
        server.admission().over_cap,
        2,
        "the flood's extra connections closed"
    );
    // A real peer from another address still gets in (one flooding connection gives way).
    let friend = with("k", TransportConfig::default());
    let link = friend.connect_with(server.address(), Medium::Tcp);
    assert!(link.is_ok(), "admitted despite the flood: {link:?}");
    assert!(server.accept(Some(T)).is_ok());
    assert_eq!(server.admission().over_cap, 3);
    drop(flood);
}

#[test]
fn a_reset_after_the_peers_hello_is_a_busy_peer_tried_again() {
    // A peer that answers the hello (the connector's own, echoed: a valid record of this job)
    // and then resets the connection, as a wall that lets a handshake go in the middle does:
    // the connector tries again until its handshake deadline, then says the peer is busy
    // (it was an I/O error, which stopped a worker's rendezvous at once).
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let to = l.local_addr().unwrap();
    let seen = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let counted = seen.clone();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut hello = [0u8; 512];
            s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            let Ok(n) = s.read(&mut hello) else { continue };
            let _ = std::io::Write::write_all(&mut s, &hello[..n]);
            let _ = s.read(&mut hello); // its proof
            socket2::SockRef::from(&s)
                .set_linger(Some(Duration::ZERO))
                .unwrap();
        }
    });
    let t = with(
        "tok",
        TransportConfig {
            handshake_timeout: Duration::from_millis(600),
            ..TransportConfig::default()
        },
    );
    let peer: falcon_transport::PeerAddr = format!("host=elsewhere;tcp={to}").parse().unwrap();
    match t.connect_with(&peer, Medium::Tcp) {
        Err(Error::Busy { why, .. }) => assert!(why.contains("reset"), "{why}"),
        Err(e) => panic!("a reset mid-handshake must be a busy peer: {e}"),
        Ok(_) => panic!("the fake peer never completes a handshake"),
    }
    assert!(
        seen.load(std::sync::atomic::Ordering::SeqCst) >= 2,
        "tried again"
    );
}
