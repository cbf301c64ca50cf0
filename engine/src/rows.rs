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
    /// The slot payload (see the module documentation), of this many bytes, written.
    Sparse(u64),
    /// The shard's whole gradient: the rows would take more room than that.
    Dense(Vec<f32>),
}

/// Bytes a row payload is written in at a time: it is built a cache-sized piece at a time,
/// not whole and then copied.
const PIECE: usize = 64 << 10;

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

/// The rows of a push or pull that fall in one shard: which (indices into the request's
/// rows), how many parts (one per such row) and how many floats they hold.
#[derive(Debug, Clone, PartialEq)]
pub struct Pick {
    /// Indices into the request's rows, in order; `None`: every row (one shard holds the
    /// whole tensor).
    rows: Option<Vec<u32>>,
    /// Parts in the shard (one per picked row).
    pub count: u64,
    /// Floats of those parts.
    pub floats: u64,
}

impl Pick {
    /// Each picked row's index into the request's `n` rows, in order.
    pub fn iter(&self, n: usize) -> impl Iterator<Item = usize> + '_ {
        let (all, some) = match &self.rows {
            None => (0..n, [].iter()),
            Some(ix) => (0..0, ix.iter()),
        };
        all.chain(some.map(|&i| i as usize))
    }
}

/// The rows of a request that fall in each shard of a tensor of `len` floats, found in one
/// pass over `rows` (row `r` covers floats `r·dim .. (r+1)·dim`). `bounds` are the shards'
/// (first float, floats), in any order, covering the tensor without gaps; the picks come
/// back in the order of `bounds`. Rows must have been [`check`]ed; a request of more than
/// `u32::MAX` rows is refused.
pub fn split(len: u64, bounds: &[(u64, u64)], dim: u64, rows: &[u64]) -> Result<Vec<Pick>> {
    if rows.len() as u64 > u64::from(u32::MAX) {
        return Err(Error::Config(format!(
            "a row request of {} rows: at most {} in one request",
            rows.len(),
            u32::MAX
        )));
    }
    if let [(0, l)] = bounds
        && *l >= len
    {
        let n = rows.len() as u64;
        return Ok(vec![Pick {
            rows: None,
            count: n,
            floats: n * dim,
        }]);
    }
    // The shards by their first float, and the end of each.
    let mut order: Vec<usize> = (0..bounds.len()).collect();
    order.sort_by_key(|&k| bounds[k].0);
    let ends: Vec<u64> = order.iter().map(|&k| bounds[k].0 + bounds[k].1).collect();
    let mut picks: Vec<Pick> = bounds
        .iter()
        .map(|_| Pick {
            rows: Some(Vec::with_capacity(rows.len() / bounds.len().max(1) + 16)),
            count: 0,
            floats: 0,
        })
        .collect();
    // The sorted shard of the last row's first float: sorted rows rarely move on.
    let mut at = 0usize;
    for (i, &r) in rows.iter().enumerate() {
        let (mut a, b) = (r * dim, r * dim + dim);
        let within = at < order.len() && bounds[order[at]].0 <= a && a < ends[at];
        if !within {
            at = ends.partition_point(|&e| e <= a);
        }
        let mut k = at;
        while k < order.len() && a < b {
            let (o, e) = (bounds[order[k]].0, ends[k]);
            let (lo, hi) = (a.max(o), b.min(e));
            if hi <= lo {
                break;
            }
            let p = &mut picks[order[k]];
            if let Some(ix) = p.rows.as_mut() {
                ix.push(i as u32);
            }
            p.count += 1;
            p.floats += hi - lo;
            a = hi;
            k += 1;
        }
    }
    Ok(picks)
}

/// The part of `rows` (with their `values`, `dim` floats each) picked for the shard of
/// `shard_len` floats starting at float `shard_off` of the tensor (see [`split`]): a row
/// payload handed to `write(offset, bytes)` piece by piece, or the dense gradient where
/// that would be smaller.
pub fn for_shard(
    shard_off: u64,
    shard_len: u64,
    dim: u64,
    rows: &[u64],
    values: &[f32],
    pick: &Pick,
    mut write: impl FnMut(u64, &[u8]) -> Result<()>,
) -> Result<ShardRows> {
    let end = shard_off + shard_len;
    // The part of row `r` in this shard: (first float of the tensor, floats).
    let part = |r: u64| {
        let a = r * dim;
        let (lo, hi) = (a.max(shard_off), (a + dim).min(end));
        (lo, hi.saturating_sub(lo))
    };
    let (count, floats) = (pick.count, pick.floats);
    let bytes = 4 + 8 * count + 4 * floats;
    if bytes > 4 * shard_len {
        let mut dense = vec![0f32; shard_len as usize];
        for i in pick.iter(rows.len()) {
            let r = rows[i];
            let (lo, n) = part(r);
            let src = i * dim as usize + (lo - r * dim) as usize;
            let dst = (lo - shard_off) as usize;
            for (d, v) in dense[dst..][..n as usize]
                .iter_mut()
                .zip(&values[src..src + n as usize])
            {
                *d += v;
            }
        }
        return Ok(ShardRows::Dense(dense));
    }
    write(0, &(count as u32).to_le_bytes())?;
    let mut piece: Vec<u8> = Vec::with_capacity(PIECE + 8);
    // The entries from byte 4.
    let mut at = 4u64;
    for i in pick.iter(rows.len()) {
        let (lo, n) = part(rows[i]);
        piece.extend_from_slice(&((lo - shard_off) as u32).to_le_bytes());
        piece.extend_from_slice(&(n as u32).to_le_bytes());
        if piece.len() >= PIECE {
            write(at, &piece)?;
            at += piece.len() as u64;
            piece.clear();
        }
    }
    write(at, &piece)?;
    at += piece.len() as u64;
    piece.clear();
    // Then the values, one part after another.
    let vb = zerocopy::IntoBytes::as_bytes(values);
    if pick.rows.is_none() && floats == rows.len() as u64 * dim {
        // Every row, each whole: the values as given.
        write(at, vb)?;
        return Ok(ShardRows::Sparse(bytes));
    }
    for i in pick.iter(rows.len()) {
        let r = rows[i];
        let (lo, n) = part(r);
        let src = 4 * (i * dim as usize + (lo - r * dim) as usize);
        piece.extend_from_slice(&vb[src..src + 4 * n as usize]);
        if piece.len() >= PIECE {
            write(at, &piece)?;
            at += piece.len() as u64;
            piece.clear();
        }
    }
    write(at, &piece)?;
    Ok(ShardRows::Sparse(bytes))
}

/// Writes the ranges a row pull asks of the shard of `shard_len` floats starting at float
/// `shard_off` into `out` (`8 · pick.count` bytes; as the message carries them:
/// little-endian `(first float, floats)` pairs), for the rows `pick` names.
pub fn ranges_for_shard(
    shard_off: u64,
    shard_len: u64,
    dim: u64,
    rows: &[u64],
    pick: &Pick,
    out: &mut [u8],
) {
    let end = shard_off + shard_len;
    for (i, e) in pick.iter(rows.len()).zip(out.chunks_exact_mut(8)) {
        let a = rows[i] * dim;
        let (lo, hi) = (a.max(shard_off), (a + dim).min(end));
        e[..4].copy_from_slice(&((lo - shard_off) as u32).to_le_bytes());
        e[4..].copy_from_slice(&((hi - lo) as u32).to_le_bytes());
    }
}

/// Writes a row pull's answer from the shard of `shard_len` floats starting at float
/// `shard_off` (`values`: the picked parts' floats, little-endian, in order) into `out`
/// (`rows.len() · dim` floats in the order of `rows`). A wrong number of bytes is
/// [`Error::Malformed`] and leaves `out` alone.
pub fn scatter(
    shard_off: u64,
    shard_len: u64,
    dim: u64,
    rows: &[u64],
    pick: &Pick,
    values: &[u8],
    out: &mut [f32],
) -> Result<()> {
    if values.len() as u64 != 4 * pick.floats {
        return Err(Error::Malformed(format!(
            "{} bytes of row values for {} floats asked",
            values.len(),
            pick.floats
        )));
    }
    let end = shard_off + shard_len;
    let mut at = 0usize;
    for i in pick.iter(rows.len()) {
        let a = rows[i] * dim;
        let (lo, hi) = (a.max(shard_off), (a + dim).min(end));
        let dst = i * dim as usize + (lo - a) as usize;
        let n = (hi - lo) as usize;
        if n == 1 {
            out[dst] =
                f32::from_le_bytes([values[at], values[at + 1], values[at + 2], values[at + 3]]);
        } else {
            zerocopy::IntoBytes::as_mut_bytes(&mut out[dst..dst + n])
                .copy_from_slice(&values[at..at + 4 * n]);
        }
        at += 4 * n;
    }
    Ok(())
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
    // The entries read a cache-sized piece at a time.
    let mut raw = vec![0u8; (8 * count as usize).min(PIECE)];
    let mut entries = Vec::with_capacity(count as usize);
    let mut floats = 0u64;
    let mut at = 4u64;
    while at < 4 + 8 * count {
        let piece = &mut raw[..(4 + 8 * count - at).min(PIECE as u64) as usize];
        read(at, piece)?;
        at += piece.len() as u64;
        for e in piece.chunks_exact(8) {
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
    }
    let start = 4 + 8 * count;
    if start + 4 * floats > capacity {
        return Err(Error::Malformed(format!(
            "a row push of {floats} values overflows its {capacity}-byte slot"
        )));
    }
    let mut values = vec![0f32; floats as usize];
    read(
        start,
        zerocopy::IntoBytes::as_mut_bytes(values.as_mut_slice()),
    )?;
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
            let bounds: Vec<(u64, u64)> =
                cuts.windows(2).map(|w| (w[0], w[1] - w[0])).rev().collect();
            let picks = split(len, &bounds, dim, &rows).unwrap();
            for (w, pick) in cuts.windows(2).zip(picks.iter().rev()) {
                let (off, sl) = (w[0], w[1] - w[0]);
                let mut p = Vec::new();
                let put = |o: u64, b: &[u8]| {
                    let o = o as usize;
                    if p.len() < o + b.len() {
                        p.resize(o + b.len(), 0);
                    }
                    p[o..o + b.len()].copy_from_slice(b);
                    Ok(())
                };
                let part = match for_shard(off, sl, dim, &rows, &values, pick, put).unwrap() {
                    ShardRows::Dense(d) => d,
                    ShardRows::Sparse(bytes) => {
                        assert_eq!(bytes, p.len() as u64);
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
    fn a_pull_split_over_shards_gathers_every_row_in_request_order() {
        let mut rng = fastrand::Rng::with_seed(9);
        for _ in 0..300 {
            let dim = rng.u64(1..6);
            let table = rng.u64(1..40);
            let len = table * dim;
            let mut cuts = vec![0, len];
            for _ in 0..rng.usize(0..4) {
                cuts.push(rng.u64(0..=len));
            }
            cuts.sort();
            cuts.dedup();
            let w: Vec<f32> = (0..len).map(|i| i as f32 + 0.5).collect();
            let n = rng.usize(0..3 * table as usize);
            let rows: Vec<u64> = (0..n).map(|_| rng.u64(0..table)).collect();
            let bounds: Vec<(u64, u64)> = cuts.windows(2).map(|c| (c[0], c[1] - c[0])).collect();
            let picks = split(len, &bounds, dim, &rows).unwrap();
            let mut out = vec![f32::NAN; n * dim as usize];
            for (&(off, sl), pick) in bounds.iter().zip(&picks) {
                // What a server answers: the asked ranges' values, in order.
                let mut raw = vec![0u8; 8 * pick.count as usize];
                ranges_for_shard(off, sl, dim, &rows, pick, &mut raw);
                let ranges = crate::proto::ranges_from_bytes(&raw).unwrap();
                assert_eq!(ranges.len() as u64, pick.count);
                let mut answer = Vec::new();
                for (o, k) in ranges {
                    for x in &w[(off + u64::from(o)) as usize..][..k as usize] {
                        answer.extend_from_slice(&x.to_le_bytes());
                    }
                }
                scatter(off, sl, dim, &rows, pick, &answer, &mut out).unwrap();
                // A short answer is refused.
                if !answer.is_empty() {
                    answer.pop();
                    assert!(matches!(
                        scatter(off, sl, dim, &rows, pick, &answer, &mut out),
                        Err(Error::Malformed(_))
                    ));
                }
            }
            let want: Vec<f32> = rows
                .iter()
                .flat_map(|&r| w[(r * dim) as usize..][..dim as usize].to_vec())
                .collect();
            assert_eq!(out, want, "dim {dim}, cuts {cuts:?}, rows {rows:?}");
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
