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

/// A checked row index (see the module documentation), kept in the form it travelled in:
/// its parts `(first float from the shard's start, floats)` are read off its bytes where
/// they are used, not widened into a list first.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RowIndex {
    /// The entries (plain) or the gaps (packed), without the head.
    body: Vec<u8>,
    /// `Some(width)`: packed, every part `width` floats.
    width: Option<u64>,
    count: u64,
    /// Floats of all parts together (repeats counted each time).
    floats: u64,
    /// The furthest end of a part (0 without parts).
    reach: u64,
}

impl RowIndex {
    /// Parts.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Floats of all parts together (repeats counted each time).
    pub fn floats(&self) -> u64 {
        self.floats
    }

    /// The furthest end of a part, in floats from the shard's start.
    pub fn reach(&self) -> u64 {
        self.reach
    }

    /// Whether the parts are in ascending order and none overlaps another (a packed index's
    /// always are; a plain one's are not taken to be).
    pub fn disjoint(&self) -> bool {
        self.width.is_some()
    }

    /// The parts `(first float, floats)`, in order.
    pub fn iter(&self) -> PartIter<'_> {
        match self.width {
            None => PartIter(Reader::Plain(self.body.chunks_exact(8))),
            Some(width) => PartIter(Reader::Packed {
                body: &self.body,
                at: 0,
                end: 0,
                width,
                left: self.count,
            }),
        }
    }

    /// The parts, in order.
    pub fn to_vec(&self) -> Vec<(u32, u32)> {
        self.iter().map(|(off, n)| (off as u32, n as u32)).collect()
    }

    /// Calls `f(i, floats)` for the parts' floats a block of up to [`BLOCK`] at a time, in
    /// order: `floats` holds the places in the shard of the parts' floats `i`, `i + 1`, ….
    /// The places are read off the index first and then handed over together, so the
    /// caller's loop over them is a plain loop over memory (several times faster than a call
    /// or a gap's decoding between one float's update and the next).
    #[inline]
    pub fn each_block(&self, f: impl FnMut(usize, &[usize])) {
        self.each_block_in(&self.whole(), f)
    }

    /// [`RowIndex::gather`] of a piece of single floats into `out`, its own floats' bytes.
    fn gather_piece(&self, shard: &[u8], piece: &Piece, out: &mut [u8]) {
        self.each_block_in(piece, |i, offs| {
            let at = 4 * (i - piece.first);
            let out = &mut out[at..at + 4 * offs.len()];
            for (o, &off) in out.chunks_exact_mut(4).zip(offs) {
                o.copy_from_slice(&shard[4 * off..4 * off + 4]);
            }
        });
    }

    /// Where this index is long enough to be worth sharing with the process's helper threads
    /// ([`falcon_transport::spread`]), packed, and the process has helpers: its pieces of
    /// [`SPREAD_PIECE`] parts (where the helpers are busy with another pass, the caller
    /// visits every piece itself). A row costs a server 1–2 ns to visit (a cache miss in a
    /// large table). Measured on two cores, one
    /// worker and one server: a request of 630 k rows ran 1.12× as fast shared, one of
    /// 95 k rows 0.9× (the helper's wake-up and the second core's other work cost more than
    /// the half pass saves), hence [`SPREAD_FROM`].
    pub fn spread(&self) -> Option<Vec<Piece>> {
        if self.count < SPREAD_FROM || falcon_transport::spread::helpers() == 0 {
            return None;
        }
        self.cut(SPREAD_PIECE).filter(|p| p.len() > 1)
    }

    /// The whole index as one [`Piece`].
    fn whole(&self) -> Piece {
        Piece {
            byte: 0,
            count: self.count,
            first: 0,
            end: 0,
            lo: 0,
            hi: self.reach as usize,
        }
    }

    /// [`RowIndex::each_block`] of the parts of `piece` (the whole index's, or one that
    /// [`RowIndex::cut`] gave): `i` counts from the index's first float.
    #[inline]
    pub fn each_block_in(&self, piece: &Piece, f: impl FnMut(usize, &[usize])) {
        let body = &self.body[..];
        let Some(width) = self.width else {
            return blocks_of(self.iter(), piece.first, f);
        };
        if width != 1 {
            let parts = PartIter(Reader::Packed {
                body,
                at: piece.byte,
                end: piece.end as u64,
                width,
                left: piece.count,
            });
            return blocks_of(parts, piece.first, f);
        }
        single_floats(body, piece, f)
    }

    /// The parts of a packed index cut into pieces of about `parts` parts each (a multiple of
    /// [`BLOCK`]), in order, each visited on its own with [`RowIndex::each_block_in`]: the
    /// parts ascend without overlapping, so the pieces' places lie in disjoint ranges of the
    /// shard (`lo..hi`), which threads may update at once. `None` for a plain index (its parts
    /// may repeat or overlap). One pass over the index, a block of one-byte gaps at a time.
    pub fn cut(&self, parts: u64) -> Option<Vec<Piece>> {
        let width = self.width?;
        let per = parts.max(1).div_ceil(BLOCK as u64) * BLOCK as u64;
        let body = &self.body[..];
        let (mut pieces, mut byte, mut end, mut done) = (Vec::new(), 0usize, 0u64, 0u64);
        while done < self.count {
            let count = per.min(self.count - done);
            // `check_index` made sure every gap is whole and every part lies in the shard.
            let (first_gap, _) = leb(body.get(byte..)?).ok()?;
            // Its last part ends after its gaps and its parts.
            let (at, gaps) = sum_gaps(body, byte, count).ok()?;
            let e = end + gaps as u64 + count * width;
            pieces.push(Piece {
                byte,
                count,
                first: (done * width) as usize,
                end: end as usize,
                lo: (end + first_gap) as usize,
                hi: e as usize,
            });
            (byte, end, done) = (at, e, done + count);
        }
        Some(pieces)
    }

    /// Gathers the parts' floats out of `shard` (the shard's floats as bytes, which the index
    /// was checked against) into `out`, `4 · floats()` bytes, one part after another.
    /// Long single-float indexes (a key-value request) are gathered in pieces shared with
    /// the process's helper threads ([`RowIndex::spread`]).
    pub fn gather(&self, shard: &[u8], out: &mut [u8]) {
        if self.width == Some(1) {
            let Some(pieces) = self.spread() else {
                return self.gather_piece(shard, &self.whole(), out);
            };
            // Each piece's floats go to their own stretch of `out`.
            let mut items = Vec::with_capacity(pieces.len());
            let mut rest = out;
            for p in pieces {
                let (mine, tail) = rest.split_at_mut(4 * p.count as usize);
                items.push((p, mine));
                rest = tail;
            }
            falcon_transport::spread::for_each_mut(&mut items, |_, (p, o)| {
                self.gather_piece(shard, p, o)
            });
            return;
        }
        let mut o = 0;
        for (off, n) in self.iter() {
            out[o..o + 4 * n].copy_from_slice(&shard[4 * off..4 * (off + n)]);
            o += 4 * n;
        }
    }
}

/// The most floats [`Parts::each_block`] hands over at once.
pub const BLOCK: usize = 64;

/// Parts of a piece an index is cut into to be shared with helper threads.
pub const SPREAD_PIECE: u64 = 32 << 10;

/// The fewest parts an index must have to be shared with helper threads.
pub const SPREAD_FROM: u64 = 8 * SPREAD_PIECE;

/// A run of consecutive parts of a [`RowIndex`] ([`RowIndex::cut`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Piece {
    /// The byte of the index's body its first gap starts at.
    byte: usize,
    /// Its parts.
    pub count: u64,
    /// The number of its first float among the index's floats (where its values start).
    pub first: usize,
    /// Where the part before it ends (its first gap counts from there).
    end: usize,
    /// The place of its first float.
    pub lo: usize,
    /// One past the place of its last float: every place it visits lies in `lo..hi`.
    pub hi: usize,
}

/// [`RowIndex::each_block_in`] of a packed index of single floats: a block of one-byte gaps
/// at a time where they are (most are).
#[inline]
fn single_floats(body: &[u8], piece: &Piece, mut f: impl FnMut(usize, &[usize])) {
    let mut offs = [0usize; BLOCK];
    let (mut at, mut end, mut i, mut left) = (piece.byte, piece.end, piece.first, piece.count);
    while left > 0 {
        let n = left.min(BLOCK as u64) as usize;
        if let Some(block) = body.get(at..at + n)
            && one_byte_gaps(block).is_some()
        {
            for (o, &gap) in offs.iter_mut().zip(block) {
                *o = end + usize::from(gap);
                end = *o + 1;
            }
            at += n;
        } else {
            for o in &mut offs[..n] {
                // `check_index` made sure every gap is whole.
                let (gap, used) = leb(body.get(at..).unwrap_or(&[])).unwrap_or((0, 1));
                *o = end + gap as usize;
                (end, at) = (*o + 1, at + used);
            }
        }
        f(i, &offs[..n]);
        (i, left) = (i + n, left - n as u64);
    }
}

/// The parts of a [`RowIndex`], read off its bytes.
pub struct PartIter<'a>(Reader<'a>);

enum Reader<'a> {
    /// Plain entries.
    Plain(std::slice::ChunksExact<'a, u8>),
    /// Packed gaps: `left` more, from byte `at`, the last part ending at `end`.
    Packed {
        body: &'a [u8],
        at: usize,
        end: u64,
        width: u64,
        left: u64,
    },
}

impl Iterator for PartIter<'_> {
    type Item = (usize, usize);

    // Inlined into the loops that apply and gather rows: a call a row costs more than the row.
    #[inline(always)]
    fn next(&mut self) -> Option<(usize, usize)> {
        match &mut self.0 {
            Reader::Plain(entries) => {
                let e = entries.next()?;
                let off = u32::from_le_bytes([e[0], e[1], e[2], e[3]]);
                let n = u32::from_le_bytes([e[4], e[5], e[6], e[7]]);
                Some((off as usize, n as usize))
            }
            Reader::Packed {
                body,
                at,
                end,
                width,
                left,
            } => {
                if *left == 0 {
                    return None;
                }
                *left -= 1;
                // `check_index` made sure every gap is whole and every part lies in the shard.
                let (gap, used) = leb(body.get(*at..)?).ok()?;
                *at += used;
                let off = *end + gap;
                *end = off + *width;
                Some((off as usize, *width as usize))
            }
        }
    }
}

/// Parts of a shard, `(first float, floats)`, in order: a row index's, or a list's.
pub trait Parts {
    /// The parts, in order.
    fn parts(&self) -> impl Iterator<Item = (usize, usize)>;

    /// Calls `f(i, floats)` for the parts' floats up to [`BLOCK`] at a time, in order,
    /// `floats` the places in the shard of the parts' floats `i`, `i + 1`, ….
    fn each_block(&self, f: impl FnMut(usize, &[usize])) {
        blocks_of(self.parts(), 0, f)
    }
}

/// [`Parts::each_block`] of `parts`, whose first float is the `first`-th.
fn blocks_of(
    parts: impl Iterator<Item = (usize, usize)>,
    first: usize,
    mut f: impl FnMut(usize, &[usize]),
) {
    let mut offs = [0usize; BLOCK];
    let (mut i, mut n) = (first, 0);
    for (off, len) in parts {
        for place in off..off + len {
            offs[n] = place;
            n += 1;
            if n == BLOCK {
                f(i, &offs);
                (i, n) = (i + BLOCK, 0);
            }
        }
    }
    if n > 0 {
        f(i, &offs[..n]);
    }
}

impl Parts for RowIndex {
    fn parts(&self) -> impl Iterator<Item = (usize, usize)> {
        self.iter()
    }

    fn each_block(&self, f: impl FnMut(usize, &[usize])) {
        RowIndex::each_block(self, f)
    }
}

impl Parts for [(u32, u32)] {
    fn parts(&self) -> impl Iterator<Item = (usize, usize)> {
        self.iter().map(|&(off, n)| (off as usize, n as usize))
    }
}

/// Where every byte of `block` (at most 256 bytes) is a whole one-byte gap (below 0x80):
/// their sum. Eight bytes at a time in a word: one test of the words' high bits together,
/// and sums in four 16-bit lanes (each at most 2 · 127 a word).
#[inline]
fn one_byte_gaps(block: &[u8]) -> Option<u64> {
    const HIGH: u64 = 0x8080_8080_8080_8080;
    const EVEN: u64 = 0x00ff_00ff_00ff_00ff;
    let words = block.chunks_exact(8);
    let tail = words.remainder();
    let (mut high, mut lanes) = (0u64, 0u64);
    for w in words {
        let x = u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]);
        high |= x;
        lanes += (x & EVEN) + ((x >> 8) & EVEN);
    }
    let mut sum = 0u64;
    for &b in tail {
        high |= u64::from(b);
        sum += u64::from(b);
    }
    if high & HIGH != 0 {
        return None;
    }
    // 32 words at most: each lane at most 32 · 254, so no lane carries into the next.
    let lane = |k: u32| (lanes >> (16 * k)) & 0xffff;
    Some(sum + lane(0) + lane(1) + lane(2) + lane(3))
}

/// The LEB128 number at the start of `b` and its bytes, or what is wrong with it (most gaps
/// are one byte: that case first).
#[inline]
fn leb(b: &[u8]) -> std::result::Result<(u64, usize), &'static str> {
    const SHORT: &str = "a packed row index ends inside a gap";
    let first = *b.first().ok_or(SHORT)?;
    if first < 0x80 {
        return Ok((u64::from(first), 1));
    }
    let (mut v, mut shift, mut at) = (u64::from(first & 0x7f), 7u32, 1usize);
    loop {
        let byte = *b.get(at).ok_or(SHORT)?;
        at += 1;
        // The tenth byte holds bit 63 alone.
        if shift == 63 && byte > 1 {
            return Err("a packed row index has a gap of more than 64 bits");
        }
        v |= u64::from(byte & 0x7f) << shift;
        shift += 7;
        if byte < 0x80 {
            return Ok((v, at));
        }
    }
}

/// Bit 31 of an index's count: the packed form (see the module documentation).
const PACKED: u32 = 1 << 31;

/// Appends `gap` to `out` in LEB128.
fn push_gap(out: &mut Vec<u8>, mut gap: u64) {
    while gap >= 0x80 {
        out.push(gap as u8 | 0x80);
        gap >>= 7;
    }
    out.push(gap as u8);
}

/// Writes the head of the packed index of `count` parts of `width` floats whose gaps follow
/// it in `out` (written into the 12 bytes left for it).
fn packed_head(out: &mut [u8], count: u64, width: u64) {
    let gaps = out.len() as u32 - 12;
    out[..4].copy_from_slice(&(count as u32 | PACKED).to_le_bytes());
    out[4..8].copy_from_slice(&(width as u32).to_le_bytes());
    out[8..12].copy_from_slice(&gaps.to_le_bytes());
}

/// Encodes the index of `count` parts `(offset, floats)`, given in order by `parts()`, into
/// `out` (cleared first), in one pass where it packs: packed where the parts allow it and it
/// is smaller, else plain.
pub fn encode_index<I>(count: u64, parts: impl Fn() -> I, out: &mut Vec<u8>)
where
    I: Iterator<Item = (u64, u64)>,
{
    let plain = 4 + 8 * count as usize;
    out.clear();
    // Sorted rows of a table a few times the request's size take one or two bytes a gap.
    out.reserve((12 + 2 * count as usize).min(plain));
    out.extend_from_slice(&[0u8; 12]);
    let (mut width, mut end, mut packed) = (None, 0u64, count > 0);
    for (off, n) in parts() {
        if *width.get_or_insert(n) != n || off < end || out.len() >= plain {
            packed = false;
            break;
        }
        push_gap(out, off - end);
        end = off + n;
    }
    if packed && out.len() < plain {
        packed_head(out, count, width.unwrap_or(0));
        return;
    }
    out.clear();
    out.reserve(plain);
    out.extend_from_slice(&(count as u32).to_le_bytes());
    for (off, n) in parts() {
        out.extend_from_slice(&(off as u32).to_le_bytes());
        out.extend_from_slice(&(n as u32).to_le_bytes());
    }
}

/// Whether an index (see the module documentation) is in the packed form.
#[cfg(test)]
pub fn is_packed(index: &[u8]) -> bool {
    index.len() >= 4 && u32::from_le_bytes([index[0], index[1], index[2], index[3]]) & PACKED != 0
}

/// The index at the start of `read` (which reads `capacity` bytes at an offset), of parts
/// of a shard of `len` floats: the index, and its size in bytes. A count or a size past
/// `capacity`, a part outside the shard, or a malformed gap is [`Error::Malformed`].
pub fn read_index(
    len: u64,
    capacity: u64,
    mut read: impl FnMut(u64, &mut [u8]) -> Result<()>,
) -> Result<(RowIndex, u64)> {
    if capacity < 4 {
        return Err(Error::Malformed(format!("a row index in {capacity} bytes")));
    }
    let mut head = [0u8; 12];
    read(0, &mut head[..4])?;
    let head_len = head_len(&head, capacity)?;
    if head_len > 4 {
        read(4, &mut head[4..])?;
    }
    let body_len = index_body_len(&head[..head_len as usize]);
    if head_len + body_len > capacity {
        return Err(Error::Malformed(format!(
            "a row index of {body_len} bytes after its head does not fit its {capacity}"
        )));
    }
    let mut body = vec![0u8; body_len as usize];
    read(head_len, &mut body)?;
    let index = check_index(len, &head[..head_len as usize], body)?;
    Ok((index, head_len + body_len))
}

/// The length of the head of an index whose first 4 bytes are `head`'s (4 plain, 12 packed),
/// in `capacity` bytes: a packed head that does not fit is [`Error::Malformed`].
fn head_len(head: &[u8], capacity: u64) -> Result<u64> {
    if u32::from_le_bytes([head[0], head[1], head[2], head[3]]) & PACKED == 0 {
        return Ok(4);
    }
    if capacity < 12 {
        return Err(Error::Malformed(format!(
            "a packed row index in {capacity} bytes"
        )));
    }
    Ok(12)
}

/// The bytes after an index's head (`head`: 4 bytes plain, 12 packed) its head announces.
fn index_body_len(head: &[u8]) -> u64 {
    let word = |k: usize| {
        u64::from(u32::from_le_bytes([
            head[k],
            head[k + 1],
            head[k + 2],
            head[k + 3],
        ]))
    };
    if head.len() == 12 {
        word(8)
    } else {
        8 * (word(0) & !u64::from(PACKED))
    }
}

/// The sum of the `count` gaps of a packed index's `body` from byte `at`, and the byte after
/// them: sixty-four one-byte gaps at a time where they are (most are), else the next
/// sixty-four (or the rest) one by one, so a block is tried again only after them. Summed
/// wide: 2^31 gaps of up to 64 bits each cannot overflow 128.
fn sum_gaps(
    body: &[u8],
    mut at: usize,
    count: u64,
) -> std::result::Result<(usize, u128), &'static str> {
    let (mut gaps, mut left) = (0u128, count);
    while left > 0 {
        if left >= BLOCK as u64
            && let Some(block) = body.get(at..at + BLOCK)
            && let Some(sum) = one_byte_gaps(block)
        {
            (gaps, at, left) = (gaps + u128::from(sum), at + BLOCK, left - BLOCK as u64);
            continue;
        }
        for _ in 0..left.min(BLOCK as u64) {
            let (gap, used) = leb(body.get(at..).unwrap_or(&[]))?;
            (gaps, at, left) = (gaps + u128::from(gap), at + used, left - 1);
        }
    }
    Ok((at, gaps))
}

/// Checks the index of head `head` and body `body` against a shard of `len` floats.
fn check_index(len: u64, head: &[u8], body: Vec<u8>) -> Result<RowIndex> {
    let bad = |what: String| Err(Error::Malformed(what));
    let count = u64::from(u32::from_le_bytes([head[0], head[1], head[2], head[3]]) & !PACKED);
    if head.len() == 4 {
        let (mut floats, mut reach) = (0u64, 0u64);
        for e in body.chunks_exact(8) {
            let off = u64::from(u32::from_le_bytes([e[0], e[1], e[2], e[3]]));
            let n = u64::from(u32::from_le_bytes([e[4], e[5], e[6], e[7]]));
            if off + n > len {
                return bad(format!(
                    "a row entry of {n} floats at {off} lies outside the shard's {len}"
                ));
            }
            floats += n;
            reach = reach.max(off + n);
        }
        return Ok(RowIndex {
            body,
            width: None,
            count,
            floats,
            reach,
        });
    }
    let width = u64::from(u32::from_le_bytes([head[4], head[5], head[6], head[7]]));
    if count > body.len() as u64 {
        return bad(format!(
            "a packed row index of {count} gaps does not fit in {} bytes",
            body.len()
        ));
    }
    // The last part ends furthest: after every gap and every part but the last's width.
    let (at, gaps) = sum_gaps(&body, 0, count).map_err(|e| Error::Malformed(e.into()))?;
    let end = gaps + u128::from(count) * u128::from(width);
    if end > u128::from(len) {
        return bad(format!(
            "a row part of {width} floats ends at float {end}, past the shard's {len}"
        ));
    }
    let end = end as u64;
    if at != body.len() {
        return bad(format!(
            "a packed row index of {count} gaps uses {at} of its {} bytes",
            body.len()
        ));
    }
    Ok(RowIndex {
        body,
        width: Some(width),
        count,
        floats: count * width,
        reach: end,
    })
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
#[cfg(test)]
pub fn check(tensor: &str, len: u64, dim: u64, rows: &[u64], values: usize) -> Result<u64> {
    let table = check_rows(tensor, len, dim, rows)?;
    check_values(tensor, dim, rows, values)?;
    Ok(table)
}

/// Checks a row request's rows ([`check`] without the values): returns the table's rows.
pub fn check_rows(tensor: &str, len: u64, dim: u64, rows: &[u64]) -> Result<u64> {
    if dim == 0 || !len.is_multiple_of(dim) {
        return Err(Error::Config(format!(
            "tensor {tensor:?} of {len} floats cannot be rows of {dim}: the row width must \
             divide its length"
        )));
    }
    let table = len / dim;
    // Whether any row is out of the table first, with shifts and ors (a loop without an early
    // exit or compares runs several rows at a time): `table − 1 − r` wraps (its top bit set)
    // where `r ≥ table`, and rows of 2^63 or more are caught by their own top bit (a table
    // has fewer rows than that). Then the first such row, for the message.
    let last = table.saturating_sub(1);
    let out = rows
        .iter()
        .fold(0u64, |acc, &r| acc | last.wrapping_sub(r) | r);
    if (table == 0 || out >> 63 != 0)
        && let Some(bad) = rows.iter().find(|&&r| r >= table)
    {
        return Err(Error::Config(format!(
            "row {bad} of tensor {tensor:?}: it has {table} rows of {dim}"
        )));
    }
    Ok(table)
}

/// Checks that `values` floats are `rows.len() · dim`, one row's worth per row.
pub fn check_values(tensor: &str, dim: u64, rows: &[u64], values: usize) -> Result<()> {
    let want = (rows.len() as u64).saturating_mul(dim);
    if values as u64 != want {
        return Err(Error::WrongLength {
            tensor: tensor.to_string(),
            expected: want,
            got: values as u64,
        });
    }
    Ok(())
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

/// The rows of a request that fall in each shard of a tensor of `len` floats (row `r`
/// covers floats `r·dim .. (r+1)·dim`): by bisection where the rows are sorted and none
/// straddles two shards, else in one pass over them. `bounds` are the shards' (first float,
/// floats), in any order, covering the tensor without gaps or overlaps (empty shards pick
/// nothing); the picks come back in the order of `bounds`. Rows must have been checked
/// ([`check_rows`]); a request of 2³¹ rows or more is refused.
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
    if let Some(picks) = split_sorted(bounds, dim, rows) {
        return Ok(picks);
    }
    Ok(split_any(bounds, dim, rows))
}

/// [`split`] of rows in ascending order none of which straddles two shards: each shard's
/// rows are a run of the request's, found by bisection. `None` where the rows are not so.
fn split_sorted(bounds: &[(u64, u64)], dim: u64, rows: &[u64]) -> Option<Vec<Pick>> {
    // Without an early exit the check runs several rows at a time.
    if !rows.windows(2).fold(true, |up, w| up & (w[0] <= w[1])) {
        return None;
    }
    let mut picks = Vec::with_capacity(bounds.len());
    for &(off, l) in bounds {
        let end = off + l;
        // The rows that start in the shard.
        let s = rows.partition_point(|&r| r * dim < off);
        let e = s + rows[s..].partition_point(|&r| r * dim < end);
        let reaches_in = s > 0 && rows[s - 1] * dim + dim > off;
        let reaches_out = e > s && rows[e - 1] * dim + dim > end;
        if reaches_in || reaches_out {
            return None;
        }
        let n = (e - s) as u64;
        picks.push(Pick {
            rows: if n == 0 {
                Picked::Some(Vec::new())
            } else {
                Picked::Run(s, e)
            },
            count: n,
            floats: n * dim,
        });
    }
    Some(picks)
}

/// [`split`] of any rows, one pass over them.
fn split_any(bounds: &[(u64, u64)], dim: u64, rows: &[u64]) -> Vec<Pick> {
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
    picks
}

/// The part of `rows` (with their `values`, `dim` floats each) picked for the shard of
/// `shard_len` floats starting at float `shard_off` of the tensor (see [`split`]), whose
/// index is `index` ([`index_into`]): a row payload handed to `write(offset, bytes)` piece by
/// piece, or the dense gradient where that would be smaller.
#[allow(clippy::too_many_arguments)]
pub fn for_shard(
    shard_off: u64,
    shard_len: u64,
    dim: u64,
    rows: &[u64],
    values: &[f32],
    pick: &Pick,
    index: &[u8],
    mut write: impl FnMut(u64, &[u8]) -> Result<()>,
) -> Result<ShardRows> {
    let end = shard_off + shard_len;
    let floats = pick.floats;
    let bytes = index.len() as u64 + 4 * floats;
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
    write(0, index)?;
    let mut at = index.len() as u64;
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
/// starting at float `shard_off` (what a row pull asks for, what a row push carries),
/// written into `out` (see [`encode_index`]).
pub fn index_into(
    shard_off: u64,
    shard_len: u64,
    dim: u64,
    rows: &[u64],
    pick: &Pick,
    out: &mut Vec<u8>,
) {
    let end = shard_off + shard_len;
    match pick.run() {
        // Consecutive rows, each whole: the parts come straight from the rows.
        Some((s, e)) => {
            if !pack_rows(&rows[s..e], dim, shard_off, out) {
                encode_index(
                    pick.count,
                    || rows[s..e].iter().map(|&r| (r * dim - shard_off, dim)),
                    out,
                )
            }
        }
        None => encode_index(
            pick.count,
            || {
                pick.iter().map(|i| {
                    let (lo, hi) = part(rows[i] * dim, dim, shard_off, end);
                    (lo - shard_off, hi - lo)
                })
            },
            out,
        ),
    }
}

/// The packed index of the whole rows `rows` (`dim` floats each) of the shard starting at
/// float `shard_off`, written into `out`, where the rows ascend without repeats and packing
/// is smaller: [`encode_index`]'s choice and bytes, sixteen rows at a time where their gaps
/// are one byte each. False where it does not pack (`out` then holds nothing of use).
fn pack_rows(rows: &[u64], dim: u64, shard_off: u64, out: &mut Vec<u8>) -> bool {
    const BLOCK: usize = 16;
    let (n, plain) = (rows.len(), 4 + 8 * rows.len());
    let Some(&first) = rows.first() else {
        return false;
    };
    out.clear();
    out.reserve((12 + 2 * n).min(plain));
    out.extend_from_slice(&[0u8; 12]);
    push_gap(out, first * dim - shard_off);
    let mut i = 1;
    while i < n {
        if out.len() >= plain {
            return false;
        }
        if let Some(w) = rows.get(i - 1..i + BLOCK) {
            // Rows of one table (below 2^63, checked): an ascending step times `dim` cannot
            // overflow, and `w[k] − w[k+1]` wraps (its top bit set) exactly where the rows
            // ascend. Shifts and ors, no compares: the block runs several rows at a time.
            let mut gaps = [0u8; BLOCK];
            let bad = if dim == 1 {
                block_gaps(w, 1, &mut gaps)
            } else {
                block_gaps(w, dim, &mut gaps)
            };
            if bad == 0 {
                out.extend_from_slice(&gaps);
                i += BLOCK;
                continue;
            }
        }
        // Else the next sixteen rows (or the rest) one by one: a block is tried again only
        // after them.
        for _ in 0..BLOCK.min(n - i) {
            if rows[i] <= rows[i - 1] {
                return false;
            }
            push_gap(out, (rows[i] - rows[i - 1] - 1) * dim);
            i += 1;
        }
    }
    if out.len() >= plain {
        return false;
    }
    packed_head(out, n as u64, dim);
    true
}

/// The gaps between the rows of `w` (`BLOCK + 1` rows, `dim` floats each) as bytes into
/// `gaps`; nonzero where a gap is over a byte or the rows do not ascend.
#[inline(always)]
fn block_gaps(w: &[u64], dim: u64, gaps: &mut [u8; 16]) -> u64 {
    let mut bad = 0u64;
    for (k, g) in gaps.iter_mut().enumerate() {
        let gap = w[k + 1]
            .wrapping_sub(w[k])
            .wrapping_sub(1)
            .wrapping_mul(dim);
        bad |= (gap >> 7) | ((w[k].wrapping_sub(w[k + 1]) >> 63) ^ 1);
        *g = gap as u8;
    }
    bad
}

/// [`index_into`] a new vector.
#[cfg(test)]
pub fn index_for(shard_off: u64, shard_len: u64, dim: u64, rows: &[u64], pick: &Pick) -> Vec<u8> {
    let mut out = Vec::new();
    index_into(shard_off, shard_len, dim, rows, pick, &mut out);
    out
}

/// The parts a row pull's message asks for: its whole index (the shard's bounds are checked
/// where the shard is known, against [`RowIndex::reach`]).
pub fn index_of_pull(mut index: Vec<u8>) -> Result<RowIndex> {
    if index.len() < 4 {
        return Err(Error::Malformed(format!(
            "a row index in {} bytes",
            index.len()
        )));
    }
    let head_len = head_len(&index, index.len() as u64)? as usize;
    let used = head_len as u64 + index_body_len(&index[..head_len]);
    let have = index.len() as u64;
    if used < have {
        return Err(Error::Malformed(format!(
            "a row pull's index of {used} bytes is followed by {} more",
            have - used
        )));
    }
    if used > have {
        return Err(Error::Malformed(format!(
            "a row pull's index of {used} bytes does not fit its {have}"
        )));
    }
    let mut head = [0u8; 12];
    head[..head_len].copy_from_slice(&index[..head_len]);
    // The body moves down over the head: the message's bytes are the index's.
    index.drain(..head_len);
    check_index(u64::from(u32::MAX), &head[..head_len], index)
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
    let (index, values) = parse(len, capacity, read)?;
    Ok(widen(len as usize, &index, &values))
}

/// The whole gradient of `len` floats that `values` give `parts` (one part's values after
/// another's), repeated parts summed in order, zero elsewhere.
pub fn widen<P: Parts + ?Sized>(len: usize, parts: &P, values: &[f32]) -> Vec<f32> {
    let mut g = vec![0f32; len];
    let mut at = 0;
    for (off, n) in parts.parts() {
        for (d, v) in g[off..off + n].iter_mut().zip(&values[at..at + n]) {
            *d += v;
        }
        at += n;
    }
    g
}

/// Reads a row payload (as [`densify`]) into its index and its parts' values, one part
/// after another.
pub fn parse(
    len: u64,
    capacity: u64,
    mut read: impl FnMut(u64, &mut [u8]) -> Result<()>,
) -> Result<(RowIndex, Vec<f32>)> {
    let (index, start) = read_index(len, capacity, &mut read)?;
    let floats = index.floats();
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
    Ok((index, values))
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
                let index = index_for(off, sl, dim, &rows, pick);
                let part = match for_shard(off, sl, dim, &rows, &values, pick, &index, put).unwrap()
                {
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
                let raw = index_for(off, sl, dim, &rows, pick);
                let (ranges, used) = read_index(sl, raw.len() as u64, |o, b| {
                    b.copy_from_slice(&raw[o as usize..o as usize + b.len()]);
                    Ok(())
                })
                .unwrap();
                assert_eq!(used, raw.len() as u64);
                assert_eq!(ranges.count(), pick.count);
                let mut answer = Vec::new();
                for (o, k) in ranges.to_vec() {
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
    fn index_of(bytes: &[u8], len: u64) -> Result<(Vec<(u32, u32)>, u64)> {
        read_index(len, bytes.len() as u64, |o, b| {
            let o = o as usize;
            b.copy_from_slice(&bytes[o..o + b.len()]);
            Ok(())
        })
        .map(|(index, used)| (index.to_vec(), used))
    }

    #[test]
    fn sorted_whole_rows_travel_packed_and_every_index_reads_back() {
        let mut rng = fastrand::Rng::with_seed(10);
        // A tenth of a table of a million one-float rows, sorted: about a byte a row.
        let mut ids: Vec<u64> = (0..100_000).map(|_| rng.u64(0..1_000_000)).collect();
        ids.sort_unstable();
        ids.dedup();
        let mut out = Vec::new();
        encode_index(ids.len() as u64, || ids.iter().map(|&r| (r, 1)), &mut out);
        assert!(is_packed(&out), "packed");
        assert!(
            out.len() < 2 * ids.len(),
            "{} bytes for {} rows",
            out.len(),
            ids.len()
        );
        let (got, used) = index_of(&out, 1_000_000).unwrap();
        assert_eq!(used, out.len() as u64);
        assert_eq!(got, ids.iter().map(|&r| (r as u32, 1)).collect::<Vec<_>>());
        // Rows of 8 floats far apart (multi-byte gaps), repeats, disorder, mixed widths.
        let cases: Vec<Vec<(u64, u64)>> = vec![
            vec![(0, 8), (8, 8), (1 << 20, 8), (3 << 27, 8)],
            vec![(5, 1), (5, 1)],
            vec![(9, 2), (3, 2)],
            vec![(0, 3), (4, 2)],
            vec![],
            // Sorted and distinct, but no smaller packed (two 4-byte gaps).
            vec![(1 << 27, 1), (1 << 28, 1)],
        ];
        for (k, parts) in cases.iter().enumerate() {
            let mut out = Vec::new();
            encode_index(parts.len() as u64, || parts.iter().copied(), &mut out);
            // Only the first is sorted, distinct and of one width, and smaller packed.
            assert_eq!(is_packed(&out), k == 0, "{parts:?}");
            let (got, used) = index_of(&out, 1 << 30).unwrap();
            assert_eq!(used, out.len() as u64);
            let want: Vec<(u32, u32)> = parts.iter().map(|&(o, n)| (o as u32, n as u32)).collect();
            assert_eq!(got, want, "{parts:?}");
        }
    }

    #[test]
    fn sorted_rows_split_by_bisection_as_one_pass_splits_them() {
        let mut rng = fastrand::Rng::with_seed(15);
        let (mut fast, mut slow) = (0, 0);
        for round in 0..600 {
            let (dim, _, _, cuts, mut rows) = random_request(&mut rng);
            if round % 4 != 0 {
                rows.sort_unstable();
            }
            let mut bounds: Vec<(u64, u64)> =
                cuts.windows(2).map(|c| (c[0], c[1] - c[0])).collect();
            if round % 3 == 0 {
                // An empty shard beside the others, and the shards in another order.
                bounds.push((cuts[cuts.len() / 2], 0));
                bounds.reverse();
            }
            let want = split_any(&bounds, dim, &rows);
            match split_sorted(&bounds, dim, &rows) {
                Some(got) => {
                    fast += 1;
                    assert_eq!(got, want, "dim {dim}, bounds {bounds:?}, rows {rows:?}");
                }
                None => {
                    slow += 1;
                    // Unsorted, or a row split between two shards.
                    let whole = want.iter().all(|p| p.floats == p.count * dim);
                    assert!(
                        !rows.is_sorted() || !whole,
                        "dim {dim}, bounds {bounds:?}, rows {rows:?}"
                    );
                }
            }
        }
        assert!(fast > 150 && slow > 100, "{fast} by bisection, {slow} not");
    }

    #[test]
    fn an_index_cut_into_pieces_visits_every_float_once_in_disjoint_ranges() {
        let mut rng = fastrand::Rng::with_seed(19);
        let mut cuts = 0;
        for round in 0..80 {
            let dim = [1u64, 1, 3][round % 3];
            let table = 20_000u64;
            let every = [1u64, 9, 400][round % 3];
            let mut rows: Vec<u64> = (0..rng.usize(0..4000))
                .map(|_| rng.u64(0..table) / every * every)
                .collect();
            rows.sort_unstable();
            rows.dedup();
            let mut raw = Vec::new();
            encode_index(
                rows.len() as u64,
                || rows.iter().map(|&r| (r * dim, dim)),
                &mut raw,
            );
            let index = index_of_pull(raw).unwrap();
            let mut whole = Vec::new();
            index.each_block(|i, offs| {
                whole.extend(offs.iter().enumerate().map(|(k, &o)| (i + k, o)))
            });
            let Some(pieces) = index.cut([64, 128, 1000][round % 3]) else {
                assert!(!index.disjoint(), "a packed index is cut");
                continue;
            };
            cuts += 1;
            let mut visited = Vec::new();
            let mut hi = 0;
            for (k, p) in pieces.iter().enumerate() {
                assert!(
                    p.lo >= hi && p.hi >= p.lo,
                    "ranges ascend, disjoint: {pieces:?}"
                );
                assert!(p.hi as u64 <= index.reach(), "{p:?} inside the shard");
                hi = p.hi;
                if k + 1 < pieces.len() {
                    assert_eq!(p.count % BLOCK as u64, 0, "whole blocks but the last");
                }
                assert_eq!(p.first, visited.len(), "pieces follow one another");
                index.each_block_in(p, |i, offs| {
                    for (k, &o) in offs.iter().enumerate() {
                        assert!((p.lo..p.hi).contains(&o), "{o} outside {p:?}");
                        visited.push((i + k, o));
                    }
                });
            }
            assert_eq!(visited, whole, "round {round}");
            assert_eq!(pieces.iter().map(|p| p.count).sum::<u64>(), index.count());
            // Gathered piece by piece, as the helpers do: the same bytes.
            let shard: Vec<u8> = (0..4 * table * dim).map(|b| (b % 253) as u8).collect();
            let mut want = vec![0u8; 4 * index.floats() as usize];
            index.gather_piece(&shard, &index.whole(), &mut want);
            let mut got = vec![0u8; want.len()];
            let mut rest = got.as_mut_slice();
            for p in &pieces {
                let (mine, tail) = rest.split_at_mut(4 * (p.count * dim) as usize);
                if dim == 1 {
                    index.gather_piece(&shard, p, mine);
                } else {
                    mine.copy_from_slice(&want[4 * p.first..4 * p.first + mine.len()]);
                }
                rest = tail;
            }
            assert_eq!(got, want, "round {round}");
        }
        assert!(cuts > 50, "{cuts} indexes cut");
        // A plain index (parts that may repeat) is not cut.
        let mut raw = Vec::new();
        encode_index(3, || [(5u64, 1u64), (5, 1), (2, 1)].into_iter(), &mut raw);
        assert_eq!(index_of_pull(raw).unwrap().cut(64), None);
    }

    #[test]
    fn a_long_key_value_request_gathers_the_same_shared_or_not() {
        // Long enough to be shared with the helpers where the process has any.
        let mut rng = fastrand::Rng::with_seed(20);
        let table = 2_000_000u64;
        let mut rows: Vec<u64> = (0..400_000).map(|_| rng.u64(0..table)).collect();
        rows.sort_unstable();
        rows.dedup();
        let mut raw = Vec::new();
        encode_index(rows.len() as u64, || rows.iter().map(|&r| (r, 1)), &mut raw);
        let index = index_of_pull(raw).unwrap();
        assert!(index.count() >= SPREAD_FROM);
        let shard: Vec<u8> = (0..4 * table).map(|b| (b % 251) as u8).collect();
        let mut got = vec![0u8; 4 * rows.len()];
        index.gather(&shard, &mut got);
        let want: Vec<u8> = rows
            .iter()
            .flat_map(|&r| shard[4 * r as usize..4 * r as usize + 4].to_vec())
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn one_byte_gaps_sum_a_block_or_see_a_longer_gap() {
        let mut rng = fastrand::Rng::with_seed(17);
        for round in 0..2000 {
            let n = rng.usize(0..=256);
            let mut block: Vec<u8> = (0..n).map(|_| rng.u8(0..0x80)).collect();
            if round % 50 == 0 {
                block.fill(0x7f);
            }
            let sum: u64 = block.iter().map(|&b| u64::from(b)).sum();
            assert_eq!(one_byte_gaps(&block), Some(sum), "{block:?}");
            if n > 0 {
                // A byte with its high bit set, anywhere (the words or the tail), is seen.
                let at = rng.usize(0..n);
                block[at] |= 0x80;
                assert_eq!(one_byte_gaps(&block), None, "byte {at} of {n}");
            }
        }
    }

    #[test]
    fn an_index_gathers_and_visits_its_parts_in_order_whatever_its_form() {
        let mut rng = fastrand::Rng::with_seed(16);
        let len = 20_000usize;
        let shard: Vec<u8> = (0..4 * len).map(|i| (i % 251) as u8).collect();
        for round in 0..60 {
            let dim = [1u64, 1, 1, 3][round % 4];
            // Dense draws (one-byte gaps), sparse ones (longer gaps) and repeats.
            let every = [2u64, 5, 300][round % 3];
            let mut rows: Vec<u64> = (0..rng.usize(0..3000))
                .map(|_| rng.u64(0..len as u64 / dim) / every * every)
                .collect();
            if round % 5 != 0 {
                rows.sort_unstable();
                rows.dedup();
            }
            let mut raw = Vec::new();
            let parts = || rows.iter().map(|&r| (r * dim, dim));
            encode_index(rows.len() as u64, parts, &mut raw);
            let index = index_of_pull(raw).unwrap();
            let mut want = Vec::new();
            for &r in &rows {
                want.extend_from_slice(&shard[(4 * r * dim) as usize..][..4 * dim as usize]);
            }
            let mut got = vec![0u8; 4 * index.floats() as usize];
            index.gather(&shard, &mut got);
            assert_eq!(got, want, "round {round}, dim {dim}");
            // Float by float, as an update visits them.
            let mut floats = Vec::new();
            index.each_block(|i, offs| {
                assert!(!offs.is_empty() && offs.len() <= BLOCK);
                assert_eq!(i, floats.len(), "blocks in order, none skipped");
                floats.extend(offs.iter().enumerate().map(|(k, &off)| (i + k, off)));
            });
            let expect: Vec<(usize, usize)> = rows
                .iter()
                .flat_map(|&r| (0..dim).map(move |k| (r * dim + k) as usize))
                .enumerate()
                .collect();
            assert_eq!(floats, expect, "round {round}, dim {dim}");
        }
    }

    #[test]
    fn whole_rows_pack_sixteen_at_a_time_into_the_same_bytes() {
        let mut rng = fastrand::Rng::with_seed(14);
        let (mut packed, mut not) = (0, 0);
        for round in 0..400 {
            let dim = [1u64, 2, 3, 50][round % 4];
            let table = rng.u64(1..5000);
            let n = rng.usize(0..200);
            let mut rows: Vec<u64> = (0..n).map(|_| rng.u64(0..table)).collect();
            // Mostly sorted and distinct (sparse or dense draws), sometimes not.
            if round % 5 != 0 {
                rows.sort_unstable();
                rows.dedup();
            }
            let shard_off = rows.iter().min().map_or(0, |&r| rng.u64(0..=r * dim));
            let mut fast = Vec::new();
            let mut want = Vec::new();
            let parts = || rows.iter().map(|&r| (r * dim - shard_off, dim));
            encode_index(rows.len() as u64, parts, &mut want);
            if pack_rows(&rows, dim, shard_off, &mut fast) {
                packed += 1;
                assert_eq!(fast, want, "dim {dim}, rows {rows:?}");
            } else {
                not += 1;
                assert!(!is_packed(&want), "dim {dim}, rows {rows:?}");
            }
        }
        assert!(packed > 100 && not > 40, "{packed} packed, {not} not");
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
        // Long indexes, read many one-byte gaps at a time: the same checks.
        let ones = [1u8; 200];
        assert!(index_of(&packed(200, 1, &ones), 400).is_ok());
        assert!(err(packed(200, 1, &ones), 399).contains("past the shard's 399"));
        let mut long = ones.to_vec();
        long[130] = 0x81;
        assert!(err(packed(200, 1, &long), 1000).contains("ends inside a gap"));
        long.splice(130..131, [0xffu8; 11]);
        assert!(err(packed(200, 1, &long), 1000).contains("more than 64 bits"));
        let mut cut = packed(2, 1, &[3, 4]);
        cut[8] = 200;
        assert!(err(cut, 100).contains("does not fit"));
        assert!(err(vec![1, 0], 100).contains("in 2 bytes"));
        assert!(err(PACKED.to_le_bytes().to_vec(), 100).contains("in 4 bytes"));
        // A pull's index must be the whole message field.
        let mut trail = packed(1, 1, &[3]);
        trail.push(0);
        assert!(
            index_of_pull(trail)
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
