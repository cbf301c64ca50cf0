//! The IDX reader and the datasets: the bundled sample, round trips, every kind of corrupt
//! file (including a fuzz-style loop of truncations and byte flips), lying headers, and the
//! deterministic partition of a split across workers.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use falcon_trainer::Error;
use falcon_trainer::data::{
    CLASSES, DEBIAN_DIR, Dataset, Idx, Split, TEST_IMAGES, TEST_LABELS, TRAIN_IMAGES, TRAIN_LABELS,
};

// --- helpers ------------------------------------------------------------------------------

/// An IDX file of u8, written by hand (independently of the reader).
fn idx_bytes(dims: &[u32], data: &[u8]) -> Vec<u8> {
    let mut out = vec![0, 0, 0x08, dims.len() as u8];
    for d in dims {
        out.extend_from_slice(&d.to_be_bytes());
    }
    out.extend_from_slice(data);
    out
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

/// A small synthetic pair: `n` images of `rows × cols` and their labels.
fn synthetic(n: u32, rows: u32, cols: u32, seed: u64) -> (Vec<u8>, Vec<u8>) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let pixels: Vec<u8> = (0..n * rows * cols).map(|_| rng.u8(..)).collect();
    let labels: Vec<u8> = (0..n).map(|_| rng.u8(..CLASSES as u8)).collect();
    (
        idx_bytes(&[n, rows, cols], &pixels),
        idx_bytes(&[n], &labels),
    )
}

/// A fresh empty directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir =
            std::env::temp_dir().join(format!("falcon-data-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn write(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes a whole dataset (4 files) into `dir`, gzipped or raw.
fn write_dataset(dir: &TempDir, gz: bool, train: (Vec<u8>, Vec<u8>), test: (Vec<u8>, Vec<u8>)) {
    let files = [
        (TRAIN_IMAGES, train.0),
        (TRAIN_LABELS, train.1),
        (TEST_IMAGES, test.0),
        (TEST_LABELS, test.1),
    ];
    for (name, bytes) in files {
        if gz {
            dir.write(&format!("{name}.gz"), &gzip(&bytes));
        } else {
            dir.write(name, &bytes);
        }
    }
}

/// The `Error::Data` parts, or a failure naming what came instead.
fn data_error<T: std::fmt::Debug>(r: falcon_trainer::Result<T>) -> (String, String) {
    match r {
        Err(Error::Data { path, why }) => (path, why),
        other => panic!("expected Error::Data, got {other:?}"),
    }
}

fn assert_data_error<T: std::fmt::Debug>(
    r: falcon_trainer::Result<T>,
    path_has: &str,
    why_has: &[&str],
) {
    let (path, why) = data_error(r);
    assert!(
        path.contains(path_has),
        "path {path:?} should name {path_has:?} (why: {why})"
    );
    assert!(
        why_has.iter().any(|w| why.contains(w)),
        "why {why:?} should say one of {why_has:?}"
    );
}

// --- the bundled sample and the full set --------------------------------------------------

#[test]
fn bundled_sample_loads() {
    let t = Instant::now();
    let d = Dataset::bundled().unwrap();
    eprintln!(
        "bundled sample: {} train + {} test loaded in {:.3} s from {}",
        d.train.len(),
        d.test.len(),
        t.elapsed().as_secs_f64(),
        d.source
    );
    assert_eq!(d.train.len(), 5000);
    assert_eq!(d.test.len(), 1000);
    assert!(d.source.contains("bundled sample"));
    for s in [&d.train, &d.test] {
        assert_eq!((s.rows, s.cols, s.features()), (28, 28, 784));
        assert_eq!(s.images.len(), s.len() * 784);
        assert!(s.images.iter().all(|&p| (0.0..=1.0).contains(&p)));
        assert!(s.labels.iter().all(|&l| usize::from(l) < CLASSES));
        assert_eq!(s.image(s.len() - 1).len(), 784);
        // Real images: not blank, and every class present.
        assert!(s.images.contains(&1.0));
        for c in 0..CLASSES as u8 {
            assert!(s.labels.contains(&c), "class {c} missing");
        }
    }
    // The first Fashion-MNIST training image is an ankle boot (9), the first test one too.
    assert_eq!(d.train.label(0), 9);
    assert_eq!(d.test.label(0), 9);
}

#[test]
fn full_set_loads_when_installed() {
    let dir = Path::new(DEBIAN_DIR);
    if !dir.is_dir() {
        eprintln!(
            "SKIPPED: full Fashion-MNIST not installed at {DEBIAN_DIR} \
             (apt-get install -y dataset-fashion-mnist)"
        );
        return;
    }
    let t = Instant::now();
    let d = Dataset::load(dir).unwrap();
    eprintln!(
        "full set: {} train + {} test loaded in {:.3} s",
        d.train.len(),
        d.test.len(),
        t.elapsed().as_secs_f64()
    );
    assert_eq!(d.train.len(), 60000);
    assert_eq!(d.test.len(), 10000);
    assert_eq!(d.train.features(), 784);
    // The sample is the first images of the full set, unchanged.
    let s = Dataset::bundled().unwrap();
    assert_eq!(s.train.labels[..], d.train.labels[..5000]);
    assert_eq!(s.test.images[..], d.test.images[..1000 * 784]);
    // With no --data, find() prefers the full set.
    let found = Dataset::find(None).unwrap();
    assert!(found.source.contains("Debian"), "{}", found.source);
    assert_eq!(found.train.len(), 60000);
}

#[test]
fn find_uses_explicit_dir_and_fails_if_it_does_not_load() {
    let dir = TempDir::new("find");
    write_dataset(&dir, true, synthetic(7, 3, 2, 1), synthetic(3, 3, 2, 2));
    let d = Dataset::find(Some(&dir.0)).unwrap();
    assert_eq!((d.train.len(), d.test.len(), d.train.features()), (7, 3, 6));
    assert!(d.source.contains("--data"));
    let missing = dir.0.join("nope");
    assert_data_error(Dataset::find(Some(&missing)), "nope", &["does not exist"]);
    let file = dir.0.join(format!("{TEST_LABELS}.gz"));
    assert_data_error(
        Dataset::find(Some(&file)),
        TEST_LABELS,
        &["not a directory"],
    );
}

// --- round trips --------------------------------------------------------------------------

#[test]
fn round_trip_raw_and_gz() {
    for gz in [false, true] {
        let dir = TempDir::new(if gz { "rt-gz" } else { "rt-raw" });
        let (tr, te) = (synthetic(13, 5, 4, 3), synthetic(6, 5, 4, 4));
        write_dataset(&dir, gz, tr.clone(), te.clone());
        let d = Dataset::load(&dir.0).unwrap();
        for (s, (imgs, labels)) in [(&d.train, &tr), (&d.test, &te)] {
            assert_eq!((s.rows, s.cols), (5, 4));
            assert_eq!(s.labels[..], labels[8..]);
            let back: Vec<u8> = s
                .images
                .iter()
                .map(|&p| (p * 255.0).round() as u8)
                .collect();
            assert_eq!(back[..], imgs[16..]);
            assert!(s.images.iter().all(|&p| (0.0..=1.0).contains(&p)));
        }
    }
}

#[test]
fn compression_is_recognised_by_content_not_name() {
    let dir = TempDir::new("names");
    let (imgs, labels) = synthetic(4, 2, 2, 5);
    // Raw bytes under a .gz name, gzip bytes under a raw name.
    let a = dir.write("a.gz", &imgs);
    let b = dir.write("b", &gzip(&labels));
    let s = Split::load(&a, &b).unwrap();
    assert_eq!(s.len(), 4);
    assert_eq!(s.labels[..], labels[8..]);
}

#[test]
fn multi_member_gzip_is_read_whole() {
    let (imgs, _) = synthetic(3, 4, 4, 6);
    let mut two = gzip(&imgs[..20]);
    two.extend(gzip(&imgs[20..]));
    let idx = Idx::parse(&two, 3, "two-members").unwrap();
    assert_eq!(idx.dims, [3, 4, 4]);
    assert_eq!(idx.data[..], imgs[16..]);
}

// --- each defect --------------------------------------------------------------------------

#[test]
fn missing_file_is_named() {
    let dir = TempDir::new("missing");
    write_dataset(&dir, true, synthetic(4, 2, 2, 7), synthetic(2, 2, 2, 8));
    std::fs::remove_file(dir.0.join(format!("{TEST_LABELS}.gz"))).unwrap();
    assert_data_error(Dataset::load(&dir.0), TEST_LABELS, &["missing"]);
    assert_data_error(
        Idx::read(&dir.0.join("nothing-here"), 1),
        "nothing-here",
        &["missing"],
    );
}

#[test]
fn bad_magic() {
    let (mut imgs, _) = synthetic(2, 2, 2, 9);
    imgs[..4].copy_from_slice(&[0x03, 0x08, 0, 0]); // little-endian magic
    assert_data_error(Idx::parse(&imgs, 3, "le"), "le", &["bad magic"]);
    imgs[..4].copy_from_slice(&[0, 0, 0x0d, 3]); // f32 elements
    let (_, why) = data_error(Idx::parse(&imgs, 3, "f32"));
    assert!(
        why.contains("bad magic") && why.contains("element type"),
        "{why}"
    );
    assert_data_error(
        Idx::parse(b"PK\x03\x04zip!", 3, "zip"),
        "zip",
        &["bad magic"],
    );
    assert_data_error(
        Idx::parse(&gzip(b"hello, world"), 1, "gz-text"),
        "gz-text",
        &["bad magic"],
    );
}

#[test]
fn wrong_dimension_count() {
    let (imgs, labels) = synthetic(2, 2, 2, 10);
    // Labels where images are expected and the other way round.
    assert_data_error(Idx::parse(&labels, 3, "l"), "l", &["wrong dimension count"]);
    assert_data_error(Idx::parse(&imgs, 1, "i"), "i", &["wrong dimension count"]);
    // Through the files of a dataset: the labels file holds images.
    let dir = TempDir::new("dims");
    write_dataset(&dir, false, (imgs.clone(), imgs), synthetic(2, 2, 2, 11));
    assert_data_error(
        Dataset::load(&dir.0),
        TRAIN_LABELS,
        &["wrong dimension count"],
    );
}

#[test]
fn truncated_payload_and_header() {
    let (imgs, _) = synthetic(5, 3, 3, 12);
    for cut in [0, 1, 3, 4, 7, 15, 16, 17, imgs.len() - 1] {
        assert_data_error(Idx::parse(&imgs[..cut], 3, "raw"), "raw", &["truncated"]);
    }
    let gz = gzip(&imgs);
    for cut in [2, 5, 10, gz.len() / 2, gz.len() - 8, gz.len() - 1] {
        assert_data_error(
            Idx::parse(&gz[..cut], 3, "gz"),
            "gz",
            &["truncated", "gzip"],
        );
    }
}

#[test]
fn trailing_garbage() {
    let (mut imgs, _) = synthetic(5, 3, 3, 13);
    let gz_long = gzip(&[&imgs[..], b"extra"].concat());
    imgs.push(0);
    assert_data_error(Idx::parse(&imgs, 3, "raw"), "raw", &["trailing garbage"]);
    assert_data_error(Idx::parse(&gz_long, 3, "gz"), "gz", &["trailing garbage"]);
    // Garbage after the gzip stream itself.
    let mut gz_tail = gzip(&imgs[..imgs.len() - 1]);
    gz_tail.extend_from_slice(b"junk after the stream");
    assert_data_error(Idx::parse(&gz_tail, 3, "gzt"), "gzt", &["gzip", "trailing"]);
}

#[test]
fn corrupt_gzip_stream() {
    let (imgs, _) = synthetic(20, 8, 8, 14);
    let mut gz = gzip(&imgs);
    let mid = gz.len() / 2;
    gz[mid] ^= 0x55;
    assert_data_error(
        Idx::parse(&gz, 3, "gz"),
        "gz",
        &["gzip", "truncated", "trailing"],
    );
    // A wrong CRC alone.
    let mut gz = gzip(&imgs);
    let crc = gz.len() - 8;
    gz[crc] ^= 1;
    assert_data_error(Idx::parse(&gz, 3, "crc"), "crc", &["gzip stream corrupt"]);
}

#[test]
fn labels_out_of_range() {
    let (imgs, mut labels) = synthetic(6, 2, 2, 15);
    labels[8 + 4] = 10;
    let dir = TempDir::new("labels");
    let i = dir.write("i", &imgs);
    let l = dir.write("l", &labels);
    let (path, why) = data_error(Split::load(&i, &l));
    assert!(path.ends_with("/l"), "{path}");
    assert!(
        why.contains("label out of range") && why.contains("item 4"),
        "{why}"
    );
}

#[test]
fn image_label_count_mismatch() {
    let (imgs, _) = synthetic(6, 2, 2, 16);
    let (_, labels) = synthetic(5, 2, 2, 16);
    let i = Idx::parse(&imgs, 3, "imgs").unwrap();
    let l = Idx::parse(&labels, 1, "labs").unwrap();
    assert_data_error(Split::from_idx(i, l), "labs", &["count mismatch"]);
}

#[test]
fn train_test_size_mismatch_and_empty() {
    let dir = TempDir::new("sizes");
    write_dataset(&dir, false, synthetic(3, 2, 2, 17), synthetic(3, 3, 2, 18));
    assert_data_error(Dataset::load(&dir.0), TEST_IMAGES, &["3×2"]);
    let empty = Idx::parse(&idx_bytes(&[0, 28, 28], &[]), 3, "e").unwrap();
    let none = Idx::parse(&idx_bytes(&[0], &[]), 1, "n").unwrap();
    assert_data_error(Split::from_idx(empty, none), "e", &["empty"]);
}

#[test]
fn lying_header_is_refused_without_allocating() {
    let before = vm_peak_kib();
    let t = Instant::now();
    // 2^31 images of 28×28: far beyond the reader's limit.
    let huge = idx_bytes(&[1 << 31, 28, 28], &[1, 2, 3]);
    assert_data_error(Idx::parse(&huge, 3, "huge"), "huge", &["more than"]);
    assert_data_error(
        Idx::parse(&gzip(&huge), 3, "hugegz"),
        "hugegz",
        &["more than"],
    );
    // 2^31 one-pixel images: under the limit, but the file cannot hold them.
    let big = idx_bytes(&[1 << 31, 1, 1], &[1, 2, 3]);
    assert_data_error(Idx::parse(&big, 3, "big"), "big", &["truncated"]);
    assert_data_error(Idx::parse(&gzip(&big), 3, "biggz"), "biggz", &["truncated"]);
    // 2^31 labels.
    let labels = idx_bytes(&[1 << 31], &[1]);
    assert_data_error(Idx::parse(&gzip(&labels), 1, "lab"), "lab", &["truncated"]);
    // Through a real file too.
    let dir = TempDir::new("huge");
    let p = dir.write("huge.gz", &gzip(&big));
    assert_data_error(Idx::read(&p, 3), "huge.gz", &["truncated"]);
    assert!(t.elapsed().as_secs_f64() < 5.0);
    if let (Some(b), Some(a)) = (before, vm_peak_kib()) {
        // Other tests run beside this one, so allow them some room; 2^31 bytes would
        // show up as 2 GiB.
        assert!(a - b < 1 << 20, "VmPeak grew by {} KiB", a - b);
    }
}

/// The process's peak virtual memory (Linux), in KiB.
fn vm_peak_kib() -> Option<i64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmPeak:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

// --- fuzz-style: truncations and flips never panic ----------------------------------------

#[test]
fn fuzz_truncations_and_flips() {
    let mut rng = fastrand::Rng::with_seed(0xfa1c0);
    let (imgs, labels) = synthetic(24, 7, 6, 19);
    let originals = [
        ("imgs", imgs.clone(), 3usize, false),
        ("labels", labels.clone(), 1, false),
        ("imgs.gz", gzip(&imgs), 3, true),
        ("labels.gz", gzip(&labels), 1, true),
    ];
    let (mut cases, mut ok_after_flip) = (0, 0);
    for (name, bytes, dims, gz) in &originals {
        // Every strict prefix is an error.
        for _ in 0..150 {
            let cut = rng.usize(..bytes.len());
            let (path, why) = data_error(Idx::parse(&bytes[..cut], *dims, name));
            assert_eq!(path, *name);
            assert!(
                why.contains("truncated") || (*gz && why.contains("gzip")),
                "{name} cut at {cut}: {why}"
            );
            cases += 1;
        }
        // Random byte flips: an error or a well-formed result, never a panic.
        for _ in 0..150 {
            let mut b = bytes.clone();
            for _ in 0..rng.usize(1..4) {
                let i = rng.usize(..b.len());
                b[i] ^= rng.u8(1..);
            }
            cases += 1;
            match Idx::parse(&b, *dims, name) {
                Ok(idx) => {
                    ok_after_flip += 1;
                    let n: usize = idx.dims.iter().product();
                    assert_eq!(idx.data.len(), n);
                    // Going on to build a split must not panic either.
                    let other = Idx::parse(if *dims == 3 { &labels } else { &imgs }, 4 - dims, "o")
                        .unwrap();
                    let _ = if *dims == 3 {
                        Split::from_idx(idx, other)
                    } else {
                        Split::from_idx(other, idx)
                    };
                }
                Err(Error::Data { path, .. }) => assert_eq!(path, *name),
                Err(e) => panic!("{name}: unexpected error {e:?}"),
            }
        }
    }
    // Through real files as well (the File path of the reader).
    let dir = TempDir::new("fuzz");
    for k in 0..40 {
        let (name, bytes, dims, _) = &originals[k % originals.len()];
        let cut = rng.usize(..bytes.len());
        let p = dir.write(&format!("{k}-{name}"), &bytes[..cut]);
        let (path, _) = data_error(Idx::read(&p, *dims));
        assert!(path.ends_with(&format!("{k}-{name}")));
        cases += 1;
    }
    eprintln!("fuzz: {cases} cases, {ok_after_flip} flipped inputs still well-formed");
    assert!(cases >= 600);
}

#[test]
fn fuzz_the_real_sample_labels() {
    // Truncate and flip the real gzip labels of the sample: never a panic, always typed.
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../data/fashion-mnist-sample")
        .join(format!("{TEST_LABELS}.gz"));
    let bytes = std::fs::read(&path).unwrap();
    assert!(Idx::parse(&bytes, 1, "t").is_ok());
    let mut rng = fastrand::Rng::with_seed(7);
    for _ in 0..200 {
        let mut b = bytes[..rng.usize(..=bytes.len())].to_vec();
        if !b.is_empty() && rng.bool() {
            let i = rng.usize(..b.len());
            b[i] ^= rng.u8(1..);
        }
        match Idx::parse(&b, 1, "t") {
            Ok(idx) => assert_eq!(idx.data.len(), idx.dims[0]),
            Err(Error::Data { path, .. }) => assert_eq!(path, "t"),
            Err(e) => panic!("unexpected error {e:?}"),
        }
    }
}

// --- batch_indices ------------------------------------------------------------------------

fn split_of(n: usize) -> Split {
    Split {
        images: vec![0.0; n],
        labels: vec![0; n],
        rows: 1,
        cols: 1,
    }
}

#[test]
fn batch_indices_partition_exactly() {
    for n in [0, 1, 5, 1003] {
        let s = split_of(n);
        for workers in 1..=7u32 {
            for epoch in 0..3 {
                let shares: Vec<Vec<usize>> = (0..workers)
                    .map(|w| s.batch_indices(w, workers, epoch, 42))
                    .collect();
                let sizes: Vec<usize> = shares.iter().map(Vec::len).collect();
                let (lo, hi) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
                assert!(hi - lo <= 1, "n {n} workers {workers}: sizes {sizes:?}");
                let mut all: Vec<usize> = shares.concat();
                all.sort_unstable();
                assert_eq!(all, (0..n).collect::<Vec<_>>(), "n {n} workers {workers}");
            }
        }
    }
}

#[test]
fn batch_indices_are_deterministic_and_reshuffled() {
    let s = split_of(1000);
    let a = s.batch_indices(2, 4, 0, 9);
    assert_eq!(a.len(), 250);
    // Same arguments: same order, in any process (nothing but the arguments goes in).
    assert_eq!(a, s.batch_indices(2, 4, 0, 9));
    // Another epoch or seed: another order and another share.
    assert_ne!(a, s.batch_indices(2, 4, 1, 9));
    assert_ne!(a, s.batch_indices(2, 4, 0, 10));
    let whole0 = s.batch_indices(0, 1, 0, 9);
    let whole1 = s.batch_indices(0, 1, 1, 9);
    assert_ne!(whole0, whole1);
    assert_ne!(whole0, (0..1000).collect::<Vec<_>>());
    // The shares are consecutive pieces of one epoch's permutation.
    let mut parts = Vec::new();
    for w in 0..4 {
        parts.extend(s.batch_indices(w, 4, 0, 9));
    }
    assert_eq!(parts, whole0);
    // Workers outside 0..workers get nothing.
    assert!(s.batch_indices(4, 4, 0, 9).is_empty());
    assert!(s.batch_indices(0, 0, 0, 9).is_empty());
}
