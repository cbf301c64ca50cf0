//! Row-sparse gradients: a tensor seen as a table of `len / dim` rows of `dim` floats, of
//! which a push carries only some rows.
//!
//! On the wire, one shard's part of a row push is written into the pusher's slot as
//! `count: u32`, then `count` entries `(offset: u32, n: u32)` (floats from the shard's start),
//! then the entries' values, `n` floats each, all little-endian. A row that straddles two
//! shards sends each its part. Duplicate rows are summed, in the order given, when the server
//! widens the payload into the shard's gradient ([`densify`]); rows not named are zero. A
//! payload that would not fit the slot (more bytes than the shard's own f32 values) goes as a
//! dense gradient instead ([`ShardRows::Dense`]).

use crate::error::{Error, Result};

/// Ranges of a shard: (first float from the shard's start, floats), in order.
pub type Ranges = Vec<(u32, u32)>;

/// One shard's part of a row push.
#[derive(Debug, Clone, PartialEq)]
pub enum ShardRows {
    /// The slot payload (see the module documentation).
    Sparse(Vec<u8>),
    /// The shard's whole gradient: the rows would take more room than that.
    Dense(Vec<f32>),
}

/// Checks a row push or pull: `dim ≥ 1` divides the tensor's `len`, every row exists, and
/// `values` holds `rows.len() · dim` floats. Returns the number of rows of the table.
pub fn check(tensor: &str, len: u64, dim: u64, rows: &[u64], values: usize) -> Result<u64> {
    if dim == 0 || !len.is_multiple_of(dim) {
        return Err(Error::Config(format!(
            "tensor {tensor:?} of {len} floats cannot be rows of {dim}: the row width must \
             divide its length"
        )));
    }
    let table = len / dim;
    if let Some(bad) = rows.iter().find(|&&r| r >= table) {
        return Err(Error::Config(format!(
            "row {bad} of tensor {tensor:?}: it has {table} rows of {dim}"
        )));
    }
    let want = rows.len() as u64 * dim;
    if values as u64 != want {
        return Err(Error::WrongLength {
            tensor: tensor.to_string(),
            expected: want,
            got: values as u64,
        });
    }
    Ok(table)
}

/// The part of `rows` (with their `values`, `dim` floats each) that falls in the shard of
/// `shard_len` floats starting at float `shard_off` of the tensor.
pub fn for_shard(
    shard_off: u64,
    shard_len: u64,
    dim: u64,
    rows: &[u64],
    values: &[f32],
) -> ShardRows {
    let end = shard_off + shard_len;
    // The part of row `r` in this shard: (first float of the tensor, floats).
    let part = |r: u64| {
        let a = r * dim;
        let (lo, hi) = (a.max(shard_off), (a + dim).min(end));
        (lo, hi.saturating_sub(lo))
    };
    // First pass: the payload's size (entries and floats), so it is written once, in place.
    let (mut count, mut floats) = (0u64, 0u64);
    for &r in rows {
        let (_, n) = part(r);
        count += u64::from(n > 0);
        floats += n;
    }
    let bytes = 4 + 8 * count + 4 * floats;
    if bytes > 4 * shard_len {
        let mut dense = vec![0f32; shard_len as usize];
        for (i, &r) in rows.iter().enumerate() {
            let (lo, n) = part(r);
            if n == 0 {
                continue;
            }
            let src = i * dim as usize + (lo - r * dim) as usize;
            let dst = (lo - shard_off) as usize;
            for (d, v) in dense[dst..][..n as usize]
                .iter_mut()
                .zip(&values[src..src + n as usize])
            {
                *d += v;
            }
        }
        return ShardRows::Dense(dense);
    }
    let mut out = vec![0u8; bytes as usize];
    let (head, rest) = out.split_at_mut(4);
    head.copy_from_slice(&(count as u32).to_le_bytes());
    let (index, vals) = rest.split_at_mut(8 * count as usize);
    let mut entries = index.chunks_exact_mut(8);
    let mut slots = vals.chunks_exact_mut(4);
    for (i, &r) in rows.iter().enumerate() {
        let (lo, n) = part(r);
        if n == 0 {
            continue;
        }
        if let Some(e) = entries.next() {
            e[..4].copy_from_slice(&((lo - shard_off) as u32).to_le_bytes());
            e[4..].copy_from_slice(&(n as u32).to_le_bytes());
        }
        let src = i * dim as usize + (lo - r * dim) as usize;
        // The values first: `zip` stops on them before it takes a slot too many.
        for (v, slot) in values[src..src + n as usize].iter().zip(&mut slots) {
            slot.copy_from_slice(&v.to_le_bytes());
        }
    }
    ShardRows::Sparse(out)
}

/// Reads a row payload out of a slot of `capacity` bytes (`read(offset, buf)` reads the
/// slot) and widens it into the shard's gradient of `len` floats: duplicate entries summed
/// in order, the rest zero. A payload that does not fit, or an entry outside the shard, is
/// [`Error::Malformed`].
pub fn densify(
    len: u64,
    capacity: u64,
    read: impl FnMut(u64, &mut [u8]) -> Result<()>,
) -> Result<Vec<f32>> {
    let (ranges, values) = parse(len, capacity, read)?;
    let mut grad = vec![0f32; len as usize];
    let mut at = 0;
    for (off, n) in ranges {
        let (off, n) = (off as usize, n as usize);
        for (g, v) in grad[off..off + n].iter_mut().zip(&values[at..at + n]) {
            *g += v;
        }
        at += n;
    }
    Ok(grad)
}

/// Reads a row payload (as [`densify`]) into its ranges `(first float, floats)` and their
/// values, one range after another.
pub fn parse(
    len: u64,
    capacity: u64,
    mut read: impl FnMut(u64, &mut [u8]) -> Result<()>,
) -> Result<(Ranges, Vec<f32>)> {
    let mut head = [0u8; 4];
    read(0, &mut head)?;
    let count = u64::from(u32::from_le_bytes(head));
    if 4 + 8 * count > capacity {
        return Err(Error::Malformed(format!(
            "a row push of {count} entries overflows its {capacity}-byte slot"
        )));
    }
    let mut raw = vec![0u8; 8 * count as usize];
    read(4, &mut raw)?;
    let mut entries = Vec::with_capacity(count as usize);
    let mut floats = 0u64;
    for e in raw.chunks_exact(8) {
        let off = u64::from(u32::from_le_bytes([e[0], e[1], e[2], e[3]]));
        let n = u64::from(u32::from_le_bytes([e[4], e[5], e[6], e[7]]));
        if off + n > len {
            return Err(Error::Malformed(format!(
                "a row push entry of {n} floats at {off} lies outside the shard's {len}"
            )));
        }
        entries.push((off as u32, n as u32));
        floats += n;
    }
    let start = 4 + 8 * count;
    if start + 4 * floats > capacity {
        return Err(Error::Malformed(format!(
            "a row push of {floats} values overflows its {capacity}-byte slot"
        )));
    }
    let mut vals = vec![0u8; 4 * floats as usize];
    read(start, &mut vals)?;
    let values = vals
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    Ok((entries, values))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The dense gradient of the whole tensor, duplicates summed in order.
    fn dense(len: u64, dim: u64, rows: &[u64], values: &[f32]) -> Vec<f32> {
        let mut g = vec![0f32; len as usize];
        for (i, &r) in rows.iter().enumerate() {
            for j in 0..dim as usize {
                g[(r * dim) as usize + j] += values[i * dim as usize + j];
            }
        }
        g
    }

    #[test]
    fn shards_widen_to_the_dense_gradient_with_duplicates_summed() {
        let mut rng = fastrand::Rng::with_seed(8);
        for _ in 0..300 {
            let dim = rng.u64(1..6);
            let table = rng.u64(1..40);
            let len = table * dim;
            // Shards at arbitrary float boundaries: rows straddle them.
            let mut cuts = vec![0, len];
            for _ in 0..rng.usize(0..4) {
                cuts.push(rng.u64(0..=len));
            }
            cuts.sort();
            cuts.dedup();
            let n = rng.usize(0..3 * table as usize);
            let rows: Vec<u64> = (0..n).map(|_| rng.u64(0..table)).collect();
            let values: Vec<f32> = (0..n * dim as usize).map(|_| rng.f32() - 0.5).collect();
            assert_eq!(check("t", len, dim, &rows, values.len()).unwrap(), table);
            let want = dense(len, dim, &rows, &values);
            let mut got = Vec::new();
            for w in cuts.windows(2) {
                let (off, sl) = (w[0], w[1] - w[0]);
                let part = match for_shard(off, sl, dim, &rows, &values) {
                    ShardRows::Dense(d) => d,
                    ShardRows::Sparse(p) => {
                        assert!(p.len() as u64 <= 4 * sl.max(1) + 4, "fits its slot");
                        densify(sl, 4 * sl, |o, buf| {
                            buf.copy_from_slice(&p[o as usize..o as usize + buf.len()]);
                            Ok(())
                        })
                        .unwrap()
                    }
                };
                got.extend(part);
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&got),
                bits(&want),
                "dim {dim}, cuts {cuts:?}, rows {rows:?}"
            );
        }
    }

    #[test]
    fn bad_rows_and_bad_payloads_are_typed_errors() {
        assert!(
            check("emb", 100, 8, &[], 0)
                .unwrap_err()
                .to_string()
                .contains("the row width must divide its length")
        );
        assert!(
            check("emb", 100, 10, &[3, 10], 20)
                .unwrap_err()
                .to_string()
                .contains("row 10 of tensor \"emb\": it has 10 rows of 10")
        );
        assert!(matches!(
            check("emb", 100, 10, &[3], 9),
            Err(Error::WrongLength {
                expected: 10,
                got: 9,
                ..
            })
        ));
        // A count that overflows the slot, an entry outside the shard.
        let mut p = 1000u32.to_le_bytes().to_vec();
        p.resize(64, 0);
        let read = |p: Vec<u8>| {
            move |o: u64, buf: &mut [u8]| {
                let o = o as usize;
                if o + buf.len() > p.len() {
                    return Err(Error::Malformed("past the slot".into()));
                }
                buf.copy_from_slice(&p[o..o + buf.len()]);
                Ok(())
            }
        };
        assert!(matches!(densify(16, 64, read(p)), Err(Error::Malformed(_))));
        let mut q = 1u32.to_le_bytes().to_vec();
        q.extend(10u32.to_le_bytes());
        q.extend(8u32.to_le_bytes());
        q.resize(64, 0);
        let e = densify(16, 64, read(q)).unwrap_err().to_string();
        assert!(e.contains("lies outside the shard"), "{e}");
    }
}
