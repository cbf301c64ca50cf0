//! Models on flat buffers: finite-difference gradient checks, accumulation, chunking, shape
//! validation, and a training sanity check on a synthetic separable problem.
//!
//! Step timings (release): `cargo test --release -p falcon-trainer --test model -- --ignored
//! --nocapture step_timings`.

use std::ops::Range;
use std::time::Instant;

use falcon_trainer::Error;
use falcon_trainer::model::{Cnn, Mlp, Model, ModelSpec, ResMlp, Scratch};

// ---------------------------------------------------------------------------------------
// Helpers

/// `n` examples with inputs uniform in [-1, 1) and random labels.
fn random_batch(model: &dyn Model, n: usize, seed: u64) -> (Vec<f32>, Vec<u8>) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let x = (0..n * model.input_len())
        .map(|_| rng.f32() * 2.0 - 1.0)
        .collect();
    let y = (0..n).map(|_| rng.u8(..model.classes() as u8)).collect();
    (x, y)
}

/// Initialised parameters with the (zero) biases jittered too, so they matter.
fn jittered_params(model: &dyn Model, seed: u64) -> Vec<f32> {
    let mut rng = fastrand::Rng::with_seed(seed ^ 0x5eed);
    let mut p = model.init_vec(seed);
    for v in &mut p {
        *v += (rng.f32() - 0.5) * 0.1;
    }
    p
}

fn loss(model: &dyn Model, p: &[f32], x: &[f32], y: &[u8], s: &mut Scratch) -> f32 {
    model.evaluate(p, x, y, s).expect("evaluate").0
}

/// Central difference d(loss_sum)/d(p[i]) with step `eps`.
fn numeric(model: &dyn Model, p: &mut [f32], i: usize, eps: f32, x: &[f32], y: &[u8]) -> f32 {
    let mut s = Scratch::new();
    let orig = p[i];
    p[i] = orig + eps;
    let plus = loss(model, p, x, y, &mut s);
    p[i] = orig - eps;
    let minus = loss(model, p, x, y, &mut s);
    p[i] = orig;
    (plus - minus) / (2.0 * eps)
}

/// f32 agreement: 1% relative, with an absolute floor of 2e-3 for small gradients.
fn close(analytic: f32, numeric: f32) -> bool {
    (analytic - numeric).abs() <= 1e-2 * 0.2f32.max(analytic.abs()).max(numeric.abs())
}

/// Finite-difference steps tried in turn (see [`grad_check`]).
const STEPS: [f32; 4] = [1e-2, 3e-3, 1e-3, 3e-4];

/// Compares the analytic gradient with central differences on `per_group` random
/// coordinates of each parameter tensor in `groups` (named ranges of the documented layout).
///
/// A coordinate passes if it agrees at any of the [`STEPS`]: they have different rounding
/// errors and cross ReLU/max-pool kinks at different places, whereas a wrong backward is
/// wrong at all of them.
fn grad_check(model: &dyn Model, groups: &[(&str, Range<usize>)], per_group: usize, n: usize) {
    let last = groups.last().expect("groups").1.end;
    assert_eq!(
        last,
        model.num_params(),
        "documented layout must cover every parameter"
    );
    let mut p = jittered_params(model, 7);
    let (x, y) = random_batch(model, n, 11);
    let mut g = vec![0.0; model.num_params()];
    model
        .grad(&p, &x, &y, &mut g, &mut model.scratch(n))
        .expect("grad");
    let mut rng = fastrand::Rng::with_seed(3);
    let (mut checked, mut needed_smaller_step) = (0, 0);
    for (name, range) in groups {
        for _ in 0..per_group.min(range.len()) {
            let i = rng.usize(range.clone());
            let a = g[i];
            let numerics: Vec<f32> = STEPS
                .iter()
                .map(|&eps| numeric(model, &mut p, i, eps, &x, &y))
                .collect();
            let first_ok = numerics.iter().position(|&n| close(a, n));
            assert!(
                first_ok.is_some(),
                "{}: {name}[{}]: analytic {a} vs numeric {numerics:?} (steps {STEPS:?})",
                model.name(),
                i - range.start
            );
            checked += 1;
            needed_smaller_step += usize::from(first_ok != Some(0));
        }
    }
    eprintln!(
        "{}: {checked} coordinates agree ({needed_smaller_step} needed a step below {})",
        model.name(),
        STEPS[0]
    );
}

/// Named tensors of an MLP, per the documented layout (W then b, layer after layer).
fn mlp_groups(sizes: &[usize]) -> Vec<(String, Range<usize>)> {
    let mut out = Vec::new();
    let mut o = 0;
    for (l, pair) in sizes.windows(2).enumerate() {
        let w = pair[0] * pair[1];
        out.push((format!("W{}", l + 1), o..o + w));
        out.push((format!("b{}", l + 1), o + w..o + w + pair[1]));
        o += w + pair[1];
    }
    out
}

/// Named tensors of a CNN, per the documented layout.
fn cnn_groups(
    h: usize,
    w: usize,
    c1: usize,
    c2: usize,
    classes: usize,
) -> Vec<(String, Range<usize>)> {
    let lens = [
        ("W1", 25 * c1),
        ("b1", c1),
        ("W2", 25 * c1 * c2),
        ("b2", c2),
        ("W3", (h / 4) * (w / 4) * c2 * classes),
        ("b3", classes),
    ];
    let mut o = 0;
    lens.iter()
        .map(|&(name, len)| {
            o += len;
            (name.to_string(), o - len..o)
        })
        .collect()
}

fn as_refs(groups: &[(String, Range<usize>)]) -> Vec<(&str, Range<usize>)> {
    groups
        .iter()
        .map(|(n, r)| (n.as_str(), r.clone()))
        .collect()
}

// ---------------------------------------------------------------------------------------
// Gradient checks

#[test]
fn mlp_two_layers_matches_finite_differences() {
    let sizes = [20, 16, 7];
    let model = Mlp::new(&sizes).unwrap();
    grad_check(&model, &as_refs(&mlp_groups(&sizes)), 30, 4);
}

#[test]
fn mlp_three_layers_matches_finite_differences() {
    let sizes = [24, 16, 12, 5];
    let model = Mlp::new(&sizes).unwrap();
    grad_check(&model, &as_refs(&mlp_groups(&sizes)), 25, 4);
}

#[test]
fn cnn_matches_finite_differences() {
    let model = Cnn::with_input(8, 12, 3, 4, 5).unwrap();
    grad_check(&model, &as_refs(&cnn_groups(8, 12, 3, 4, 5)), 25, 3);
}

#[test]
fn cnn_small_28x28_matches_finite_differences() {
    let model = Cnn::small();
    assert_eq!(model.num_params(), 11_274);
    // One image: a conv1 bias moves 784 ReLU inputs per image, so bigger batches cross
    // too many kinks for finite differences to be meaningful.
    grad_check(&model, &as_refs(&cnn_groups(28, 28, 8, 16, 10)), 10, 1);
}

// ---------------------------------------------------------------------------------------
// Accumulation and chunking

/// Two half-batches into one buffer == one full batch, and `grad` adds to what is there.
fn check_accumulation(model: &dyn Model, n: usize) {
    let p = jittered_params(model, 1);
    let (x, y) = random_batch(model, n, 2);
    let d = model.input_len();
    let mut s = model.scratch(n);

    let mut full = vec![0.0; model.num_params()];
    let (loss_full, correct_full) = model.grad(&p, &x, &y, &mut full, &mut s).unwrap();

    let preset: Vec<f32> = (0..model.num_params()).map(|i| (i % 7) as f32).collect();
    let mut halves = preset.clone();
    let h = n / 2;
    let (l1, c1) = model
        .grad(&p, &x[..h * d], &y[..h], &mut halves, &mut s)
        .unwrap();
    let (l2, c2) = model
        .grad(&p, &x[h * d..], &y[h..], &mut halves, &mut s)
        .unwrap();

    assert!((loss_full - (l1 + l2)).abs() <= 1e-4 * loss_full.abs().max(1.0));
    assert_eq!(correct_full, c1 + c2);
    let mut worst = 0f32;
    for ((&f, &hv), &pre) in full.iter().zip(&halves).zip(&preset) {
        worst = worst.max(((hv - pre) - f).abs());
    }
    assert!(
        worst <= 1e-4,
        "{}: accumulated halves differ by {worst}",
        model.name()
    );

    // The loss and accuracy from `grad` are those of `evaluate`.
    let (loss_eval, correct_eval) = model.evaluate(&p, &x, &y, &mut s).unwrap();
    assert!((loss_eval - loss_full).abs() <= 1e-5 * loss_full.abs().max(1.0));
    assert_eq!(correct_eval, correct_full);
}

#[test]
fn gradients_accumulate() {
    check_accumulation(&Mlp::new(&[30, 20, 10, 6]).unwrap(), 10);
    check_accumulation(&Cnn::with_input(8, 8, 2, 3, 4).unwrap(), 6);
}

/// A batch bigger than the model's chunk gives the same result as example by example.
fn check_chunking(model: &dyn Model) {
    let n = model.chunk() * 2 + 3;
    let p = jittered_params(model, 5);
    let (x, y) = random_batch(model, n, 6);
    let d = model.input_len();
    let mut s = Scratch::new();
    let mut g_batch = vec![0.0; model.num_params()];
    let (loss, correct) = model.grad(&p, &x, &y, &mut g_batch, &mut s).unwrap();
    let mut g_single = vec![0.0; model.num_params()];
    let (mut loss_single, mut correct_single) = (0.0, 0);
    for i in 0..n {
        let (l, c) = model
            .grad(&p, &x[i * d..(i + 1) * d], &y[i..=i], &mut g_single, &mut s)
            .unwrap();
        loss_single += l;
        correct_single += c;
    }
    assert!((loss - loss_single).abs() <= 1e-4 * loss.abs());
    assert_eq!(correct, correct_single);
    for (a, b) in g_batch.iter().zip(&g_single) {
        assert!((a - b).abs() <= 1e-3 * a.abs().max(1.0), "{a} vs {b}");
    }
}

#[test]
fn batches_larger_than_a_chunk_are_split() {
    check_chunking(&Mlp::new(&[5, 4, 3]).unwrap());
    check_chunking(&Cnn::with_input(4, 4, 2, 2, 3).unwrap());
    check_chunking(&ResMlp::new(5, 4, 2, 3).unwrap());
}

#[test]
fn scratch_does_not_grow_after_the_first_step() {
    let models: [Box<dyn Model>; 2] = [
        Box::new(Mlp::new(&[784, 64, 10]).unwrap()),
        Box::new(Cnn::new(4, 8).unwrap()),
    ];
    for model in &models {
        let model = model.as_ref();
        let mut s = model.scratch(16);
        let before = s.allocated_bytes();
        assert!(before > 0);
        let p = model.init_vec(1);
        let (x, y) = random_batch(model, 16, 2);
        let mut g = vec![0.0; model.num_params()];
        model.grad(&p, &x, &y, &mut g, &mut s).unwrap();
        model
            .grad(&p, &x[..8 * model.input_len()], &y[..8], &mut g, &mut s)
            .unwrap();
        model.evaluate(&p, &x, &y, &mut s).unwrap();
        assert_eq!(s.allocated_bytes(), before, "{}", model.name());
    }
}

// ---------------------------------------------------------------------------------------
// Layout, init, validation

#[test]
fn layouts_and_names() {
    let mlp = Mlp::new(&[784, 256, 10]).unwrap();
    assert_eq!(mlp.num_params(), 203_530);
    assert_eq!((mlp.input_len(), mlp.classes()), (784, 10));
    assert_eq!(mlp.name(), "mlp:784-256-10");
    let deep = Mlp::new(&[784, 512, 256, 10]).unwrap();
    assert_eq!(
        deep.num_params(),
        784 * 512 + 512 + 512 * 256 + 256 + 256 * 10 + 10
    );
    let cnn = Cnn::small();
    assert_eq!(
        (cnn.input_len(), cnn.classes(), cnn.channels()),
        (784, 10, (8, 16))
    );
    assert_eq!(
        cnn.num_params(),
        25 * 8 + 8 + 25 * 8 * 16 + 16 + 7 * 7 * 16 * 10 + 10
    );
}

#[test]
fn init_is_deterministic_with_zero_biases() {
    let sizes = [50, 30, 10];
    let mlp = Mlp::new(&sizes).unwrap();
    let a = mlp.init_vec(42);
    assert_eq!(a, mlp.init_vec(42));
    assert_ne!(a, mlp.init_vec(43));
    for (name, range) in mlp_groups(&sizes) {
        let t = &a[range];
        if name.starts_with('b') {
            assert!(t.iter().all(|&v| v == 0.0), "{name} not zero");
        } else {
            assert!(t.iter().any(|&v| v != 0.0));
            // He-uniform for the hidden layer, Xavier-uniform for the output layer.
            let bound = if name == "W1" {
                6.0f32 / 50.0
            } else {
                6.0 / 40.0
            }
            .sqrt();
            let max = t.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(
                max <= bound && max > 0.8 * bound,
                "{name}: max {max}, bound {bound}"
            );
        }
    }
    let cnn = Cnn::small();
    let p = cnn.init_vec(1);
    for (name, range) in cnn_groups(28, 28, 8, 16, 10) {
        let zero = p[range].iter().all(|&v| v == 0.0);
        assert_eq!(zero, name.starts_with('b'), "{name}");
    }
    let mut short = vec![0.0; 3];
    assert!(matches!(
        cnn.init(&mut short, 1),
        Err(Error::WrongLength { what: "params", .. })
    ));
}

#[test]
fn bad_shapes_are_errors_and_leave_grad_untouched() {
    let models: [Box<dyn Model>; 2] = [
        Box::new(Mlp::new(&[6, 4, 3]).unwrap()),
        Box::new(Cnn::with_input(4, 8, 2, 2, 3).unwrap()),
    ];
    for model in &models {
        let m = model.as_ref();
        let p = m.init_vec(0);
        let (x, y) = random_batch(m, 3, 0);
        let mut s = Scratch::new();
        let mut g = vec![1.5; m.num_params()];
        let wrong = |r: Result<(f32, usize), Error>, what: &str| match r {
            Err(Error::WrongLength { what: w, .. }) => assert_eq!(w, what),
            other => panic!("{}: expected WrongLength({what}), got {other:?}", m.name()),
        };
        wrong(m.grad(&p[1..], &x, &y, &mut g, &mut s), "params");
        wrong(m.grad(&p, &x[1..], &y, &mut g, &mut s), "x");
        wrong(m.grad(&p, &x, &y[1..], &mut g, &mut s), "x");
        wrong(m.grad(&p, &x, &y, &mut g[1..], &mut s), "grad");
        wrong(m.evaluate(&p, &x[..5], &y, &mut s), "x");
        let mut bad_y = y.clone();
        bad_y[1] = m.classes() as u8;
        assert!(matches!(
            m.grad(&p, &x, &bad_y, &mut g, &mut s),
            Err(Error::Config(_))
        ));
        assert!(matches!(
            m.evaluate(&p, &x, &bad_y, &mut s),
            Err(Error::Config(_))
        ));
        assert!(
            g.iter().all(|&v| v == 1.5),
            "{}: grad written on error",
            m.name()
        );
        // Empty batches are fine and change nothing.
        assert_eq!(m.grad(&p, &[], &[], &mut g, &mut s).unwrap(), (0.0, 0));
        assert!(g.iter().all(|&v| v == 1.5));
        // Non-finite parameters give a non-finite loss, not a panic.
        let nan = vec![f32::NAN; m.num_params()];
        let (l, _) = m.grad(&nan, &x, &y, &mut g, &mut s).unwrap();
        assert!(l.is_nan());
    }
}

#[test]
fn bad_configurations_are_errors() {
    for sizes in [&[][..], &[10], &[10, 0, 3], &[0, 3]] {
        assert!(
            matches!(Mlp::new(sizes), Err(Error::Config(_))),
            "{sizes:?}"
        );
    }
    assert!(matches!(
        Mlp::new(&[usize::MAX, 2, 2]),
        Err(Error::Config(_))
    ));
    assert!(matches!(Cnn::new(0, 4), Err(Error::Config(_))));
    assert!(matches!(
        Cnn::with_input(30, 28, 8, 16, 10),
        Err(Error::Config(_))
    ));
    assert!(matches!(
        Cnn::with_input(28, 28, 8, 16, 0),
        Err(Error::Config(_))
    ));
    assert!(matches!(
        Cnn::with_input(1 << 40, 1 << 40, 8, 16, 10),
        Err(Error::Config(_))
    ));
}

/// Named tensors of a residual MLP, per the documented layout.
fn resmlp_groups(d: usize, w: usize, blocks: usize, k: usize) -> Vec<(String, Range<usize>)> {
    let mut lens = vec![("W0".to_string(), d * w), ("b0".to_string(), w)];
    for j in 1..=blocks {
        lens.push((format!("W{j}"), w * w));
        lens.push((format!("b{j}"), w));
    }
    lens.push(("Wo".into(), w * k));
    lens.push(("bo".into(), k));
    let mut o = 0;
    lens.into_iter()
        .map(|(name, len)| {
            o += len;
            (name, o - len..o)
        })
        .collect()
}

#[test]
fn resmlp_matches_finite_differences() {
    let model = ResMlp::new(12, 8, 3, 5).unwrap();
    assert_eq!(model.num_params(), 12 * 8 + 8 + 3 * (8 * 8 + 8) + 8 * 5 + 5);
    grad_check(&model, &as_refs(&resmlp_groups(12, 8, 3, 5)), 20, 4);
}

/// With no block, a residual MLP is an MLP of one hidden layer: the same layout, the same
/// initial values, the same losses and gradients bit for bit.
#[test]
fn resmlp_without_blocks_is_an_mlp() {
    let (r, m) = (
        ResMlp::new(20, 16, 0, 7).unwrap(),
        Mlp::new(&[20, 16, 7]).unwrap(),
    );
    assert_eq!(r.num_params(), m.num_params());
    let p = m.init_vec(3);
    assert_eq!(r.init_vec(3), p);
    let (x, y) = random_batch(&m, 9, 4);
    let (mut gr, mut gm) = (vec![0.0; p.len()], vec![0.0; p.len()]);
    let lr = r.grad(&p, &x, &y, &mut gr, &mut Scratch::new()).unwrap();
    let lm = m.grad(&p, &x, &y, &mut gm, &mut Scratch::new()).unwrap();
    assert_eq!(lr.0.to_bits(), lm.0.to_bits());
    assert_eq!(lr.1, lm.1);
    assert_eq!(gr, gm);
}

#[test]
fn specs_parse_print_and_build() {
    let res: ModelSpec = "resmlp:784-64x4-10".parse().unwrap();
    assert_eq!(
        res,
        ModelSpec::ResMlp {
            input: 784,
            width: 64,
            blocks: 4,
            classes: 10
        }
    );
    assert_eq!(res.to_string(), "resmlp:784-64x4-10");
    assert_eq!(res.build().unwrap().num_params(), 67_530);
    for bad in [
        "resmlp:784-64-10",
        "resmlp:784-64x-10",
        "resmlp:0-64x4-10",
        "resmlp",
    ] {
        let e = bad.parse::<ModelSpec>().and_then(|m| m.build().map(|_| ()));
        assert!(e.is_err(), "{bad}");
    }
    let mlp: ModelSpec = "mlp:784-512-256-10".parse().unwrap();
    assert_eq!(
        mlp,
        ModelSpec::Mlp {
            sizes: vec![784, 512, 256, 10]
        }
    );
    assert_eq!(mlp.to_string(), "mlp:784-512-256-10");
    assert_eq!(
        mlp.build().unwrap().num_params(),
        Mlp::new(&[784, 512, 256, 10]).unwrap().num_params()
    );
    let cnn: ModelSpec = "cnn".parse().unwrap();
    assert_eq!(cnn, ModelSpec::Cnn { c1: 8, c2: 16 });
    assert_eq!(
        "cnn:4-8".parse::<ModelSpec>().unwrap().to_string(),
        "cnn:4-8"
    );
    assert_eq!(cnn.build().unwrap().num_params(), Cnn::small().num_params());
    for bad in ["mlp", "mlp:784", "mlp:784-x-10", "cnn:8", "rnn:3-4"] {
        assert!(
            matches!(bad.parse::<ModelSpec>(), Err(Error::Config(_))),
            "{bad}"
        );
    }
    assert!(matches!(
        "mlp:784-0-10".parse::<ModelSpec>().unwrap().build(),
        Err(Error::Config(_))
    ));
    let json = serde_json::to_string(&mlp).unwrap();
    assert_eq!(serde_json::from_str::<ModelSpec>(&json).unwrap(), mlp);
}

// ---------------------------------------------------------------------------------------
// Training sanity

/// A 10-class problem in `dim` dimensions: centroids uniform in [-1, 1)^dim, plus uniform
/// noise in [-noise, noise) per coordinate.
struct Synthetic {
    centroids: Vec<f32>,
    dim: usize,
}

impl Synthetic {
    const CLASSES: usize = 10;

    fn new(dim: usize, seed: u64) -> Self {
        let mut rng = fastrand::Rng::with_seed(seed);
        let centroids = (0..Self::CLASSES * dim)
            .map(|_| rng.f32() * 2.0 - 1.0)
            .collect();
        Self { centroids, dim }
    }

    fn batch(&self, rng: &mut fastrand::Rng, n: usize, noise: f32) -> (Vec<f32>, Vec<u8>) {
        let mut x = Vec::with_capacity(n * self.dim);
        let mut y = Vec::with_capacity(n);
        for _ in 0..n {
            let c = rng.usize(..Self::CLASSES);
            y.push(c as u8);
            let centroid = &self.centroids[c * self.dim..(c + 1) * self.dim];
            x.extend(
                centroid
                    .iter()
                    .map(|&m| m + noise * (rng.f32() * 2.0 - 1.0)),
            );
        }
        (x, y)
    }
}

/// Plain SGD on the mean loss; returns held-out accuracy.
fn train(model: &dyn Model, steps: usize, batch: usize, lr: f32, noise: f32) -> f32 {
    let data = Synthetic::new(model.input_len(), 99);
    let mut rng = fastrand::Rng::with_seed(100);
    let mut p = model.init_vec(1);
    let mut g = vec![0.0; model.num_params()];
    let mut s = model.scratch(batch);
    for _ in 0..steps {
        let (x, y) = data.batch(&mut rng, batch, noise);
        g.fill(0.0);
        model.grad(&p, &x, &y, &mut g, &mut s).unwrap();
        let scale = lr / batch as f32;
        for (w, d) in p.iter_mut().zip(&g) {
            *w -= scale * d;
        }
    }
    let (x, y) = data.batch(&mut rng, 200, noise);
    let (loss, correct) = model.evaluate(&p, &x, &y, &mut Scratch::new()).unwrap();
    let acc = correct as f32 / 200.0;
    eprintln!(
        "{}: {steps} steps of {batch}: held-out accuracy {acc:.3}, mean loss {:.3}",
        model.name(),
        loss / 200.0
    );
    acc
}

#[test]
fn mlp_learns_a_separable_problem() {
    let acc = train(&Mlp::new(&[784, 32, 10]).unwrap(), 150, 32, 0.05, 1.5);
    assert!(acc > 0.9, "accuracy {acc}");
}

#[test]
fn cnn_learns_a_separable_problem() {
    // 16×16 images keep this test fast in debug builds (28×28 works the same, 3× slower).
    let acc = train(
        &Cnn::with_input(16, 16, 4, 8, 10).unwrap(),
        50,
        16,
        0.2,
        0.7,
    );
    assert!(acc > 0.9, "accuracy {acc}");
}

// ---------------------------------------------------------------------------------------
// Timings (run explicitly, in release)

fn time_steps(model: &dyn Model, batch: usize, steps: usize) -> (f64, f64) {
    let data = Synthetic::new(model.input_len(), 1);
    let mut rng = fastrand::Rng::with_seed(2);
    let (x, y) = data.batch(&mut rng, batch, 1.0);
    let mut p = model.init_vec(3);
    let mut g = vec![0.0; model.num_params()];
    let mut s = model.scratch(batch);
    let mut step = |p: &mut Vec<f32>, g: &mut Vec<f32>| {
        g.fill(0.0);
        model.grad(p, &x, &y, g, &mut s).unwrap();
        for (w, d) in p.iter_mut().zip(g.iter()) {
            *w -= 0.01 / batch as f32 * d;
        }
    };
    for _ in 0..steps / 10 + 3 {
        step(&mut p, &mut g);
    }
    let mut samples = Vec::with_capacity(steps);
    for _ in 0..steps {
        let t = Instant::now();
        step(&mut p, &mut g);
        samples.push(t.elapsed().as_secs_f64() * 1e3);
    }
    samples.sort_by(f64::total_cmp);
    let mean = samples.iter().sum::<f64>() / steps as f64;
    (mean, samples[steps / 2])
}

#[test]
#[ignore = "timing; run in release with --ignored --nocapture"]
fn step_timings() {
    let models: [(Box<dyn Model>, usize); 4] = [
        (Box::new(Mlp::new(&[784, 256, 10]).unwrap()), 500),
        (Box::new(Mlp::new(&[784, 512, 256, 10]).unwrap()), 200),
        (Box::new(Cnn::small()), 100),
        (Box::new(Cnn::new(16, 32).unwrap()), 30),
    ];
    for (model, steps) in &models {
        let (mean, median) = time_steps(model.as_ref(), 64, *steps);
        eprintln!(
            "{:40} batch 64: {mean:.3} ms/step mean, {median:.3} ms median ({steps} steps, grad + SGD update)",
            model.name()
        );
    }
}
