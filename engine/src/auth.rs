//! Challenge–response admission: the job token never crosses the wire.
//!
//! A node opens a link with `Msg::Knock`; whoever accepts it (the scheduler for a node's
//! rendezvous, a server for a worker's attach) answers with `Msg::Challenge`, a fresh random
//! nonce of [`NONCE`] bytes (from the kernel's getrandom). The connecting side answers with `HMAC-SHA256(token, purpose ‖ nonce)`
//! in its `Hello` or `Attach`, which the acceptor checks in constant time. A nonce is used
//! once: a recorded answer is worthless for any other link, and a peer of another job (or with
//! a stale token) is refused without learning anything about the token.

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use crate::{Error, Result};

/// Answers a knock on `link`: sends a fresh challenge and remembers its nonce for the
/// answer (a send that fails is the link's end, seen as its `Closed`).
pub fn challenge(
    link: &falcon_transport::Link,
    nonces: &mut std::collections::HashMap<falcon_transport::LinkId, Vec<u8>>,
) -> Result<()> {
    let nonce = nonce()?;
    let _ = link.send(
        &crate::proto::Msg::Challenge {
            nonce: nonce.clone(),
        }
        .encode(),
    );
    nonces.insert(link.id(), nonce);
    Ok(())
}

/// Nonce length in bytes.
pub const NONCE: usize = 32;

/// What an answer is for (an answer for one purpose is no answer for another).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// A node's hello to the scheduler.
    Hello,
    /// A worker's attach to a server.
    Attach,
}

impl Purpose {
    fn label(self) -> &'static [u8] {
        match self {
            Purpose::Hello => b"falcon/hello/v1\0",
            Purpose::Attach => b"falcon/attach/v1\0",
        }
    }
}

/// A fresh challenge nonce.
pub fn nonce() -> Result<Vec<u8>> {
    let mut buf = vec![0u8; NONCE];
    let mut filled = 0;
    while filled < NONCE {
        match rustix::rand::getrandom(&mut buf[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => filled += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => {
                return Err(Error::Config(format!(
                    "no randomness for the admission challenge: {e}"
                )));
            }
        }
    }
    Ok(buf)
}

fn mac(token: &str, purpose: Purpose, nonce: &[u8]) -> Hmac<Sha256> {
    // HMAC takes keys of any length: this cannot fail.
    let mut m = <Hmac<Sha256> as KeyInit>::new_from_slice(token.as_bytes())
        .expect("HMAC accepts any key length");
    m.update(purpose.label());
    m.update(nonce);
    m
}

/// The answer to `nonce` for `purpose`, proving knowledge of `token`.
pub fn answer(token: &str, purpose: Purpose, nonce: &[u8]) -> Vec<u8> {
    mac(token, purpose, nonce).finalize().into_bytes().to_vec()
}

/// Whether `proof` answers `nonce` for `purpose` with `token` (constant time).
pub fn check(token: &str, purpose: Purpose, nonce: &[u8], proof: &[u8]) -> bool {
    nonce.len() == NONCE && mac(token, purpose, nonce).verify_slice(proof).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_right_token_nonce_and_purpose_pass() {
        let n = nonce().unwrap();
        assert_eq!(n.len(), NONCE);
        assert_ne!(n, nonce().unwrap(), "two nonces differ");
        let a = answer("secret", Purpose::Hello, &n);
        assert!(check("secret", Purpose::Hello, &n, &a));
        assert!(!check("secreT", Purpose::Hello, &n, &a));
        assert!(!check("secret", Purpose::Attach, &n, &a));
        assert!(!check("secret", Purpose::Hello, &nonce().unwrap(), &a));
        assert!(!check("secret", Purpose::Hello, &n, &a[..31]));
        assert!(!check("secret", Purpose::Hello, &n[..16], &a));
        // The token does not appear in the answer.
        assert!(!a.windows(6).any(|w| w == b"secret"));
    }
}
