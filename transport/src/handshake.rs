//! The tcp connection handshake, as a sans-IO state machine: bytes in, bytes out, no sockets,
//! no clocks. The connecting side drives it with blocking reads under one deadline
//! ([`crate::tcp::handshake`]); the accepting side drives every pending handshake of a
//! listener from one thread ([`crate::admit`]), so a peer that has not proved it belongs to
//! the job owns no thread and at most [`MAX_RECORD`] bytes of buffer.
//!
//! The exchange, each record a [`FrameHeader`] and a fixed-size payload:
//!
//! 1. both sides send `Hello` (job id, node id, the medium asked for) with a fresh random
//!    nonce of [`NONCE`] bytes;
//! 2. the connecting side sends `Proof`: `HMAC-SHA256(token, label ‖ "connect" ‖ job ‖
//!    nonce_acceptor ‖ nonce_connector)`;
//! 3. the accepting side checks it in constant time and only then answers with its own proof
//!    (label `"accept"`), which the connecting side checks: both ends learn that the other
//!    knows the job token, which never crosses the wire.
//!
//! Both nonces and the side are bound into each proof: a recorded proof is worthless on any
//! other connection, and a proof one side sends cannot be reflected back to it. A job without
//! a token uses the empty key — the exchange still runs, but proves nothing; the job id alone
//! then keeps processes of other jobs out, not an attacker.

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;
use zerocopy::{FromBytes, IntoBytes};

use crate::error::{Error, Result};
use crate::wire::{FRAME_HEADER, FrameHeader, Op};

/// Nonce length in bytes.
pub(crate) const NONCE: usize = 32;
/// Proof (HMAC-SHA256) length in bytes.
pub(crate) const PROOF: usize = 32;
/// The longest refusal text a handshake accepts from its peer.
const MAX_REFUSAL: usize = 256;
/// The largest record a handshake ever buffers: a header and a refusal.
pub(crate) const MAX_RECORD: usize = FRAME_HEADER + MAX_REFUSAL;

const LABEL: &[u8] = b"falcon/link/v1\0";

/// What a hello asks the connection to become.
pub(crate) const HELLO_TCP: u32 = 0;
/// The tcp connection is the control link of an RDMA queue pair.
pub(crate) const HELLO_RDMA: u32 = 1;
/// The tcp connection joins an existing link as one more of its connections (an
/// [`crate::wire::Op::Bind`] frame follows the handshake).
pub(crate) const HELLO_LANE: u32 = 2;

/// A fresh nonce from the kernel.
pub(crate) fn nonce() -> Result<[u8; NONCE]> {
    let mut n = [0u8; NONCE];
    let mut filled = 0;
    while filled < NONCE {
        match rustix::rand::getrandom(&mut n[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(k) => filled += k,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(Error::io("random handshake nonce", e.into())),
        }
    }
    Ok(n)
}

/// Which end of the connection this handshake is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    /// The side that called `connect`.
    Connect,
    /// The side that accepted.
    Accept,
}

impl Side {
    fn label(self) -> &'static [u8] {
        match self {
            Side::Connect => b"connect",
            Side::Accept => b"accept",
        }
    }
}

/// What one end says about itself.
#[derive(Clone, Debug)]
pub(crate) struct Local {
    pub(crate) job: u64,
    pub(crate) node: u64,
    /// The medium asked for (`HELLO_*`); the accepting side sends `HELLO_TCP`.
    pub(crate) ask: u32,
    /// The job token (empty: none).
    pub(crate) token: std::sync::Arc<[u8]>,
}

/// The peer, once the handshake is done.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Peer {
    pub(crate) node: u64,
    pub(crate) ask: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Waiting for the peer's hello.
    Hello,
    /// Waiting for the peer's proof.
    Proof,
    /// Both proofs checked (the accepting side may still have its proof to send).
    Done,
    /// Refused or broken: only a refusal may remain to be sent.
    Failed,
}

/// One handshake in progress.
pub(crate) struct Handshake {
    side: Side,
    local: Local,
    nonce: [u8; NONCE],
    peer_nonce: [u8; NONCE],
    peer: Option<Peer>,
    state: State,
    /// Bytes to send, and how many of them went out.
    out: Vec<u8>,
    sent: usize,
    /// The record being received: header, then payload.
    rec: [u8; MAX_RECORD],
    have: usize,
    /// Payload length of the record being received, once its header is in.
    payload: Option<(Op, usize)>,
}

fn record(op: Op, payload: &[u8], fill: impl FnOnce(&mut FrameHeader)) -> Vec<u8> {
    let mut h = FrameHeader::new(op);
    h.len = (payload.len() as u64).into();
    fill(&mut h);
    let mut v = Vec::with_capacity(FRAME_HEADER + payload.len());
    v.extend_from_slice(h.as_bytes());
    v.extend_from_slice(payload);
    v
}

impl Handshake {
    /// Starts a handshake; our hello is queued at once.
    pub(crate) fn new(side: Side, local: Local, nonce: [u8; NONCE]) -> Handshake {
        let out = record(Op::Hello, &nonce, |h| {
            h.region = local.job.into();
            h.offset = local.node.into();
            h.imm = local.ask.into();
        });
        Handshake {
            side,
            local,
            nonce,
            peer_nonce: [0; NONCE],
            peer: None,
            state: State::Hello,
            out,
            sent: 0,
            rec: [0; MAX_RECORD],
            have: 0,
            payload: None,
        }
    }

    /// Bytes waiting to be sent.
    pub(crate) fn outgoing(&self) -> &[u8] {
        &self.out[self.sent..]
    }

    /// `n` bytes of [`Handshake::outgoing`] went out.
    pub(crate) fn sent(&mut self, n: usize) {
        self.sent = (self.sent + n).min(self.out.len());
    }

    /// How many more bytes the current record needs (0 when nothing more is read).
    pub(crate) fn wants(&self) -> usize {
        match self.state {
            State::Hello | State::Proof => match self.payload {
                None => FRAME_HEADER - self.have,
                Some((_, len)) => FRAME_HEADER + len - self.have,
            },
            State::Done | State::Failed => 0,
        }
    }

    /// The peer, once both proofs are checked and nothing is left to send.
    pub(crate) fn finished(&self) -> Option<Peer> {
        match self.state {
            State::Done if self.outgoing().is_empty() => self.peer,
            _ => None,
        }
    }

    /// Feeds received bytes (at most [`Handshake::wants`] of them; extra bytes are refused as
    /// a protocol violation: nobody may speak before the handshake is over).
    pub(crate) fn receive(&mut self, data: &[u8]) -> Result<()> {
        let r = self.receive_inner(data);
        if r.is_err() {
            self.state = State::Failed;
        }
        r
    }

    fn receive_inner(&mut self, mut data: &[u8]) -> Result<()> {
        while !data.is_empty() {
            let want = self.wants();
            if want == 0 {
                return Err(Error::Malformed(
                    "bytes after the handshake's last record, before it was answered".into(),
                ));
            }
            let n = want.min(data.len());
            self.rec[self.have..self.have + n].copy_from_slice(&data[..n]);
            self.have += n;
            data = &data[n..];
            if self.wants() > 0 {
                continue;
            }
            match self.payload {
                None => self.header()?,
                Some((op, len)) => self.complete(op, len)?,
            }
        }
        Ok(())
    }

    /// A header is in: check it and learn the payload's length.
    fn header(&mut self) -> Result<()> {
        let raw: &[u8; FRAME_HEADER] = self.rec[..FRAME_HEADER].try_into().expect("header size");
        let (op, h) = FrameHeader::decode(raw)?;
        let len = h.len.get();
        let expected = match (self.state, op) {
            (State::Hello, Op::Hello) => NONCE as u64,
            (State::Proof, Op::Proof) => PROOF as u64,
            (_, Op::Error) if len <= MAX_REFUSAL as u64 => len,
            (_, Op::Error) => {
                return Err(Error::Malformed(format!("a refusal of {len} bytes")));
            }
            (State::Hello, other) => {
                return Err(Error::Malformed(format!(
                    "expected a hello, got a {} frame",
                    other.name()
                )));
            }
            (_, other) => {
                return Err(Error::Malformed(format!(
                    "expected the handshake's proof, got a {} frame",
                    other.name()
                )));
            }
        };
        if len != expected {
            return Err(Error::Malformed(format!(
                "a {} of {len} bytes, expected {expected}",
                op.name()
            )));
        }
        self.payload = Some((op, len as usize));
        if len == 0 {
            self.complete(op, 0)?;
        }
        Ok(())
    }

    /// A whole record is in.
    fn complete(&mut self, op: Op, len: usize) -> Result<()> {
        let h = FrameHeader::read_from_bytes(&self.rec[..FRAME_HEADER]).expect("header size");
        let body = &self.rec[FRAME_HEADER..FRAME_HEADER + len];
        let result = match op {
            Op::Error => {
                let text: String = String::from_utf8_lossy(body)
                    .chars()
                    .take(MAX_REFUSAL)
                    .collect();
                if h.imm.get() == BUSY {
                    Err(Error::Busy {
                        peer: String::new(),
                        why: text,
                    })
                } else {
                    Err(Error::Refused(text))
                }
            }
            Op::Hello => {
                if h.region.get() != self.local.job {
                    Err(Error::WrongJob {
                        theirs: h.region.get(),
                        ours: self.local.job,
                    })
                } else if h.imm.get() > HELLO_LANE {
                    Err(Error::Malformed(format!(
                        "hello asks for unknown medium {}",
                        h.imm.get()
                    )))
                } else {
                    self.peer_nonce.copy_from_slice(body);
                    self.peer = Some(Peer {
                        node: h.offset.get(),
                        ask: h.imm.get(),
                    });
                    self.state = State::Proof;
                    if self.side == Side::Connect {
                        let proof = self.proof(Side::Connect);
                        self.out.extend(record(Op::Proof, &proof, |_| {}));
                    }
                    Ok(())
                }
            }
            Op::Proof => {
                let ok = self.verify(self.other(), body);
                if !ok {
                    if self.side == Side::Accept {
                        self.out
                            .extend(record(Op::Error, REFUSAL.as_bytes(), |_| {}));
                    }
                    Err(Error::Refused(REFUSAL.into()))
                } else {
                    if self.side == Side::Accept {
                        let proof = self.proof(Side::Accept);
                        self.out.extend(record(Op::Proof, &proof, |_| {}));
                    }
                    self.state = State::Done;
                    Ok(())
                }
            }
            _ => unreachable!("header() admits hello, proof and error only"),
        };
        self.have = 0;
        self.payload = None;
        result
    }

    fn other(&self) -> Side {
        match self.side {
            Side::Connect => Side::Accept,
            Side::Accept => Side::Connect,
        }
    }

    /// (acceptor's nonce, connector's nonce).
    fn nonces(&self) -> (&[u8; NONCE], &[u8; NONCE]) {
        match self.side {
            Side::Accept => (&self.nonce, &self.peer_nonce),
            Side::Connect => (&self.peer_nonce, &self.nonce),
        }
    }

    fn mac(&self, by: Side) -> Hmac<Sha256> {
        // HMAC takes keys of any length, the empty one included.
        let mut m = <Hmac<Sha256> as KeyInit>::new_from_slice(&self.local.token)
            .expect("HMAC accepts any key length");
        let (a, c) = self.nonces();
        m.update(LABEL);
        m.update(by.label());
        m.update(&self.local.job.to_le_bytes());
        m.update(a);
        m.update(c);
        m
    }

    fn proof(&self, by: Side) -> [u8; PROOF] {
        self.mac(by).finalize().into_bytes().into()
    }

    fn verify(&self, by: Side, proof: &[u8]) -> bool {
        self.mac(by).verify_slice(proof).is_ok()
    }
}

/// The immediate of a refusal that means "the admission wall is full: try again".
const BUSY: u32 = 1;

/// What a newcomer is told when the admission wall has no room for it (or when it gives way
/// to another): an error record marked busy, which the connecting side retries.
pub(crate) fn busy_record() -> Vec<u8> {
    record(Op::Error, BUSY_TEXT.as_bytes(), |h| h.imm = BUSY.into())
}

/// The text of [`busy_record`].
pub(crate) const BUSY_TEXT: &str =
    "its admission wall is full (too many connections wait to prove the job token); try again";

/// What a refused peer is told (and what its `connect` reports).
pub(crate) const REFUSAL: &str = "wrong job token: the peer could not prove it belongs to this job (set the same FALCON_TOKEN on every node)";

#[cfg(test)]
mod tests {
    use super::*;

    fn local(token: &str, job: u64, node: u64, ask: u32) -> Local {
        Local {
            job,
            node,
            ask,
            token: token.as_bytes().into(),
        }
    }

    /// Runs two handshakes against each other, moving bytes in chunks of `chunk`.
    fn run(
        c: &mut Handshake,
        a: &mut Handshake,
        chunk: usize,
    ) -> (Result<Option<Peer>>, Result<Option<Peer>>) {
        let mut rc: Result<()> = Ok(());
        let mut ra: Result<()> = Ok(());
        fn pass(
            from: &mut Handshake,
            to: &mut Handshake,
            chunk: usize,
            r: &mut Result<()>,
        ) -> bool {
            let out = from.outgoing();
            let n = out.len().min(chunk).min(to.wants());
            if n == 0 || r.is_err() {
                return false;
            }
            let bytes = out[..n].to_vec();
            from.sent(n);
            *r = to.receive(&bytes);
            true
        }
        for _ in 0..1000 {
            let one = pass(c, a, chunk, &mut ra);
            let two = pass(a, c, chunk, &mut rc);
            if !one && !two {
                break;
            }
        }
        (rc.map(|_| c.finished()), ra.map(|_| a.finished()))
    }

    #[test]
    fn the_same_token_admits_both_ways_in_any_chunking() {
        for chunk in [1, 7, 48, 80, 1000] {
            let mut c = Handshake::new(Side::Connect, local("s3cret", 9, 1, 1), [1; NONCE]);
            let mut a = Handshake::new(Side::Accept, local("s3cret", 9, 2, 0), [2; NONCE]);
            let (rc, ra) = run(&mut c, &mut a, chunk);
            assert_eq!(rc.unwrap(), Some(Peer { node: 2, ask: 0 }));
            assert_eq!(ra.unwrap(), Some(Peer { node: 1, ask: 1 }));
        }
    }

    #[test]
    fn a_wrong_token_is_refused_and_told_so() {
        let mut c = Handshake::new(Side::Connect, local("guess", 9, 1, 0), [1; NONCE]);
        let mut a = Handshake::new(Side::Accept, local("s3cret", 9, 2, 0), [2; NONCE]);
        let (rc, ra) = run(&mut c, &mut a, 1000);
        assert!(matches!(ra, Err(Error::Refused(_))), "acceptor refuses");
        match rc {
            Err(Error::Refused(why)) => assert!(why.contains("wrong job token"), "{why}"),
            other => panic!("the connector is told why: {other:?}"),
        }
        // The acceptor never sent its own proof.
        assert!(a.finished().is_none());
    }

    #[test]
    fn another_job_is_refused() {
        let mut c = Handshake::new(Side::Connect, local("t", 8, 1, 0), [1; NONCE]);
        let mut a = Handshake::new(Side::Accept, local("t", 9, 2, 0), [2; NONCE]);
        let (rc, ra) = run(&mut c, &mut a, 1000);
        assert!(matches!(ra, Err(Error::WrongJob { theirs: 8, ours: 9 })));
        assert!(matches!(rc, Err(Error::WrongJob { theirs: 9, ours: 8 })));
    }

    #[test]
    fn a_reflected_or_replayed_proof_fails() {
        // A proof made by the acceptor is no proof for a connector with the same nonces.
        let a = Handshake::new(Side::Accept, local("k", 1, 2, 0), [2; NONCE]);
        let mut a = a;
        a.peer_nonce = [1; NONCE];
        let reflected = a.proof(Side::Accept);
        assert!(!a.verify(Side::Connect, &reflected));
        // A proof for other nonces fails.
        let mut b = Handshake::new(Side::Accept, local("k", 1, 2, 0), [3; NONCE]);
        b.peer_nonce = [1; NONCE];
        let theirs = a.proof(Side::Connect);
        assert!(!b.verify(Side::Connect, &theirs));
        assert!(a.verify(Side::Connect, &theirs));
    }

    #[test]
    fn speaking_early_or_big_is_refused_with_a_bounded_buffer() {
        // A Send frame instead of a hello: refused on its header, whatever length it claims.
        let mut a = Handshake::new(Side::Accept, local("k", 1, 2, 0), [2; NONCE]);
        let mut h = FrameHeader::new(Op::Send);
        h.len = (8u64 << 30).into();
        assert!(a.receive(h.as_bytes()).is_err());
        assert_eq!(a.wants(), 0);
        // A hello followed at once by more bytes than the proof: refused.
        let mut a = Handshake::new(Side::Accept, local("k", 1, 2, 0), [2; NONCE]);
        let c = Handshake::new(Side::Connect, local("k", 1, 1, 0), [1; NONCE]);
        let mut bytes = c.outgoing().to_vec();
        bytes.extend(record(Op::Send, &[0; 100], |_| {}));
        assert!(a.receive(&bytes).is_err());
        // A refusal longer than the cap is malformed.
        let mut c = Handshake::new(Side::Connect, local("k", 1, 1, 0), [1; NONCE]);
        assert!(c.receive(&record(Op::Error, &[b'x'; 300], |_| {})).is_err());
    }

    #[test]
    fn a_busy_record_is_told_apart_from_a_refusal() {
        let mut c = Handshake::new(Side::Connect, local("k", 1, 1, 0), [1; NONCE]);
        match c.receive(&busy_record()) {
            Err(Error::Busy { why, .. }) => assert_eq!(why, BUSY_TEXT),
            other => panic!("busy: {other:?}"),
        }
        // After the acceptor's hello, too.
        let mut c = Handshake::new(Side::Connect, local("k", 1, 1, 0), [1; NONCE]);
        let a = Handshake::new(Side::Accept, local("k", 1, 2, 0), [2; NONCE]);
        c.receive(a.outgoing()).unwrap();
        assert!(matches!(c.receive(&busy_record()), Err(Error::Busy { .. })));
        // A plain refusal stays a refusal.
        let mut c = Handshake::new(Side::Connect, local("k", 1, 1, 0), [1; NONCE]);
        assert!(matches!(
            c.receive(&record(Op::Error, b"no", |_| {})),
            Err(Error::Refused(_))
        ));
    }

    #[test]
    fn random_bytes_never_panic() {
        let mut rng = fastrand::Rng::with_seed(11);
        for _ in 0..20_000 {
            let side = if rng.bool() {
                Side::Accept
            } else {
                Side::Connect
            };
            let mut h = Handshake::new(side, local("k", 1, 2, 0), [2; NONCE]);
            let mut buf = vec![0u8; rng.usize(0..200)];
            rng.fill(&mut buf);
            if rng.bool() && buf.len() >= 8 {
                buf[..4].copy_from_slice(&crate::wire::MAGIC.to_le_bytes());
                buf[4..6].copy_from_slice(&crate::wire::VERSION.to_le_bytes());
                buf[6] = rng.u8(1..10);
            }
            let n = buf.len().min(h.wants());
            let _ = h.receive(&buf[..n]);
        }
    }
}
