//! Row-sparse gradients: a tensor seen as a table of `len / dim` rows of `dim` floats, of
//! which a push carries only some rows.
//!
//! A request names the parts of rows that fall in one shard with an *index*, in one of two
//! forms, all little-endian:
//! - plain: `count: u32` (bit 31 clear), then `count` entries `(offset: u32, n: u32)`
//!   (floats from the shard's start), in any order, repeats allowed;
//! - packed, for parts that are all `width` floats, in ascending order and not overlapping
//!   (whole rows, sorted, distinct: what a key-value request carries): `count | 1 << 31: u32`,
//!   `width: u32`, `bytes: u32`, then `bytes` bytes of `count` LEB128 gaps, the k-th part
//!   starting `gap` floats after the end of the one before (the first: after float 0). A
//!   sorted tenth of a table costs about one byte a row instead of eight.
//!
//! A row push writes the index into the pusher's slot, followed by the parts' values, `n`
//! floats each; a row pull carries the index in its message. A row that straddles two
//! shards sends each its part. Duplicate rows are summed, in the order given, when the server
//! widens the payload into the shard's gradient ([`densify`]); rows not named are zero. A
//! payload that would not fit the slot (more bytes than the shard's own f32 values) goes as a
//! dense gradient instead ([`ShardRows::Dense`]).

use crate::error::{Error, Result};

/// Ranges of a shard: (first float from the shard's start, floats), in order.
pub type Ranges = Vec<(u32, u32)>;

/// Bit 31 of an index's count: the packed form (see the module documentation).
const PACKED: u32 = 1 << 31;

/// The form an index of some parts takes, and its size in bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IndexPlan {
    /// `Some(width)`: packed, every part `width` floats.
    width: Option<u64>,
    /// Bytes of the whole index.
    pub bytes: u64,
}

/// Plans the index of `count` parts `(offset, floats)` given in order: packed where they
/// allow it and it is smaller, else plain.
pub fn plan_index(count: u64, parts: impl Iterator<Item = (u64, u64)>) -> IndexPlan {
    let plain = IndexPlan {
        width: None,
        bytes: 4 + 8 * count,
    };
    let (mut width, mut end, mut gaps) = (None, 0u64, 0u64);
    for (off, n) in parts {
        if *width.get_or_insert(n) != n || off < end {
            return plain;
        }
        gaps += leb_len(off - end);
        end = off + n;
    }
    match width {
        Some(w) if 12 + gaps < plain.bytes => IndexPlan {
            width: Some(w),
            bytes: 12 + gaps,
        },
        _ => plain,
    }
}

/// Writes the index `plan` was made for (the same parts again) into `out`, `plan.bytes` long.
pub fn write_index(
    plan: IndexPlan,
    count: u64,
    parts: impl Iterator<Item = (u64, u64)>,
    out: &mut [u8],
) {
    match plan.width {
        None => {
            out[..4].copy_from_slice(&(count as u32).to_le_bytes());
            for ((off, n), e) in parts.zip(out[4..].chunks_exact_mut(8)) {
                e[..4].copy_from_slice(&(off as u32).to_le_bytes());
                e[4..].copy_from_slice(&(n as u32).to_le_bytes());
            }
        }
        Some(w) => {
            out[..4].copy_from_slice(&(count as u32 | PACKED).to_le_bytes());
            out[4..8].copy_from_slice(&(w as u32).to_le_bytes());
            out[8..12].copy_from_slice(&((plan.bytes - 12) as u32).to_le_bytes());
            let (mut at, mut end) = (12usize, 0u64);
            for (off, n) in parts {
                let mut gap = off - end;
                while gap >= 0x80 {
                    out[at] = gap as u8 | 0x80;
                    gap >>= 7;
                    at += 1;
                }
                out[at] = gap as u8;
                at += 1;
                end = off + n;
            }
        }
    }
}

/// Bytes of `v` in LEB128.
fn leb_len(v: u64) -> u64 {
    u64::from((64 - (v | 1).leading_zeros()).div_ceil(7))
}

/// The index at the start of `read` (which reads `capacity` bytes at an offset), of parts
/// of a shard of `len` floats: the parts, and the index's size in bytes. A count or a size
/// past `capacity`, a part outside the shard, or a malformed gap is [`Error::Malformed`].
pub fn read_index(
    len: u64,
    capacity: u64,
    mut read: impl FnMut(u64, &mut [u8]) -> Result<()>,
) -> Result<(Ranges, u64)> {
    let bad = |what: String| Err(Error::Malformed(what));
    if capacity < 4 {
        return bad(format!("a row index in {capacity} bytes"));
    }
    let mut head = [0u8; 4];
    read(0, &mut head)?;
    let head = u32::from_le_bytes(head);
    let count = u64::from(head & !PACKED);
    if head & PACKED == 0 {
        if 4 + 8 * count > capacity {
            return bad(format!(
                "a row index of {count} entries overflows its {capacity} bytes"
            ));
        }
        // The entries read a cache-sized piece at a time.
        let mut raw = vec![0u8; (8 * count as usize).min(PIECE)];
        let mut entries = Vec::with_capacity(count as usize);
        let mut at = 4u64;
        while at < 4 + 8 * count {
            let piece = &mut raw[..(4 + 8 * count - at).min(PIECE as u64) as usize];
            read(at, piece)?;
            at += piece.len() as u64;
            for e in piece.chunks_exact(8) {
                let off = u32::from_le_bytes([e[0], e[1], e[2], e[3]]);
                let n = u32::from_le_bytes([e[4], e[5], e[6], e[7]]);
                if u64::from(off) + u64::from(n) > len {
                    return bad(format!(
                        "a row entry of {n} floats at {off} lies outside the shard's {len}"
                    ));
                }
                entries.push((off, n));
            }
        }
        return Ok((entries, 4 + 8 * count));
    }
    if capacity < 12 {
        return bad(format!("a packed row index in {capacity} bytes"));
    }
    let mut more = [0u8; 8];
    read(4, &mut more)?;
    let width = u64::from(u32::from_le_bytes([more[0], more[1], more[2], more[3]]));
    let bytes = u64::from(u32::from_le_bytes([more[4], more[5], more[6], more[7]]));
    if 12 + bytes > capacity || count > bytes {
        return bad(format!(
            "a packed row index of {count} gaps in {bytes} bytes does not fit its {capacity}"
        ));
    }
    let mut raw = vec![0u8; bytes as usize];
    read(12, &mut raw)?;
    let mut entries = Vec::with_capacity(count as usize);
    let (mut at, mut end) = (0usize, 0u64);
    for _ in 0..count {
        let Some(&first) = raw.get(at) else {
            return bad("a packed row index ends inside a gap".into());
        };
        at += 1;
        let mut gap = u64::from(first);
        if first >= 0x80 {
            // A gap of more than one byte.
            gap &= 0x7f;
            let mut shift = 7;
            loop {
                let Some(&b) = raw.get(at) else {
                    return bad("a packed row index ends inside a gap".into());
                };
                at += 1;
                if shift > 56 {
                    return bad("a packed row index has a gap of more than 64 bits".into());
                }
                gap |= u64::from(b & 0x7f) << shift;
                shift += 7;
                if b < 0x80 {
                    break;
                }
            }
        }
        let off = end.saturating_add(gap);
        end = off.saturating_add(width);
        entries.push((off as u32, width as u32));
    }
    // Offsets only grow: the last part's end bounds them all.
    if end > len {
        return bad(format!(
            "a row part of {width} floats ends at float {end}, past the shard's {len}"
        ));
    }
    if at as u64 != bytes {
        return bad(format!(
            "a packed row index of {count} gaps uses {at} of its {bytes} bytes"
        ));
    }
    Ok((entries, 12 + bytes))
}

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
    /// Which of the request's rows.
    rows: Picked,
    /// Parts in the shard (one per picked row).
    pub count: u64,
    /// Floats of those parts.
    pub floats: u64,
}

/// Which of a request's rows a shard holds a part of.
#[derive(Debug, Clone, PartialEq)]
enum Picked {
    /// The request's rows `s..e`, each whole in the shard (every row of the only shard, or
    /// sorted rows over several): their values are one slice of the request's, their answer
    /// one slice of the caller's buffer, their parts come straight from the rows.
    Run(usize, usize),
    /// Indices into the request's rows, in order.
    Some(Vec<u32>),
}

impl Pick {
    /// Each picked row's index into the request's rows, in order.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        let (run, some) = match &self.rows {
            &Picked::Run(s, e) => (s..e, [].iter()),
            Picked::Some(ix) => (0..0, ix.iter()),
        };
        run.chain(some.map(|&i| i as usize))
    }

    /// `Some((s, e))` where the picked rows are the run `s..e` of whole rows.
    fn run(&self) -> Option<(usize, usize)> {
        match self.rows {
            Picked::Run(s, e) => Some((s, e)),
            Picked::Some(_) => None,
        }
    }
}

/// The part of the row starting at float `a` (`dim` floats) that lies in the floats
/// `off..end` of a shard: (its first float, its end), both of the tensor; empty where the
/// row lies outside.
fn part(a: u64, dim: u64, off: u64, end: u64) -> (u64, u64) {
    let lo = a.max(off);
    (lo, (a + dim).min(end).max(lo))
}

/// The rows of a request that fall in each shard of a tensor of `len` floats, found in one
/// pass over `rows` (row `r` covers floats `r·dim .. (r+1)·dim`). `bounds` are the shards'
/// (first float, floats), in any order, covering the tensor without gaps or overlaps (empty
/// shards pick nothing); the picks come back in the order of `bounds`. Rows must have been
/// [`check`]ed; a request of 2³¹ rows or more is refused.
pub fn split(len: u64, bounds: &[(u64, u64)], dim: u64, rows: &[u64]) -> Result<Vec<Pick>> {
    // Counts travel in 31 bits (bit 31 marks a packed index).
    if rows.len() as u64 >= u64::from(PACKED) {
        return Err(Error::Config(format!(
            "a row request of {} rows: at most {} in one request",
            rows.len(),
            PACKED - 1
        )));
    }
    if let [(0, l)] = bounds
        && *l >= len
    {
        let n = rows.len() as u64;
        return Ok(vec![Pick {
            rows: Picked::Run(0, rows.len()),
            count: n,
            floats: n * dim,
        }]);
    }
    // The shards that hold floats, by their first float, and the end of each (an empty
    // shard picks nothing).
    let mut order: Vec<usize> = (0..bounds.len()).filter(|&k| bounds[k].1 > 0).collect();
    order.sort_by_key(|&k| bounds[k].0);
    let ends: Vec<u64> = order.iter().map(|&k| bounds[k].0 + bounds[k].1).collect();
    let mut picks: Vec<Pick> = bounds
        .iter()
        .map(|_| Pick {
            rows: Picked::Some(Vec::with_capacity(rows.len() / bounds.len().max(1) + 16)),
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
            if let Picked::Some(ix) = &mut p.rows {
                ix.push(i as u32);
            }
            p.count += 1;
            p.floats += hi - lo;
            a = hi;
            k += 1;
        }
    }
    for p in &mut picks {
        if let Picked::Some(ix) = &p.rows
            && let (Some(&first), Some(&last)) = (ix.first(), ix.last())
            && (last - first) as usize + 1 == ix.len()
            && p.floats == p.count * dim
        {
            p.rows = Picked::Run(first as usize, last as usize + 1);
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
    let floats = pick.floats;
    let (plan, index) = index_for(shard_off, shard_len, dim, rows, pick);
    let bytes = plan.bytes + 4 * floats;
    if bytes > 4 * shard_len {
        let mut dense = vec![0f32; shard_len as usize];
        for i in pick.iter() {
            let a = rows[i] * dim;
            let (lo, hi) = part(a, dim, shard_off, end);
            let src = i * dim as usize + (lo - a) as usize;
            let dst = (lo - shard_off) as usize;
            for (d, v) in dense[dst..][..(hi - lo) as usize]
                .iter_mut()
                .zip(&values[src..])
            {
                *d += v;
            }
        }
        return Ok(ShardRows::Dense(dense));
    }
    write(0, &index)?;
    let mut at = plan.bytes;
    let mut piece: Vec<u8> = Vec::with_capacity(PIECE + 8);
    // Then the values, one part after another.
    let vb = zerocopy::IntoBytes::as_bytes(values);
    if let Some((s, e)) = pick.run() {
        // Consecutive rows, each whole: their values as given.
        let d = dim as usize;
        write(at, &vb[4 * s * d..4 * e * d])?;
        return Ok(ShardRows::Sparse(bytes));
    }
    for i in pick.iter() {
        let a = rows[i] * dim;
        let (lo, hi) = part(a, dim, shard_off, end);
        let src = 4 * (i * dim as usize + (lo - a) as usize);
        piece.extend_from_slice(&vb[src..src + 4 * (hi - lo) as usize]);
        if piece.len() >= PIECE {
            write(at, &piece)?;
            at += piece.len() as u64;
            piece.clear();
        }
    }
    write(at, &piece)?;
    Ok(ShardRows::Sparse(bytes))
}

/// The index of the parts of the rows `pick` names in the shard of `shard_len` floats
/// starting at float `shard_off` (what a row pull asks for, what a row push carries): its
/// plan and its bytes.
pub fn index_for(
    shard_off: u64,
    shard_len: u64,
    dim: u64,
    rows: &[u64],
    pick: &Pick,
) -> (IndexPlan, Vec<u8>) {
    fn build<I>(count: u64, parts: impl Fn() -> I) -> (IndexPlan, Vec<u8>)
    where
        I: Iterator<Item = (u64, u64)>,
    {
        let plan = plan_index(count, parts());
        let mut out = vec![0u8; plan.bytes as usize];
        write_index(plan, count, parts(), &mut out);
        (plan, out)
    }
    let end = shard_off + shard_len;
    match pick.run() {
        // Consecutive rows, each whole: the parts come straight from the rows.
        Some((s, e)) => build(pick.count, || {
            rows[s..e].iter().map(|&r| (r * dim - shard_off, dim))
        }),
        None => build(pick.count, || {
            pick.iter().map(|i| {
                let (lo, hi) = part(rows[i] * dim, dim, shard_off, end);
                (lo - shard_off, hi - lo)
            })
        }),
    }
}

/// The parts a row pull's message asks for: its whole index (the shard's bounds are checked
/// where the shard is known).
pub fn index_of_pull(index: &[u8]) -> Result<Ranges> {
    let (ranges, used) = read_index(u64::from(u32::MAX), index.len() as u64, |o, b| {
        b.copy_from_slice(&index[o as usize..o as usize + b.len()]);
        Ok(())
    })?;
    if used != index.len() as u64 {
        return Err(Error::Malformed(format!(
            "a row pull's index of {used} bytes is followed by {} more",
            index.len() as u64 - used
        )));
    }
    Ok(ranges)
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
    if let Some((s, e)) = pick.run() {
        // Consecutive rows, each whole: the answer is that slice of `out` as it stands.
        let d = dim as usize;
        zerocopy::IntoBytes::as_mut_bytes(&mut out[s * d..e * d]).copy_from_slice(values);
        return Ok(());
    }
    let end = shard_off + shard_len;
    let mut at = 0usize;
    for i in pick.iter() {
        let a = rows[i] * dim;
        let (lo, hi) = part(a, dim, shard_off, end);
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
    let (entries, start) = read_index(len, capacity, &mut read)?;
    let floats: u64 = entries.iter().map(|&(_, n)| u64::from(n)).sum();
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

    /// A random table (row width, rows, floats), shard cuts at arbitrary float boundaries
    /// (rows straddle them) and a request of random rows: half the time sorted and distinct,
    /// else with repeats and in any order.
    fn random_request(rng: &mut fastrand::Rng) -> (u64, u64, u64, Vec<u64>, Vec<u64>) {
        let dim = rng.u64(1..6);
        let table = rng.u64(1..40);
        let len = table * dim;
        let mut cuts = vec![0, len];
        for _ in 0..rng.usize(0..4) {
            cuts.push(rng.u64(0..=len));
        }
        cuts.sort();
        cuts.dedup();
        let n = rng.usize(0..3 * table as usize);
        let mut rows: Vec<u64> = (0..n).map(|_| rng.u64(0..table)).collect();
        if rng.bool() {
            // Sorted and distinct: what travels packed.
            rows.sort_unstable();
            rows.dedup();
        }
        (dim, table, len, cuts, rows)
    }

    #[test]
    fn shards_widen_to_the_dense_gradient_with_duplicates_summed() {
        let mut rng = fastrand::Rng::with_seed(8);
        for _ in 0..300 {
            let (dim, table, len, cuts, rows) = random_request(&mut rng);
            let n = rows.len();
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
            let (dim, _, len, cuts, rows) = random_request(&mut rng);
            let n = rows.len();
            let w: Vec<f32> = (0..len).map(|i| i as f32 + 0.5).collect();
            let bounds: Vec<(u64, u64)> = cuts.windows(2).map(|c| (c[0], c[1] - c[0])).collect();
            let picks = split(len, &bounds, dim, &rows).unwrap();
            let mut out = vec![f32::NAN; n * dim as usize];
            for (&(off, sl), pick) in bounds.iter().zip(&picks) {
                // What a server answers: the asked ranges' values, in order.
                let (plan, raw) = index_for(off, sl, dim, &rows, pick);
                let (ranges, used) = read_index(sl, raw.len() as u64, |o, b| {
                    b.copy_from_slice(&raw[o as usize..o as usize + b.len()]);
                    Ok(())
                })
                .unwrap();
                assert_eq!(used, plan.bytes);
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

    /// Reads an index out of a byte vector.
    fn index_of(bytes: &[u8], len: u64) -> Result<(Ranges, u64)> {
        read_index(len, bytes.len() as u64, |o, b| {
            let o = o as usize;
            b.copy_from_slice(&bytes[o..o + b.len()]);
            Ok(())
        })
    }

    #[test]
    fn sorted_whole_rows_travel_packed_and_every_index_reads_back() {
        let mut rng = fastrand::Rng::with_seed(10);
        // A tenth of a table of a million one-float rows, sorted: about a byte a row.
        let mut ids: Vec<u64> = (0..100_000).map(|_| rng.u64(0..1_000_000)).collect();
        ids.sort_unstable();
        ids.dedup();
        let parts = || ids.iter().map(|&r| (r, 1));
        let plan = plan_index(ids.len() as u64, parts());
        assert!(plan.width == Some(1), "packed");
        assert!(
            plan.bytes < 2 * ids.len() as u64,
            "{} bytes for {} rows",
            plan.bytes,
            ids.len()
        );
        let mut out = vec![0u8; plan.bytes as usize];
        write_index(plan, ids.len() as u64, parts(), &mut out);
        let (got, used) = index_of(&out, 1_000_000).unwrap();
        assert_eq!(used, plan.bytes);
        assert_eq!(got, ids.iter().map(|&r| (r as u32, 1)).collect::<Vec<_>>());
        // Rows of 8 floats far apart (multi-byte gaps), repeats, disorder, mixed widths.
        let cases: Vec<Vec<(u64, u64)>> = vec![
            vec![(0, 8), (8, 8), (1 << 20, 8), (3 << 27, 8)],
            vec![(5, 1), (5, 1)],
            vec![(9, 2), (3, 2)],
            vec![(0, 3), (4, 2)],
            vec![],
        ];
        for parts in cases {
            let plan = plan_index(parts.len() as u64, parts.iter().copied());
            let mut out = vec![0u8; plan.bytes as usize];
            write_index(plan, parts.len() as u64, parts.iter().copied(), &mut out);
            let (got, used) = index_of(&out, 1 << 30).unwrap();
            assert_eq!(used, out.len() as u64);
            let want: Vec<(u32, u32)> = parts.iter().map(|&(o, n)| (o as u32, n as u32)).collect();
            assert_eq!(got, want, "{parts:?}");
        }
    }

    #[test]
    fn empty_shards_pick_nothing_and_lose_no_row() {
        // Rows of 2 floats over shards [0, 3), [3, 3) (empty, tied with the next) and [3, 8):
        // row 1 (floats 2..4) straddles the empty shard.
        let bounds = [(3, 5), (3, 0), (0, 3)];
        let picks = split(8, &bounds, 2, &[1, 3, 0]).unwrap();
        assert_eq!((picks[1].count, picks[1].floats), (0, 0), "the empty shard");
        assert_eq!(
            (picks[2].count, picks[2].floats),
            (2, 3),
            "row 1's head and row 0"
        );
        assert_eq!(
            (picks[0].count, picks[0].floats),
            (2, 3),
            "row 1's tail and row 3"
        );
        assert!(
            picks.iter().all(|p| p.run().is_none()),
            "straddled or out of order"
        );
        // Sorted rows over two shards: each shard's rows are a run of the request's.
        let picks = split(8, &[(4, 4), (0, 4)], 2, &[0, 1, 2, 3]).unwrap();
        assert_eq!(
            (picks[0].run(), picks[1].run()),
            (Some((2, 4)), Some((0, 2)))
        );
    }

    #[test]
    fn malformed_packed_indexes_are_typed_errors() {
        let packed = |count: u32, width: u32, gaps: &[u8]| {
            let mut v = (count | PACKED).to_le_bytes().to_vec();
            v.extend(width.to_le_bytes());
            v.extend((gaps.len() as u32).to_le_bytes());
            v.extend(gaps);
            v
        };
        let err = |bytes: Vec<u8>, len: u64| index_of(&bytes, len).unwrap_err().to_string();
        assert!(index_of(&packed(2, 1, &[3, 4]), 100).is_ok());
        assert!(err(packed(2, 1, &[3, 0x84]), 100).contains("ends inside a gap"));
        assert!(err(packed(1, 1, &[0xff; 11]), 100).contains("more than 64 bits"));
        assert!(err(packed(1, 1, &[3, 4]), 100).contains("uses 1 of its 2 bytes"));
        assert!(err(packed(2, 1, &[3, 200, 1]), 100).contains("past the shard's 100"));
        assert!(err(packed(1, 1 << 20, &[0]), 100).contains("past the shard's 100"));
        assert!(err(packed(9, 1, &[1, 1]), 100).contains("does not fit"));
        let mut cut = packed(2, 1, &[3, 4]);
        cut[8] = 200;
        assert!(err(cut, 100).contains("does not fit"));
        assert!(err(vec![1, 0], 100).contains("in 2 bytes"));
        assert!(err(PACKED.to_le_bytes().to_vec(), 100).contains("in 4 bytes"));
        // A pull's index must be the whole message field.
        let mut trail = packed(1, 1, &[3]);
        trail.push(0);
        assert!(
            index_of_pull(&trail)
                .unwrap_err()
                .to_string()
                .contains("followed by 1 more")
        );
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
