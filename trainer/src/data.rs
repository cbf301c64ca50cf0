//! Datasets in IDX files (MNIST, Fashion-MNIST), gzip-compressed or raw.
//!
//! The IDX format: a big-endian `u32` magic `0x0000TTNN` (`TT` the element type, `0x08` for
//! `u8`; `NN` the number of dimensions), then `NN` big-endian `u32` dimensions, then the
//! elements, row-major. Images are `0x00000803` (n, rows, cols); labels `0x00000801` (n).
//!
//! The reader trusts nothing in a file: every defect is an [`Error::Data`] naming the file
//! and saying what is wrong, it never panics, and it never allocates more than the file can
//! really hold, whatever its header claims (a raw file's size is checked against the header
//! before reading; a gzip stream is read with a limit, memory growing only with the data
//! that really arrives). Compression is recognised by the gzip magic bytes `1f 8b`, not by
//! the file name.
//!
//! Where the data comes from ([`Dataset::find`]): `--data DIR` when given, else the full
//! Fashion-MNIST of Debian's `dataset-fashion-mnist` package when installed, else the small
//! real sample bundled in the repository (`data/fashion-mnist-sample/`, 5000 train and 1000
//! test images, cut by `tools/make-sample.sh`).

use std::fmt;
use std::fs::File;
use std::io::{self, Read, Seek};
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// Number of classes; every label must be below it.
pub const CLASSES: usize = 10;

/// Magic of an IDX file of `u8` images: 3 dimensions (n, rows, cols).
pub const IMAGES_MAGIC: u32 = 0x0000_0803;

/// Magic of an IDX file of `u8` labels: 1 dimension (n).
pub const LABELS_MAGIC: u32 = 0x0000_0801;

/// The most data bytes (after the header) this reader accepts from one IDX file: 4 GiB.
/// A header claiming more is rejected before anything is read or allocated.
pub const MAX_IDX_BYTES: u64 = 1 << 32;

/// Where Debian's `dataset-fashion-mnist` package installs the full Fashion-MNIST.
pub const DEBIAN_DIR: &str = "/usr/share/datasets/fashion-mnist";

/// The bundled sample, relative to the repository root.
pub const BUNDLED_DIR: &str = "data/fashion-mnist-sample";

/// The standard file names (each may also carry a `.gz` suffix).
pub const TRAIN_IMAGES: &str = "train-images-idx3-ubyte";
/// See [`TRAIN_IMAGES`].
pub const TRAIN_LABELS: &str = "train-labels-idx1-ubyte";
/// See [`TRAIN_IMAGES`].
pub const TEST_IMAGES: &str = "t10k-images-idx3-ubyte";
/// See [`TRAIN_IMAGES`].
pub const TEST_LABELS: &str = "t10k-labels-idx1-ubyte";

/// The gzip magic bytes.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// Deflate cannot expand by more than about 1032:1, so a gzip file of `len` bytes holds at
/// most `len * 1032` bytes (plus slack for tiny files); a header claiming more is lying.
const DEFLATE_MAX_RATIO: u64 = 1032;

/// The most a gzip read reserves up front; beyond it the buffer grows with the data.
const GZ_PREALLOC: usize = 256 << 20;

/// One IDX file of `u8` elements, as read.
#[derive(Clone, PartialEq, Eq)]
pub struct Idx {
    /// Where it came from (a path, or a name given to [`Idx::parse`]), for error messages.
    pub source: String,
    /// The dimensions from the header (the first is the item count).
    pub dims: Vec<usize>,
    /// The elements, row-major: exactly the product of `dims` bytes.
    pub data: Vec<u8>,
}

impl fmt::Debug for Idx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idx")
            .field("source", &self.source)
            .field("dims", &self.dims)
            .field("data", &format_args!("[{} bytes]", self.data.len()))
            .finish()
    }
}

impl Idx {
    /// Reads the `u8` IDX file at `path`, which must have exactly `dims` dimensions
    /// (3 for images, 1 for labels); gzip or raw, recognised by its first bytes.
    pub fn read(path: &Path, dims: usize) -> Result<Idx> {
        let source = path.display().to_string();
        let mut file = File::open(path).map_err(|e| {
            let why = if e.kind() == io::ErrorKind::NotFound {
                "missing".to_string()
            } else {
                format!("cannot open: {e}")
            };
            data_err(&source, why)
        })?;
        let len = file
            .metadata()
            .map_err(|e| data_err(&source, format!("cannot stat: {e}")))?
            .len();
        decode(&mut file, len, dims, &source)
    }

    /// Parses a `u8` IDX file held in memory (gzip or raw), which must have exactly `dims`
    /// dimensions; `source` names it in errors.
    pub fn parse(bytes: &[u8], dims: usize, source: &str) -> Result<Idx> {
        decode(
            &mut io::Cursor::new(bytes),
            bytes.len() as u64,
            dims,
            source,
        )
    }
}

/// How many bytes may follow the header.
#[derive(Clone, Copy)]
enum Avail {
    /// Exactly this many (a raw file).
    Exact(u64),
    /// At most this many (a gzip stream).
    AtMost(u64),
}

fn data_err(source: &str, why: impl Into<String>) -> Error {
    Error::Data {
        path: source.to_string(),
        why: why.into(),
    }
}

/// Says what went wrong reading from the file or from the gzip stream over it.
fn read_err(source: &str, gz: bool, e: &io::Error) -> Error {
    match (gz, e.kind()) {
        (true, io::ErrorKind::UnexpectedEof) => data_err(
            source,
            format!("truncated: the gzip stream ends early ({e})"),
        ),
        (true, _) => data_err(source, format!("gzip stream corrupt: {e}")),
        (false, _) => data_err(source, format!("read failed: {e}")),
    }
}

/// Reads up to `buf.len()` bytes, stopping only at the end of the stream; returns how many.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

fn decode<R: Read + Seek>(file: &mut R, len: u64, dims: usize, source: &str) -> Result<Idx> {
    let mut head = [0u8; 2];
    let got = read_full(file, &mut head).map_err(|e| read_err(source, false, &e))?;
    file.rewind().map_err(|e| read_err(source, false, &e))?;
    if got == 2 && head == GZIP_MAGIC {
        let bound = len
            .saturating_mul(DEFLATE_MAX_RATIO)
            .saturating_add(1 << 16);
        let mut gz = flate2::read::MultiGzDecoder::new(file);
        body(&mut gz, Avail::AtMost(bound), true, dims, source)
    } else {
        body(file, Avail::Exact(len), false, dims, source)
    }
}

fn body(r: &mut impl Read, avail: Avail, gz: bool, dims: usize, source: &str) -> Result<Idx> {
    let expected = 0x0800 | dims as u32;
    let mut magic = [0u8; 4];
    let got = read_full(r, &mut magic).map_err(|e| read_err(source, gz, &e))?;
    if got < 4 {
        return Err(data_err(
            source,
            format!("truncated: the file ends inside the magic number ({got} of 4 bytes)"),
        ));
    }
    let magic = u32::from_be_bytes(magic);
    if magic >> 16 != 0 || (magic >> 8) & 0xff != 0x08 {
        let hint = match (magic >> 16, (magic >> 8) & 0xff) {
            (0, 0x09 | 0x0b | 0x0c | 0x0d | 0x0e) => {
                "an IDX file of another element type; only u8 (0x08) is read"
            }
            _ => "not an IDX file",
        };
        return Err(data_err(
            source,
            format!("bad magic {magic:#010x}, expected {expected:#010x} ({hint})"),
        ));
    }
    let ndim = (magic & 0xff) as usize;
    if ndim != dims {
        return Err(data_err(
            source,
            format!(
                "wrong dimension count: the header says {ndim}, expected {dims} \
                 (images have 3: n, rows, cols; labels have 1: n)"
            ),
        ));
    }
    let header = 4 + 4 * ndim as u64;
    let mut raw_dims = vec![0u8; 4 * ndim];
    let got = read_full(r, &mut raw_dims).map_err(|e| read_err(source, gz, &e))?;
    if got < raw_dims.len() {
        return Err(data_err(
            source,
            format!(
                "truncated: the file ends inside the header ({} of {header} bytes)",
                4 + got
            ),
        ));
    }
    let dims_v: Vec<u64> = raw_dims
        .chunks_exact(4)
        .map(|c| u64::from(u32::from_be_bytes([c[0], c[1], c[2], c[3]])))
        .collect();
    // The dimensions as the header gives them, for messages: `60000 × 28 × 28`.
    let shape = dims_v
        .iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(" × ");
    // Each factor is below 2^32 and the running product is kept at or below MAX_IDX_BYTES
    // (2^32), so no step overflows u64.
    let mut payload: u64 = 1;
    for &d in &dims_v {
        payload = payload.saturating_mul(d);
        if payload > MAX_IDX_BYTES {
            return Err(data_err(
                source,
                format!(
                    "the header claims dimensions {shape}, more than the {MAX_IDX_BYTES} \
                     bytes (4 GiB) this reader accepts: a corrupt or lying header"
                ),
            ));
        }
    }
    match avail {
        Avail::Exact(len) => {
            let after = len.saturating_sub(header);
            if payload > after {
                return Err(data_err(
                    source,
                    format!(
                        "truncated: the header ({shape}) promises {payload} bytes of data, \
                         the file has {after}"
                    ),
                ));
            }
            if payload < after {
                return Err(data_err(
                    source,
                    format!(
                        "trailing garbage: {} bytes after the {payload} bytes of data the \
                         header ({shape}) promises",
                        after - payload
                    ),
                ));
            }
        }
        Avail::AtMost(bound) => {
            if payload > bound {
                return Err(data_err(
                    source,
                    format!(
                        "truncated: the header ({shape}) promises {payload} bytes of data, \
                         more than this gzip file can hold (at most {bound})"
                    ),
                ));
            }
        }
    }
    // `payload` ≤ MAX_IDX_BYTES; on a 32-bit target it may not fit in memory at all.
    let too_big = |_| {
        data_err(
            source,
            format!("the header ({shape}) does not fit in this machine's address space"),
        )
    };
    let want = usize::try_from(payload).map_err(too_big)?;
    let dims = dims_v
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<Result<Vec<usize>, _>>()
        .map_err(too_big)?;
    let mut data = Vec::with_capacity(if gz { want.min(GZ_PREALLOC) } else { want });
    (&mut *r)
        .take(payload)
        .read_to_end(&mut data)
        .map_err(|e| read_err(source, gz, &e))?;
    if data.len() < want {
        return Err(data_err(
            source,
            format!(
                "truncated: the data ends after {} of the {payload} bytes the header \
                 ({shape}) promises",
                data.len()
            ),
        ));
    }
    if gz {
        // Read on to the end of the stream: this checks the gzip CRC and length, and finds
        // decompressed bytes beyond what the header promised.
        let mut one = [0u8; 1];
        let more = read_full(r, &mut one).map_err(|e| read_err(source, gz, &e))?;
        if more > 0 {
            return Err(data_err(
                source,
                format!(
                    "trailing garbage: the decompressed data goes on after the {payload} bytes \
                     the header ({shape}) promises"
                ),
            ));
        }
    }
    Ok(Idx {
        source: source.to_string(),
        dims,
        data,
    })
}

/// How a job's training data is divided among its workers ([`Split::partition`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Partition {
    /// Every epoch reshuffles the whole split across all workers.
    Shuffled,
    /// A fixed random share per worker (independent, identically distributed).
    #[default]
    Iid,
    /// A fixed share per worker of label-sorted data: each worker sees few classes.
    Skewed,
}

impl std::str::FromStr for Partition {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Partition, String> {
        match s {
            "shuffled" => Ok(Partition::Shuffled),
            "iid" => Ok(Partition::Iid),
            "skewed" => Ok(Partition::Skewed),
            other => Err(format!(
                "unknown partition {other:?}: shuffled, iid or skewed"
            )),
        }
    }
}

impl fmt::Display for Partition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Partition::Shuffled => "shuffled",
            Partition::Iid => "iid",
            Partition::Skewed => "skewed",
        })
    }
}

/// One split (train or test): images scaled to `[0, 1]` and their labels.
#[derive(Clone, PartialEq)]
pub struct Split {
    /// The images, `len() × features()` floats, row-major, each pixel `p / 255`.
    pub images: Vec<f32>,
    /// One label per image, each below [`CLASSES`].
    pub labels: Vec<u8>,
    /// Image height.
    pub rows: usize,
    /// Image width.
    pub cols: usize,
}

impl fmt::Debug for Split {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Split")
            .field("len", &self.len())
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish()
    }
}

impl Split {
    /// Reads a pair of IDX files: images (3 dimensions) and labels (1 dimension).
    pub fn load(images: &Path, labels: &Path) -> Result<Split> {
        Split::from_idx(Idx::read(images, 3)?, Idx::read(labels, 1)?)
    }

    /// Builds a split from an images IDX (n, rows, cols) and a labels IDX (n), checking that
    /// they agree, that there is at least one image of at least one pixel, and that every
    /// label is below [`CLASSES`].
    pub fn from_idx(images: Idx, labels: Idx) -> Result<Split> {
        let [n, rows, cols] = images.dims[..] else {
            return Err(data_err(
                &images.source,
                format!(
                    "wrong dimension count: {} (images have 3)",
                    images.dims.len()
                ),
            ));
        };
        let [m] = labels.dims[..] else {
            return Err(data_err(
                &labels.source,
                format!(
                    "wrong dimension count: {} (labels have 1)",
                    labels.dims.len()
                ),
            ));
        };
        if n == 0 || rows == 0 || cols == 0 {
            return Err(data_err(
                &images.source,
                format!("empty: {n} images of {rows}×{cols} pixels"),
            ));
        }
        let size_ok = n
            .checked_mul(rows)
            .and_then(|x| x.checked_mul(cols))
            .is_some_and(|x| x == images.data.len());
        if !size_ok {
            return Err(data_err(
                &images.source,
                format!(
                    "{} bytes of pixels for {n} images of {rows}×{cols}",
                    images.data.len()
                ),
            ));
        }
        if m != n || labels.data.len() != n {
            return Err(data_err(
                &labels.source,
                format!(
                    "count mismatch: {} labels for the {n} images of {}",
                    labels.data.len(),
                    images.source
                ),
            ));
        }
        if let Some((i, &l)) = labels
            .data
            .iter()
            .enumerate()
            .find(|&(_, &l)| usize::from(l) >= CLASSES)
        {
            return Err(data_err(
                &labels.source,
                format!(
                    "label out of range: item {i} has label {l}, labels must be below {CLASSES}"
                ),
            ));
        }
        let images = images.data.iter().map(|&p| f32::from(p) / 255.0).collect();
        Ok(Split {
            images,
            labels: labels.data,
            rows,
            cols,
        })
    }

    /// Number of images.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether there are no images (never true for a split this module loaded).
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Floats per image: `rows × cols`.
    pub fn features(&self) -> usize {
        self.rows * self.cols
    }

    /// Image `i`, `features()` floats in `[0, 1]`.
    ///
    /// # Panics
    /// If `i >= len()`, like slice indexing.
    pub fn image(&self, i: usize) -> &[f32] {
        let f = self.features();
        &self.images[i * f..(i + 1) * f]
    }

    /// Label of image `i`.
    ///
    /// # Panics
    /// If `i >= len()`, like slice indexing.
    pub fn label(&self, i: usize) -> u8 {
        self.labels[i]
    }

    /// The fixed share of this split that `worker` (of `workers`) owns under `partition`, in
    /// index order (a worker of a real job reads its own shard of the data, every epoch).
    ///
    /// - [`Partition::Shuffled`]: no fixed share (every epoch reshuffles across all workers, see
    ///   [`Split::batch_indices`]): all indices.
    /// - [`Partition::Iid`]: the indices shuffled once with a generator seeded from `seed`, cut
    ///   into `workers` contiguous shares whose sizes differ by at most one.
    /// - [`Partition::Skewed`]: the indices sorted by label (stable) and cut the same way: each
    ///   worker sees one or two classes when `workers ≥ 10`, a few when fewer (the label-skewed
    ///   split of federated-learning studies).
    ///
    /// A `worker` outside `0..workers` gets no indices.
    pub fn partition(
        &self,
        partition: Partition,
        worker: u32,
        workers: u32,
        seed: u64,
    ) -> Vec<usize> {
        if worker >= workers {
            return Vec::new();
        }
        let n = self.len();
        let mut order: Vec<usize> = (0..n).collect();
        match partition {
            Partition::Shuffled => return order,
            Partition::Iid => {
                fastrand::Rng::with_seed(splitmix64(seed ^ 0x5041_5254)).shuffle(&mut order);
            }
            Partition::Skewed => order.sort_by_key(|&i| self.labels[i]),
        }
        let share = |w: u32| (n as u128 * u128::from(w) / u128::from(workers)) as usize;
        let (lo, hi) = (share(worker), share(worker + 1));
        let mut mine = order[lo..hi].to_vec();
        mine.sort_unstable();
        mine
    }

    /// A fixed subset of `n` examples spread evenly over the split (every `len/n`-th; all of
    /// it when `n` is 0 or at least `len()`): an evaluation set that is not biased towards
    /// the split's first images.
    pub fn spread_subset(&self, n: usize) -> Split {
        let len = self.len();
        if n == 0 || n >= len {
            return self.clone();
        }
        let f = self.features();
        let mut images = Vec::with_capacity(n * f);
        let mut labels = Vec::with_capacity(n);
        for k in 0..n {
            let i = (k as u128 * len as u128 / n as u128) as usize;
            images.extend_from_slice(self.image(i));
            labels.push(self.labels[i]);
        }
        Split {
            images,
            labels,
            rows: self.rows,
            cols: self.cols,
        }
    }

    /// The indices of this split that `worker` (of `workers`) visits in `epoch`, in order.
    ///
    /// All `len()` indices are shuffled with a generator seeded from `(seed, epoch)`
    /// (`fastrand::Rng::with_seed`), and the shuffled list is cut into `workers` contiguous
    /// shares whose sizes differ by at most one: worker `w` gets positions
    /// `w·n/workers .. (w+1)·n/workers`. So, for one epoch, the shares of all workers
    /// together hold every index exactly once; another epoch (or seed) gives another order;
    /// and the result depends only on the arguments and `len()`, so any process (running the
    /// same build) can compute any worker's order, as task transfer needs when a helper
    /// takes over a straggler's batches. Cut the result into batches with `chunks(batch)`.
    ///
    /// A `worker` outside `0..workers` (including `workers == 0`) gets no indices.
    pub fn batch_indices(&self, worker: u32, workers: u32, epoch: u64, seed: u64) -> Vec<usize> {
        if worker >= workers {
            return Vec::new();
        }
        let n = self.len();
        let mut order: Vec<usize> = (0..n).collect();
        fastrand::Rng::with_seed(splitmix64(seed ^ splitmix64(epoch))).shuffle(&mut order);
        let share = |w: u32| (n as u128 * u128::from(w) / u128::from(workers)) as usize;
        let (lo, hi) = (share(worker), share(worker + 1));
        order.truncate(hi);
        order.drain(..lo);
        order
    }
}

/// SplitMix64's finaliser: spreads nearby seeds and epochs over unrelated streams.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A train and a test split, and where they came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Dataset {
    /// The training split.
    pub train: Split,
    /// The test split (same image size as `train`).
    pub test: Split,
    /// Where it came from, for the report: the directory and which source it was
    /// (`--data`, Debian's `dataset-fashion-mnist`, or the bundled sample).
    pub source: String,
}

impl Dataset {
    /// Loads the four standard files from `dir`: `train-images-idx3-ubyte`,
    /// `train-labels-idx1-ubyte`, `t10k-images-idx3-ubyte`, `t10k-labels-idx1-ubyte`, each
    /// with or without `.gz` (the `.gz` name is tried first; compression is recognised by
    /// content either way). Train and test images must have the same size.
    pub fn load(dir: &Path) -> Result<Dataset> {
        if !dir.is_dir() {
            let what = if dir.exists() {
                "not a directory"
            } else {
                "does not exist"
            };
            return Err(data_err(
                &dir.display().to_string(),
                format!(
                    "{what}; expected a directory holding {TRAIN_IMAGES}, {TRAIN_LABELS}, \
                     {TEST_IMAGES} and {TEST_LABELS} (each raw or .gz)"
                ),
            ));
        }
        let train = Split::load(&locate(dir, TRAIN_IMAGES)?, &locate(dir, TRAIN_LABELS)?)?;
        let test_images = locate(dir, TEST_IMAGES)?;
        let test = Split::load(&test_images, &locate(dir, TEST_LABELS)?)?;
        if (train.rows, train.cols) != (test.rows, test.cols) {
            return Err(data_err(
                &test_images.display().to_string(),
                format!(
                    "test images are {}×{}, train images {}×{}",
                    test.rows, test.cols, train.rows, train.cols
                ),
            ));
        }
        Ok(Dataset {
            train,
            test,
            source: display_dir(dir),
        })
    }

    /// Finds a dataset: `explicit` (`--data DIR`) when given, and then it must load;
    /// otherwise the full Fashion-MNIST at [`DEBIAN_DIR`] when that directory exists (if it
    /// fails to load, a warning is logged and the search goes on); otherwise
    /// [`Dataset::bundled`].
    pub fn find(explicit: Option<&Path>) -> Result<Dataset> {
        if let Some(dir) = explicit {
            let mut d = Dataset::load(dir)?;
            d.source = format!("{} (--data)", d.source);
            return Ok(d);
        }
        let debian = Path::new(DEBIAN_DIR);
        if debian.is_dir() {
            match Dataset::load(debian) {
                Ok(mut d) => {
                    d.source = format!("{} (Debian dataset-fashion-mnist)", d.source);
                    return Ok(d);
                }
                Err(e) => {
                    tracing::warn!("{e}; falling back to the bundled Fashion-MNIST sample");
                }
            }
        }
        Dataset::bundled()
    }

    /// Loads the bundled Fashion-MNIST sample (5000 train, 1000 test images): from the
    /// repository this crate was built in (`<crate>/../data/fashion-mnist-sample`), else from
    /// `./data/fashion-mnist-sample` under the current directory.
    pub fn bundled() -> Result<Dataset> {
        let candidates = [
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../data/fashion-mnist-sample"
            )),
            PathBuf::from(BUNDLED_DIR),
        ];
        for dir in &candidates {
            if dir.is_dir() {
                let mut d = Dataset::load(dir)?;
                d.source = format!("{} (bundled sample)", d.source);
                return Ok(d);
            }
        }
        Err(data_err(
            &candidates
                .iter()
                .map(|c| c.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
            "the bundled sample is missing; pass --data DIR, or install the full set with \
             `apt-get install -y dataset-fashion-mnist`",
        ))
    }
}

/// `dir/name.gz` if it exists, else `dir/name` if it exists, else a "missing" error.
fn locate(dir: &Path, name: &str) -> Result<PathBuf> {
    let gz = dir.join(format!("{name}.gz"));
    if gz.exists() {
        return Ok(gz);
    }
    let raw = dir.join(name);
    if raw.exists() {
        return Ok(raw);
    }
    Err(data_err(
        &gz.display().to_string(),
        format!(
            "missing: neither {name}.gz nor {name} is in {}",
            dir.display()
        ),
    ))
}

fn display_dir(dir: &Path) -> String {
    dir.canonicalize()
        .unwrap_or_else(|_| dir.to_path_buf())
        .display()
        .to_string()
}
