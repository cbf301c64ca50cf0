//! Dependency-light PNG or SVG charts for experiment reports.
//!
//! Charts are drawn into an RGB8 buffer (900×560, white background) with a 5×7 bitmap font
//! embedded below, and encoded with the `png` crate. The same drawing is recorded as SVG
//! elements (text as `<text>` in a monospace font sized to the bitmap font's advance), written
//! instead when the output path ends in `.svg`. Nothing is read from the system: no fonts, no
//! plotting library.
//!
//! Robustness rules shared by both charts:
//! * points or values that are NaN, infinite or beyond ±1e300 are skipped;
//! * an empty input draws the title and "no data";
//! * a line series of more than 10 000 points is reduced to the minimum and maximum of each of
//!   2 000 consecutive buckets, which keeps its spikes;
//! * markers are drawn at every point of a series of at most 200 points (beyond that they would
//!   merge into the line anyway).

use std::fmt::{self, Write as _};
use std::io;
use std::path::Path;

/// Image size, in pixels.
const W: i64 = 900;
const H: i64 = 560;

/// An RGB colour.
type Rgb = [u8; 3];

const WHITE: Rgb = [255, 255, 255];
const TEXT: Rgb = [25, 25, 25];
const AXIS: Rgb = [70, 70, 70];
const GRID: Rgb = [228, 228, 228];
const LEGEND_BORDER: Rgb = [190, 190, 190];
const MUTED: Rgb = [130, 130, 130];

/// Series colours (the Tableau 10 palette), reused cyclically beyond ten series.
const PALETTE: [Rgb; 10] = [
    [31, 119, 180],
    [255, 127, 14],
    [44, 160, 44],
    [214, 39, 40],
    [148, 103, 189],
    [140, 86, 75],
    [227, 119, 194],
    [127, 127, 127],
    [188, 189, 34],
    [23, 190, 207],
];

/// Points beyond this magnitude are treated like infinities.
const LIMIT: f64 = 1e300;
/// A series longer than this is downsampled.
const MAX_POINTS: usize = 10_000;
/// Buckets used when downsampling (two points kept per bucket).
const BUCKETS: usize = 2_000;
/// Markers are drawn only on series up to this long.
const MARKER_MAX: usize = 200;
/// Longest series or bar name drawn; longer ones are cut with "..".
const NAME_CHARS: usize = 28;

/// Colour of series or bar `i`.
fn colour(i: usize) -> Rgb {
    PALETTE[i % PALETTE.len()]
}

/// Writes a line chart: one polyline per series, distinct colours, axes with ticks and numeric
/// tick labels, a title, and a legend with the series names. The file is SVG when `path` has the
/// extension `svg` (in any case), PNG otherwise.
///
/// Each series is `(name, points)` with points as `(x, y)`, drawn in the given order. Non-finite
/// points are skipped; an empty `series` writes a chart with the title and "no data".
///
/// The y axis starts at 0 when every y is non-negative; the x axis spans the data with a small
/// margin. Ticks fall on 1, 2 or 5 × 10^k.
pub fn line_chart(
    path: &Path,
    title: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> io::Result<()> {
    write(path, &render_line_chart(title, series))
}

/// Writes a chart of horizontal bars, one per `(name, value)` in the given order, each labelled
/// with its name on the left and its value at its end. The file is SVG when `path` has the
/// extension `svg` (in any case), PNG otherwise.
///
/// The value axis always includes 0; negative values extend left of it. A non-finite value is
/// drawn as "n/a" without a bar; an empty `bars` writes a chart with the title and "no data".
pub fn bar_chart(path: &Path, title: &str, bars: &[(String, f64)]) -> io::Result<()> {
    write(path, &render_bar_chart(title, bars))
}

/// Writes `chart` to `path`: as SVG when its extension is `svg` (in any case), PNG otherwise.
fn write(path: &Path, chart: &Canvas) -> io::Result<()> {
    if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("svg"))
    {
        std::fs::write(path, chart.svg())
    } else {
        std::fs::write(path, chart.encode()?)
    }
}

// ---------------------------------------------------------------------------------------------
// Line chart
// ---------------------------------------------------------------------------------------------

/// A series with only drawable points left.
struct Clean {
    name: String,
    pts: Vec<(f64, f64)>,
}

fn drawable(v: f64) -> bool {
    v.is_finite() && v.abs() <= LIMIT
}

fn clean(series: &[(String, Vec<(f64, f64)>)]) -> Vec<Clean> {
    series
        .iter()
        .map(|(name, pts)| {
            let pts: Vec<_> = pts
                .iter()
                .copied()
                .filter(|&(x, y)| drawable(x) && drawable(y))
                .collect();
            Clean {
                name: name.clone(),
                pts: downsample(pts),
            }
        })
        .collect()
}

/// Keeps the lowest and highest point (in their original order) of each of [`BUCKETS`] runs of
/// consecutive points, when there are more than [`MAX_POINTS`].
fn downsample(pts: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    if pts.len() <= MAX_POINTS {
        return pts;
    }
    let chunk = pts.len().div_ceil(BUCKETS);
    let mut out = Vec::with_capacity(2 * BUCKETS);
    for run in pts.chunks(chunk) {
        let (mut lo, mut hi) = (0, 0);
        for (i, p) in run.iter().enumerate() {
            if p.1 < run[lo].1 {
                lo = i;
            }
            if p.1 > run[hi].1 {
                hi = i;
            }
        }
        out.push(run[lo.min(hi)]);
        if lo != hi {
            out.push(run[lo.max(hi)]);
        }
    }
    out
}

/// Where everything of a line chart goes.
struct LineLayout {
    left: i64,
    top: i64,
    right: i64,
    bottom: i64,
    x: Axis,
    y: Axis,
    legend_x0: i64,
    has_data: bool,
}

impl LineLayout {
    fn new(series: &[Clean]) -> Self {
        let (mut xl, mut xh, mut yl, mut yh) = (
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::INFINITY,
            f64::NEG_INFINITY,
        );
        for &(x, y) in series.iter().flat_map(|s| s.pts.iter()) {
            xl = xl.min(x);
            xh = xh.max(x);
            yl = yl.min(y);
            yh = yh.max(y);
        }
        let has_data = xl <= xh;
        let (x, y) = if has_data {
            (x_axis(xl, xh), y_axis(yl, yh))
        } else {
            (nice_axis(0.0, 1.0, true), nice_axis(0.0, 1.0, true))
        };
        let name_chars = series
            .iter()
            .map(|s| s.name.chars().count().min(NAME_CHARS))
            .max()
            .unwrap_or(0) as i64;
        // Padding, swatch, gap, names, padding.
        let legend_w = 10 + 22 + 6 + text_width_chars(name_chars, 1) + 10;
        let legend_x0 = W - 12 - legend_w;
        let label_w = y
            .ticks
            .iter()
            .map(|&t| text_width(&y.label(t), 1))
            .max()
            .unwrap_or(0);
        LineLayout {
            left: 16 + label_w + 10,
            top: 48,
            right: legend_x0 - 20,
            bottom: H - 40,
            x,
            y,
            legend_x0,
            has_data,
        }
    }

    fn px(&self, x: f64) -> f64 {
        self.left as f64 + self.x.frac(x) * (self.right - self.left) as f64
    }

    fn py(&self, y: f64) -> f64 {
        self.bottom as f64 - self.y.frac(y) * (self.bottom - self.top) as f64
    }
}

fn render_line_chart(title: &str, series: &[(String, Vec<(f64, f64)>)]) -> Canvas {
    let mut c = Canvas::new(W, H);
    c.title(title);
    if series.is_empty() {
        c.centred_text(W / 2, H / 2, "no data", 2, MUTED);
        return c;
    }
    let series = clean(series);
    let l = LineLayout::new(&series);

    // Grid.
    let xs: Vec<i64> = l.x.ticks.iter().map(|&t| l.px(t).round() as i64).collect();
    let ys: Vec<i64> = l.y.ticks.iter().map(|&t| l.py(t).round() as i64).collect();
    for &x in &xs {
        c.vline(x, l.top, l.bottom, GRID);
    }
    for &y in &ys {
        c.hline(l.left, l.right, y, GRID);
    }

    // Data.
    for (i, s) in series.iter().enumerate() {
        let pts: Vec<(f64, f64)> = s.pts.iter().map(|&(x, y)| (l.px(x), l.py(y))).collect();
        c.polyline(&pts, 2.0, colour(i));
        if pts.len() <= MARKER_MAX {
            for &p in &pts {
                c.marker(p, i, colour(i));
            }
        }
    }
    if !l.has_data {
        c.centred_text(
            (l.left + l.right) / 2,
            (l.top + l.bottom) / 2,
            "no data",
            2,
            MUTED,
        );
    }

    // Axes, ticks and labels.
    c.frame(l.left, l.top, l.right, l.bottom, AXIS);
    let labels: Vec<String> = l.x.ticks.iter().map(|&t| l.x.label(t)).collect();
    let stride = label_stride(&labels, &xs);
    for (k, (&x, label)) in xs.iter().zip(&labels).enumerate() {
        c.vline(x, l.bottom, l.bottom + 4, AXIS);
        if k % stride == 0 {
            c.centred_text(x, l.bottom + 12, label, 1, TEXT);
        }
    }
    for (&y, &t) in ys.iter().zip(&l.y.ticks) {
        c.hline(l.left - 4, l.left, y, AXIS);
        let label = l.y.label(t);
        c.text(l.left - 8 - text_width(&label, 1), y - 3, &label, 1, TEXT);
    }

    // Legend.
    let row = 14;
    let fit = ((l.bottom - l.top - 12) / row).max(1) as usize;
    let shown = if series.len() > fit {
        fit - 1
    } else {
        series.len()
    };
    let rows = if series.len() > fit {
        fit
    } else {
        series.len()
    };
    let (x0, x1) = (l.legend_x0, W - 12);
    c.frame(x0, l.top, x1, l.top + 8 + rows as i64 * row, LEGEND_BORDER);
    for (i, s) in series.iter().take(shown).enumerate() {
        let y = l.top + 8 + i as i64 * row;
        let mid = (y + 3) as f64;
        c.polyline(
            &[((x0 + 10) as f64, mid), ((x0 + 32) as f64, mid)],
            2.0,
            colour(i),
        );
        c.marker(((x0 + 21) as f64, mid), i, colour(i));
        c.text(x0 + 38, y, &shorten(&s.name, NAME_CHARS), 1, TEXT);
    }
    if shown < series.len() {
        let y = l.top + 8 + shown as i64 * row;
        c.text(
            x0 + 38,
            y,
            &format!("+{} more", series.len() - shown),
            1,
            MUTED,
        );
    }
    c
}

/// Draw every `stride`-th x label so that neighbours do not overlap.
fn label_stride(labels: &[String], xs: &[i64]) -> usize {
    let widest = labels.iter().map(|s| text_width(s, 1)).max().unwrap_or(0) + 10;
    let gap = xs
        .windows(2)
        .map(|w| (w[1] - w[0]).abs())
        .min()
        .unwrap_or(i64::MAX)
        .max(1);
    (widest as u64).div_ceil(gap as u64).max(1) as usize
}

// ---------------------------------------------------------------------------------------------
// Bar chart
// ---------------------------------------------------------------------------------------------

/// Where everything of a bar chart goes.
struct BarLayout {
    left: i64,
    top: i64,
    right: i64,
    bottom: i64,
    axis: Axis,
    names: Vec<String>,
    values: Vec<String>,
}

impl BarLayout {
    fn new(bars: &[(String, f64)]) -> Self {
        let finite = || bars.iter().map(|b| b.1).filter(|&v| drawable(v));
        let lo = finite().fold(0.0, f64::min);
        let hi = finite().fold(0.0, f64::max);
        let (lo, hi) = if hi > lo { (lo, hi) } else { (0.0, 1.0) };
        let axis = nice_axis(lo, hi, true);
        let names: Vec<String> = bars.iter().map(|b| shorten(&b.0, NAME_CHARS)).collect();
        let values: Vec<String> = bars.iter().map(|b| format_value(b.1)).collect();
        let name_w = names.iter().map(|s| text_width(s, 1)).max().unwrap_or(0);
        let value_w = values.iter().map(|s| text_width(s, 1)).max().unwrap_or(0);
        let negative = finite().any(|v| v < 0.0);
        BarLayout {
            left: 16 + name_w + 12 + if negative { value_w + 8 } else { 0 },
            top: 48,
            right: W - 16 - value_w - 8,
            bottom: H - 40,
            axis,
            names,
            values,
        }
    }

    fn px(&self, v: f64) -> f64 {
        self.left as f64 + self.axis.frac(v) * (self.right - self.left) as f64
    }

    /// Vertical centre and height of bar `i` of `n`.
    fn row(&self, i: usize, n: usize) -> (f64, f64) {
        let row_h = (self.bottom - self.top) as f64 / n as f64;
        (
            self.top as f64 + (i as f64 + 0.5) * row_h,
            (row_h * 0.7).clamp(1.0, 40.0),
        )
    }
}

fn render_bar_chart(title: &str, bars: &[(String, f64)]) -> Canvas {
    let mut c = Canvas::new(W, H);
    c.title(title);
    if bars.is_empty() {
        c.centred_text(W / 2, H / 2, "no data", 2, MUTED);
        return c;
    }
    let l = BarLayout::new(bars);
    let xs: Vec<i64> = l
        .axis
        .ticks
        .iter()
        .map(|&t| l.px(t).round() as i64)
        .collect();
    for &x in &xs {
        c.vline(x, l.top, l.bottom, GRID);
    }
    let zero = l.px(0.0);
    let n = bars.len();
    // Names are skipped on rows too thin to hold them apart.
    let name_stride = (10.0 / ((l.bottom - l.top) as f64 / n as f64))
        .ceil()
        .max(1.0) as usize;
    for (i, (_, v)) in bars.iter().enumerate() {
        let (cy, bar_h) = l.row(i, n);
        let (y0, y1) = (
            (cy - bar_h / 2.0).round() as i64,
            (cy + bar_h / 2.0).round() as i64,
        );
        let ty = cy.round() as i64 - 3;
        let label = &l.values[i];
        if drawable(*v) {
            let end = l.px(*v);
            let (a, b) = (zero.min(end).round() as i64, zero.max(end).round() as i64);
            c.rect(a, y0, b.max(a + 1), y1.max(y0 + 1), colour(i));
            if n <= 60 || i % name_stride == 0 {
                if *v < 0.0 {
                    c.text(a - 6 - text_width(label, 1), ty, label, 1, TEXT);
                } else {
                    c.text(b + 6, ty, label, 1, TEXT);
                }
            }
        } else if i % name_stride == 0 {
            c.text(zero.round() as i64 + 6, ty, label, 1, MUTED);
        }
        if i % name_stride == 0 {
            let name = &l.names[i];
            c.text(
                16 + l.names_width() - text_width(name, 1),
                ty,
                name,
                1,
                TEXT,
            );
        }
    }
    let z = zero.round() as i64;
    c.vline(z, l.top, l.bottom, AXIS);
    c.hline(l.left, l.right, l.bottom, AXIS);
    let labels: Vec<String> = l.axis.ticks.iter().map(|&t| l.axis.label(t)).collect();
    let stride = label_stride(&labels, &xs);
    for (k, (&x, label)) in xs.iter().zip(&labels).enumerate() {
        c.vline(x, l.bottom, l.bottom + 4, AXIS);
        if k % stride == 0 {
            c.centred_text(x, l.bottom + 12, label, 1, TEXT);
        }
    }
    c
}

impl BarLayout {
    fn names_width(&self) -> i64 {
        self.names
            .iter()
            .map(|s| text_width(s, 1))
            .max()
            .unwrap_or(0)
    }
}

// ---------------------------------------------------------------------------------------------
// Axes and number formatting
// ---------------------------------------------------------------------------------------------

/// A linear axis from `lo` to `hi` with ticks every `step`.
struct Axis {
    lo: f64,
    hi: f64,
    step: f64,
    ticks: Vec<f64>,
}

impl Axis {
    /// Where `v` falls, 0 at `lo` and 1 at `hi`.
    fn frac(&self, v: f64) -> f64 {
        (v - self.lo) / (self.hi - self.lo)
    }

    fn label(&self, v: f64) -> String {
        format_tick(v, self.step, self.lo.abs().max(self.hi.abs()))
    }
}

/// Turns an empty range into a small one around its value.
fn widen(lo: f64, hi: f64) -> (f64, f64) {
    if hi > lo {
        (lo, hi)
    } else {
        let d = if lo == 0.0 { 1.0 } else { lo.abs() * 0.1 };
        (lo - d, hi + d)
    }
}

/// The x axis: the data's extent plus 3 % each side, ticks inside.
fn x_axis(lo: f64, hi: f64) -> Axis {
    let (lo, hi) = widen(lo, hi);
    let pad = (hi - lo) * 0.03;
    nice_axis(lo - pad, hi + pad, false)
}

/// The y axis: from 0 when no value is negative, 5 % headroom, ticks inside. (Growing it to
/// whole ticks could waste a quarter of the height: 0..15.2 would become 0..20.)
fn y_axis(lo: f64, hi: f64) -> Axis {
    if lo >= 0.0 {
        let hi = if hi > 0.0 { hi } else { 1.0 };
        nice_axis(0.0, hi * 1.05, false)
    } else {
        let (lo, hi) = widen(lo, hi);
        let pad = (hi - lo) * 0.05;
        nice_axis(lo - pad, hi + pad, false)
    }
}

/// Ticks on 1, 2 or 5 × 10^k, 4 to 8 of them where possible. With `extend` the axis grows to
/// the outer ticks; otherwise it keeps `lo..hi` and only the ticks inside are kept.
fn nice_axis(lo: f64, hi: f64, extend: bool) -> Axis {
    let span = hi - lo;
    if !(span.is_finite() && span > 0.0) {
        let lo = if lo.is_finite() { lo } else { 0.0 };
        return Axis {
            lo,
            hi: lo + 1.0,
            step: 1.0,
            ticks: Vec::new(),
        };
    }
    let e = (span / 6.0).log10().floor() as i32;
    let mut best: Option<(f64, f64, f64, f64)> = None;
    for ee in e - 1..=e + 1 {
        for m in [1.0, 2.0, 5.0] {
            let step = m * 10f64.powi(ee);
            if !(step.is_finite() && step > 0.0) {
                continue;
            }
            let (a, b) = if extend {
                ((lo / step).floor(), (hi / step).ceil())
            } else {
                ((lo / step - 1e-9).ceil(), (hi / step + 1e-9).floor())
            };
            let count = b - a + 1.0;
            if !(count.is_finite() && (2.0..=50.0).contains(&count)) {
                continue;
            }
            let off = (count - 6.0).abs();
            let score = if (4.0..=8.0).contains(&count) {
                off
            } else {
                10.0 + off
            };
            if best.is_none_or(|b| score < b.0) {
                best = Some((score, step, a, b));
            }
        }
    }
    let Some((_, step, a, b)) = best else {
        return Axis {
            lo,
            hi,
            step: span,
            ticks: vec![lo, hi],
        };
    };
    let ticks = (0..=(b - a) as i64)
        .map(|k| {
            let t = (a + k as f64) * step;
            if t.abs() < step * 1e-6 { 0.0 } else { t }
        })
        .collect();
    if extend {
        Axis {
            lo: a * step,
            hi: b * step,
            step,
            ticks,
        }
    } else {
        Axis {
            lo,
            hi,
            step,
            ticks,
        }
    }
}

/// Scale and suffix for numbers of magnitude `m`: `k`, `M`, `G`, `T` from 10 000 on.
fn si(m: f64) -> (f64, &'static str) {
    match m {
        m if m >= 1e12 => (1e12, "T"),
        m if m >= 1e9 => (1e9, "G"),
        m if m >= 1e6 => (1e6, "M"),
        m if m >= 1e4 => (1e3, "k"),
        _ => (1.0, ""),
    }
}

/// Drops trailing zeros after a decimal point, and the point itself when nothing follows.
fn trim_zeros(s: String) -> String {
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// A tick label: as few decimals as `step` needs, `k`/`M`/`G`/`T` for large axes, exponent
/// notation for huge or tiny ones.
fn format_tick(v: f64, step: f64, max_abs: f64) -> String {
    if v == 0.0 {
        return "0".to_string();
    }
    if max_abs >= 1e15 || step < 1e-4 {
        let digits = (v.abs().log10().floor() - step.log10().floor()).clamp(0.0, 6.0) as usize;
        return format!("{v:.digits$e}");
    }
    let (scale, suffix) = si(max_abs);
    let decimals = (-(step / scale).log10() - 1e-9).ceil().clamp(0.0, 12.0) as usize;
    format!(
        "{}{suffix}",
        trim_zeros(format!("{:.decimals$}", v / scale))
    )
}

/// A value label: about three significant digits.
fn format_value(v: f64) -> String {
    if !drawable(v) {
        return "n/a".to_string();
    }
    if v == 0.0 {
        return "0".to_string();
    }
    let a = v.abs();
    if !(1e-3..1e15).contains(&a) {
        return format!("{v:.2e}");
    }
    let (scale, suffix) = si(a);
    let x = v / scale;
    let decimals = (2.0 - x.abs().log10().floor()).clamp(0.0, 4.0) as usize;
    format!("{}{suffix}", trim_zeros(format!("{x:.decimals$}")))
}

/// `s` cut to `max` characters, ending in ".." when cut.
fn shorten(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_string()
    } else {
        let mut out: String = s.chars().take(max.saturating_sub(2)).collect();
        out.push_str("..");
        out
    }
}

// ---------------------------------------------------------------------------------------------
// Raster
// ---------------------------------------------------------------------------------------------

/// An RGB8 image with the drawing primitives the charts need. Drawing outside is clipped.
///
/// Every primitive is also recorded, in drawing order, as an SVG element in `elements`.
struct Canvas {
    w: i64,
    h: i64,
    buf: Vec<u8>,
    elements: String,
}

impl Canvas {
    fn new(w: i64, h: i64) -> Self {
        Canvas {
            w,
            h,
            buf: WHITE.repeat((w * h) as usize),
            elements: String::new(),
        }
    }

    /// Appends one SVG element, on its own line.
    fn record(&mut self, element: fmt::Arguments) {
        // Writing to a `String` cannot fail.
        let _ = self.elements.write_fmt(element);
        self.elements.push('\n');
    }

    fn index(&self, x: i64, y: i64) -> Option<usize> {
        (0..self.w)
            .contains(&x)
            .then_some(())
            .filter(|_| (0..self.h).contains(&y))
            .map(|_| ((y * self.w + x) * 3) as usize)
    }

    fn put(&mut self, x: i64, y: i64, c: Rgb) {
        if let Some(i) = self.index(x, y) {
            self.buf[i..i + 3].copy_from_slice(&c);
        }
    }

    /// Mixes `c` into pixel `(x, y)` with opacity `a` (0..=1).
    fn blend(&mut self, x: i64, y: i64, c: Rgb, a: f64) {
        if a >= 1.0 {
            return self.put(x, y, c);
        }
        if let Some(i) = self.index(x, y) {
            for (old, new) in self.buf[i..i + 3].iter_mut().zip(c) {
                *old = (f64::from(*old) * (1.0 - a) + f64::from(new) * a).round() as u8;
            }
        }
    }

    /// Fills `[x0, x1) × [y0, y1)`, recorded as one `<rect>`.
    fn rect(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, c: Rgb) {
        let (x0, y0, x1, y1) = (x0.max(0), y0.max(0), x1.min(self.w), y1.min(self.h));
        if x0 < x1 && y0 < y1 {
            self.record(format_args!(
                r#"<rect x="{x0}" y="{y0}" width="{}" height="{}" fill="{}"/>"#,
                x1 - x0,
                y1 - y0,
                Hex(c)
            ));
            self.fill(x0, y0, x1, y1, c);
        }
    }

    /// Fills `[x0, x1) × [y0, y1)` of the raster only.
    fn fill(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, c: Rgb) {
        for y in y0.max(0)..y1.min(self.h) {
            for x in x0.max(0)..x1.min(self.w) {
                self.put(x, y, c);
            }
        }
    }

    /// The pixels `x0..=x1` of row `y`.
    fn hline(&mut self, x0: i64, x1: i64, y: i64, c: Rgb) {
        self.rect(x0.min(x1), y, x0.max(x1) + 1, y + 1, c);
    }

    /// The pixels `y0..=y1` of column `x`.
    fn vline(&mut self, x: i64, y0: i64, y1: i64, c: Rgb) {
        self.rect(x, y0.min(y1), x + 1, y0.max(y1) + 1, c);
    }

    /// The outline of the rectangle with corners `(x0, y0)` and `(x1, y1)`.
    fn frame(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, c: Rgb) {
        self.hline(x0, x1, y0, c);
        self.hline(x0, x1, y1, c);
        self.vline(x0, y0, y1, c);
        self.vline(x1, y0, y1, c);
    }

    /// Lines reaching coordinates beyond ± this are not drawn.
    fn bound(&self) -> f64 {
        (self.w.max(self.h) * 4) as f64
    }

    /// Segments `width` pixels wide with round ends and joins through `pts` in order, recorded
    /// as one `<polyline>` per run of points not absurdly far outside (a segment reaching such a
    /// point is skipped).
    fn polyline(&mut self, pts: &[(f64, f64)], width: f64, c: Rgb) {
        let bound = self.bound();
        for run in pts.split(|p| ![p.0, p.1].iter().all(|v| v.abs() <= bound)) {
            if run.len() < 2 {
                continue;
            }
            let points: Vec<String> = run
                .iter()
                .map(|&(x, y)| format!("{},{}", Num(x), Num(y)))
                .collect();
            self.record(format_args!(
                concat!(
                    r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="{}" "#,
                    r#"stroke-linecap="round" stroke-linejoin="round"/>"#
                ),
                points.join(" "),
                Hex(c),
                Num(width)
            ));
            for w in run.windows(2) {
                self.segment(w[0], w[1], width, c);
            }
        }
    }

    /// An anti-aliased segment `width` pixels wide with round ends, on the raster only: each
    /// pixel near the line is covered by how far its centre lies inside the stroke.
    fn segment(&mut self, a: (f64, f64), b: (f64, f64), width: f64, c: Rgb) {
        let bound = self.bound();
        let half = width / 2.0;
        let (dx, dy) = (b.0 - a.0, b.1 - a.1);
        let len2 = dx * dx + dy * dy;
        let dist = |px: f64, py: f64| {
            let t = if len2 > 0.0 {
                (((px - a.0) * dx + (py - a.1) * dy) / len2).clamp(0.0, 1.0)
            } else {
                0.0
            };
            (px - (a.0 + t * dx)).hypot(py - (a.1 + t * dy))
        };
        let reach = half + 1.0;
        // Walk the major axis; cover a few pixels either side of the line on the minor one.
        let steep = dy.abs() > dx.abs();
        let (ma, mb, na, d_major, d_minor) = if steep {
            (a.1, b.1, a.0, dy, dx)
        } else {
            (a.0, b.0, a.1, dx, dy)
        };
        let m0 = (ma.min(mb) - reach).floor().max(-2.0) as i64;
        let m1 = (ma.max(mb) + reach).ceil().min(bound) as i64;
        for m in m0..=m1 {
            let t = if d_major != 0.0 {
                ((m as f64 - ma) / d_major).clamp(0.0, 1.0)
            } else {
                0.0
            };
            let centre = na + t * d_minor;
            for n in (centre - reach - 1.0).floor() as i64..=(centre + reach + 1.0).ceil() as i64 {
                let (x, y) = if steep { (n, m) } else { (m, n) };
                let cover = (half + 0.5 - dist(x as f64, y as f64)).clamp(0.0, 1.0);
                if cover > 0.0 {
                    self.blend(x, y, c, cover);
                }
            }
        }
    }

    /// An anti-aliased filled disc.
    fn disc(&mut self, (cx, cy): (f64, f64), r: f64, c: Rgb) {
        if !(cx.is_finite() && cy.is_finite()) {
            return;
        }
        self.record(format_args!(
            r#"<circle cx="{}" cy="{}" r="{}" fill="{}"/>"#,
            Num(cx),
            Num(cy),
            Num(r),
            Hex(c)
        ));
        for y in (cy - r - 1.0).floor() as i64..=(cy + r + 1.0).ceil() as i64 {
            for x in (cx - r - 1.0).floor() as i64..=(cx + r + 1.0).ceil() as i64 {
                let cover = (r + 0.5 - (x as f64 - cx).hypot(y as f64 - cy)).clamp(0.0, 1.0);
                if cover > 0.0 {
                    self.blend(x, y, c, cover);
                }
            }
        }
    }

    /// The marker of series `i`: a disc for the first ten series, a square for the next ten…
    fn marker(&mut self, p: (f64, f64), i: usize, c: Rgb) {
        if (i / PALETTE.len()).is_multiple_of(2) {
            self.disc(p, 3.0, c);
        } else if p.0.is_finite() && p.1.is_finite() {
            let (x, y) = (p.0.round() as i64, p.1.round() as i64);
            self.rect(x - 3, y - 3, x + 4, y + 4, c);
        }
    }

    /// Draws `s` with its top-left corner at `(x, y)`, each font pixel `scale` pixels wide.
    ///
    /// In SVG it is one `<text>` whose monospace font (10 × `scale` px) advances about as far as
    /// the bitmap font's; `textLength` makes that exact.
    fn text(&mut self, x: i64, y: i64, s: &str, scale: i64, c: Rgb) {
        if !s.is_empty() {
            self.record(format_args!(
                r#"<text x="{x}" y="{}" font-size="{}" textLength="{}" fill="{}">{}</text>"#,
                y + 7 * scale,
                10 * scale,
                s.chars().count() as i64 * ADVANCE * scale,
                Hex(c),
                Escaped(s)
            ));
        }
        for (k, ch) in s.chars().enumerate() {
            let ox = x + k as i64 * ADVANCE * scale;
            if ox > self.w {
                break;
            }
            for (row, bits) in glyph(ch).iter().enumerate() {
                for col in 0..5 {
                    if bits >> (4 - col) & 1 == 1 {
                        let (px, py) = (ox + col * scale, y + row as i64 * scale);
                        self.fill(px, py, px + scale, py + scale, c);
                    }
                }
            }
        }
    }

    /// Draws `s` centred on `x` horizontally, its top at `y`.
    fn centred_text(&mut self, x: i64, y: i64, s: &str, scale: i64, c: Rgb) {
        self.text(x - text_width(s, scale) / 2, y, s, scale, c);
    }

    /// The chart's title, centred at the top at twice the font size.
    fn title(&mut self, title: &str) {
        let max = ((self.w - 24) / (ADVANCE * 2)) as usize;
        self.centred_text(self.w / 2, 14, &shorten(title, max), 2, TEXT);
    }

    /// The drawing as a standalone SVG document.
    fn svg(&self) -> String {
        format!(
            concat!(
                r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" "#,
                r#"viewBox="0 0 {w} {h}" font-family="monospace" xml:space="preserve">"#,
                "\n",
                r#"<rect width="{w}" height="{h}" fill="{bg}"/>"#,
                "\n{body}</svg>\n"
            ),
            w = self.w,
            h = self.h,
            bg = Hex(WHITE),
            body = self.elements
        )
    }

    /// The image as PNG bytes.
    fn encode(&self) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        let mut encoder = png::Encoder::new(&mut out, self.w as u32, self.h as u32);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder.write_header()?;
        writer.write_image_data(&self.buf)?;
        writer.finish()?;
        Ok(out)
    }
}

/// Formats a colour as `#rrggbb`.
struct Hex(Rgb);

impl fmt::Display for Hex {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let [r, g, b] = self.0;
        write!(f, "#{r:02x}{g:02x}{b:02x}")
    }
}

/// Formats a coordinate with at most two decimals, without trailing zeros.
struct Num(f64);

impl fmt::Display for Num {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let s = trim_zeros(format!("{:.2}", self.0));
        f.write_str(if s == "-0" { "0" } else { &s })
    }
}

/// Formats text as XML character data: markup characters escaped, and characters XML cannot
/// hold (control characters) replaced by U+FFFD, as the bitmap font draws them as a box.
struct Escaped<'a>(&'a str);

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        for ch in self.0.chars() {
            match ch {
                '&' => f.write_str("&amp;")?,
                '<' => f.write_str("&lt;")?,
                '>' => f.write_str("&gt;")?,
                '"' => f.write_str("&quot;")?,
                '\'' => f.write_str("&apos;")?,
                c if c.is_control() || matches!(c, '\u{FFFE}' | '\u{FFFF}') => {
                    f.write_char('\u{FFFD}')?
                }
                c => f.write_char(c)?,
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Font
// ---------------------------------------------------------------------------------------------

/// Horizontal distance between characters at scale 1: five columns and one of space.
const ADVANCE: i64 = 6;

fn text_width_chars(n: i64, scale: i64) -> i64 {
    if n == 0 { 0 } else { (n * ADVANCE - 1) * scale }
}

/// Width in pixels of `s` drawn at `scale`.
fn text_width(s: &str, scale: i64) -> i64 {
    text_width_chars(s.chars().count() as i64, scale)
}

/// The 5×7 glyph of `ch`: seven rows, the leftmost column in bit 4. Characters without a glyph
/// are drawn as a box.
fn glyph(ch: char) -> [u8; 7] {
    match ch {
        ' '..='~' => FONT[ch as usize - 32],
        '×' => [0x00, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x00],
        'µ' | 'μ' => [0x00, 0x00, 0x11, 0x11, 0x13, 0x1D, 0x10],
        '±' => [0x04, 0x04, 0x1F, 0x04, 0x04, 0x00, 0x1F],
        '…' => [0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x15],
        _ => [0x1F, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1F],
    }
}

/// ASCII 32 (space) to 126 (`~`), 5×7, rows top to bottom, leftmost column in bit 4.
const FONT: [[u8; 7]; 95] = [
    [0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00], // ' '
    [0x04, 0x04, 0x04, 0x04, 0x04, 0x00, 0x04], // !
    [0x0A, 0x0A, 0x0A, 0x00, 0x00, 0x00, 0x00], // "
    [0x0A, 0x0A, 0x1F, 0x0A, 0x1F, 0x0A, 0x0A], // #
    [0x04, 0x0F, 0x14, 0x0E, 0x05, 0x1E, 0x04], // $
    [0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03], // %
    [0x0C, 0x12, 0x14, 0x08, 0x15, 0x12, 0x0D], // &
    [0x0C, 0x04, 0x08, 0x00, 0x00, 0x00, 0x00], // '
    [0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02], // (
    [0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08], // )
    [0x00, 0x04, 0x15, 0x0E, 0x15, 0x04, 0x00], // *
    [0x00, 0x04, 0x04, 0x1F, 0x04, 0x04, 0x00], // +
    [0x00, 0x00, 0x00, 0x00, 0x0C, 0x04, 0x08], // ,
    [0x00, 0x00, 0x00, 0x1F, 0x00, 0x00, 0x00], // -
    [0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x0C], // .
    [0x00, 0x01, 0x02, 0x04, 0x08, 0x10, 0x00], // /
    [0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E], // 0
    [0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E], // 1
    [0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F], // 2
    [0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E], // 3
    [0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02], // 4
    [0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E], // 5
    [0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E], // 6
    [0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08], // 7
    [0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E], // 8
    [0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C], // 9
    [0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x0C, 0x00], // :
    [0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x04, 0x08], // ;
    [0x02, 0x04, 0x08, 0x10, 0x08, 0x04, 0x02], // <
    [0x00, 0x00, 0x1F, 0x00, 0x1F, 0x00, 0x00], // =
    [0x08, 0x04, 0x02, 0x01, 0x02, 0x04, 0x08], // >
    [0x0E, 0x11, 0x01, 0x02, 0x04, 0x00, 0x04], // ?
    [0x0E, 0x11, 0x01, 0x0D, 0x15, 0x15, 0x0E], // @
    [0x0E, 0x11, 0x11, 0x11, 0x1F, 0x11, 0x11], // A
    [0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E], // B
    [0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E], // C
    [0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C], // D
    [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F], // E
    [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10], // F
    [0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F], // G
    [0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11], // H
    [0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E], // I
    [0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C], // J
    [0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11], // K
    [0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F], // L
    [0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11], // M
    [0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11], // N
    [0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E], // O
    [0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10], // P
    [0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D], // Q
    [0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11], // R
    [0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E], // S
    [0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04], // T
    [0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E], // U
    [0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04], // V
    [0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A], // W
    [0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11], // X
    [0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04], // Y
    [0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F], // Z
    [0x0E, 0x08, 0x08, 0x08, 0x08, 0x08, 0x0E], // [
    [0x00, 0x10, 0x08, 0x04, 0x02, 0x01, 0x00], // \
    [0x0E, 0x02, 0x02, 0x02, 0x02, 0x02, 0x0E], // ]
    [0x04, 0x0A, 0x11, 0x00, 0x00, 0x00, 0x00], // ^
    [0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1F], // _
    [0x08, 0x04, 0x02, 0x00, 0x00, 0x00, 0x00], // `
    [0x00, 0x00, 0x0E, 0x01, 0x0F, 0x11, 0x0F], // a
    [0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x1E], // b
    [0x00, 0x00, 0x0E, 0x10, 0x10, 0x11, 0x0E], // c
    [0x01, 0x01, 0x0D, 0x13, 0x11, 0x11, 0x0F], // d
    [0x00, 0x00, 0x0E, 0x11, 0x1F, 0x10, 0x0E], // e
    [0x06, 0x09, 0x08, 0x1C, 0x08, 0x08, 0x08], // f
    [0x00, 0x0F, 0x11, 0x0F, 0x01, 0x11, 0x0E], // g
    [0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x11], // h
    [0x04, 0x00, 0x0C, 0x04, 0x04, 0x04, 0x0E], // i
    [0x02, 0x00, 0x06, 0x02, 0x02, 0x12, 0x0C], // j
    [0x10, 0x10, 0x12, 0x14, 0x18, 0x14, 0x12], // k
    [0x0C, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E], // l
    [0x00, 0x00, 0x1A, 0x15, 0x15, 0x11, 0x11], // m
    [0x00, 0x00, 0x16, 0x19, 0x11, 0x11, 0x11], // n
    [0x00, 0x00, 0x0E, 0x11, 0x11, 0x11, 0x0E], // o
    [0x00, 0x00, 0x1E, 0x11, 0x1E, 0x10, 0x10], // p
    [0x00, 0x00, 0x0D, 0x13, 0x0F, 0x01, 0x01], // q
    [0x00, 0x00, 0x16, 0x19, 0x10, 0x10, 0x10], // r
    [0x00, 0x00, 0x0E, 0x10, 0x0E, 0x01, 0x1E], // s
    [0x08, 0x08, 0x1C, 0x08, 0x08, 0x09, 0x06], // t
    [0x00, 0x00, 0x11, 0x11, 0x11, 0x13, 0x0D], // u
    [0x00, 0x00, 0x11, 0x11, 0x11, 0x0A, 0x04], // v
    [0x00, 0x00, 0x11, 0x11, 0x15, 0x15, 0x0A], // w
    [0x00, 0x00, 0x11, 0x0A, 0x04, 0x0A, 0x11], // x
    [0x00, 0x00, 0x11, 0x11, 0x0F, 0x01, 0x0E], // y
    [0x00, 0x00, 0x1F, 0x02, 0x04, 0x08, 0x1F], // z
    [0x02, 0x04, 0x04, 0x08, 0x04, 0x04, 0x02], // {
    [0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04], // |
    [0x08, 0x04, 0x04, 0x02, 0x04, 0x04, 0x08], // }
    [0x00, 0x00, 0x00, 0x0D, 0x12, 0x00, 0x00], // ~
];

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    /// A decoded chart.
    struct Image {
        w: i64,
        h: i64,
        px: Vec<u8>,
    }

    impl Image {
        fn at(&self, x: i64, y: i64) -> Rgb {
            let i = ((y * self.w + x) * 3) as usize;
            [self.px[i], self.px[i + 1], self.px[i + 2]]
        }

        /// Pixels of exactly `c` inside `[x0, x1] × [y0, y1]`.
        fn count(&self, c: Rgb, (x0, y0, x1, y1): (i64, i64, i64, i64)) -> usize {
            let mut n = 0;
            for y in y0.max(0)..=y1.min(self.h - 1) {
                for x in x0.max(0)..=x1.min(self.w - 1) {
                    n += usize::from(self.at(x, y) == c);
                }
            }
            n
        }

        fn everywhere(&self) -> (i64, i64, i64, i64) {
            (0, 0, self.w - 1, self.h - 1)
        }
    }

    /// A unique path in the temporary directory, removed when dropped.
    struct Temp(PathBuf);

    impl Temp {
        fn new(name: &str) -> Self {
            Temp::file(&format!("{name}.png"))
        }

        /// A path ending in `file`.
        fn file(file: &str) -> Self {
            Temp(std::env::temp_dir().join(format!("falcon-plot-{}-{file}", std::process::id())))
        }
    }

    impl Drop for Temp {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn decode(path: &Path) -> Image {
        let file = io::BufReader::new(std::fs::File::open(path).unwrap());
        let mut reader = png::Decoder::new(file).read_info().unwrap();
        let mut px = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut px).unwrap();
        assert_eq!(info.color_type, png::ColorType::Rgb);
        assert_eq!(info.bit_depth, png::BitDepth::Eight);
        px.truncate(info.buffer_size());
        Image {
            w: i64::from(info.width),
            h: i64::from(info.height),
            px,
        }
    }

    fn line(name: &str, series: &[(String, Vec<(f64, f64)>)]) -> (Image, LineLayout) {
        let tmp = Temp::new(name);
        line_chart(&tmp.0, name, series).unwrap();
        let img = decode(&tmp.0);
        assert_eq!((img.w, img.h), (W, H));
        assert_eq!(img.at(0, 0), WHITE);
        (img, LineLayout::new(&clean(series)))
    }

    /// The plot area (plus the marker's reach), which the legend lies outside of.
    fn plot_area(l: &LineLayout) -> (i64, i64, i64, i64) {
        (l.left - 4, l.top - 4, l.right + 4, l.bottom + 4)
    }

    fn named(name: &str, pts: Vec<(f64, f64)>) -> (String, Vec<(f64, f64)>) {
        (name.to_string(), pts)
    }

    #[test]
    fn normal_chart_draws_every_series_where_its_points_are() {
        let series: Vec<_> = (0..3)
            .map(|s| {
                let pts = (0..20)
                    .map(|i| {
                        (
                            f64::from(i),
                            f64::from(s) * 3.0 + 1.5 + (f64::from(i) / 3.0).sin(),
                        )
                    })
                    .collect();
                named(&format!("policy {s}"), pts)
            })
            .collect();
        let (img, l) = line("normal", &series);
        for i in 0..series.len() {
            let n = img.count(colour(i), plot_area(&l));
            assert!(n > 200, "series {i} has only {n} pixels in the plot");
        }
        // The last series is drawn last: the pixel under each of its points is its colour.
        for &(x, y) in &series[2].1 {
            let (px, py) = (l.px(x).round() as i64, l.py(y).round() as i64);
            assert_eq!(
                img.at(px, py),
                colour(2),
                "point ({x}, {y}) at ({px}, {py})"
            );
        }
        // Title, tick labels and legend text are drawn.
        assert!(img.count(TEXT, (0, 0, W - 1, 40)) > 50);
        assert!(img.count(TEXT, (0, l.bottom + 5, W - 1, H - 1)) > 20);
        assert!(img.count(TEXT, (l.legend_x0, l.top, W - 1, l.bottom)) > 50);
        assert!(img.count(GRID, img.everywhere()) > 500);
        assert_eq!(l.y.lo, 0.0);
        assert!((4..=8).contains(&l.x.ticks.len()) && (4..=8).contains(&l.y.ticks.len()));
    }

    #[test]
    fn empty_list_draws_title_and_no_data() {
        let (img, _) = line("empty-list", &[]);
        assert!(img.count(TEXT, (0, 0, W - 1, 40)) > 50);
        assert!(
            img.count(MUTED, img.everywhere()) > 50,
            "\"no data\" is drawn"
        );
        for c in PALETTE {
            assert_eq!(img.count(c, img.everywhere()), 0);
        }
    }

    #[test]
    fn empty_and_single_point_series() {
        let series = vec![named("empty", vec![]), named("one", vec![(3.0, 7.0)])];
        let (img, l) = line("single", &series);
        assert!(l.has_data);
        assert!(
            img.count(colour(1), plot_area(&l)) >= 9,
            "the single point has a marker"
        );
        assert_eq!(
            img.at(l.px(3.0).round() as i64, l.py(7.0).round() as i64),
            colour(1)
        );
        // Only empty series: axes, legend and "no data", no panic.
        let (img, l) = line(
            "only-empty",
            &[named("a", vec![]), named("b", vec![(f64::NAN, 1.0)])],
        );
        assert!(!l.has_data);
        assert!(img.count(MUTED, plot_area(&l)) > 50);
    }

    #[test]
    fn non_finite_points_are_skipped() {
        let pts = vec![
            (0.0, 1.0),
            (1.0, f64::NAN),
            (2.0, 3.0),
            (f64::INFINITY, 2.0),
            (3.0, f64::NEG_INFINITY),
            (4.0, 2.0),
            (f64::NAN, f64::NAN),
            (5.0, 1e308),
        ];
        let series = vec![
            named("nan", pts),
            named("all nan", vec![(f64::NAN, f64::NAN); 4]),
        ];
        let (img, l) = line("nan", &series);
        assert!(img.count(colour(0), plot_area(&l)) > 100);
        assert!(
            l.x.hi < 6.0 && l.y.hi < 10.0,
            "skipped points do not stretch the axes"
        );
    }

    #[test]
    fn all_equal_values() {
        let series = vec![
            named("flat", (0..10).map(|i| (f64::from(i), 5.0)).collect()),
            named("same point", vec![(2.0, 5.0); 6]),
            named("zeros", vec![(0.0, 0.0); 3]),
            named("negative", vec![(1.0, -4.0); 2]),
        ];
        let (img, l) = line("flat", &series);
        for i in 0..series.len() {
            assert!(img.count(colour(i), plot_area(&l)) >= 9, "series {i}");
        }
        for s in &series[2..] {
            line("flat-one", std::slice::from_ref(s));
        }
    }

    #[test]
    fn huge_series_are_downsampled_and_keep_spikes() {
        let mut pts: Vec<(f64, f64)> = (0..50_000)
            .map(|i| (f64::from(i), f64::from(i % 100)))
            .collect();
        pts[31_337].1 = 1000.0;
        let kept = downsample(pts.clone());
        assert!(kept.len() <= 2 * BUCKETS);
        assert!(kept.contains(&(31_337.0, 1000.0)));
        let (img, l) = line("huge", &[named("huge", pts)]);
        assert!(img.count(colour(0), plot_area(&l)) > 1000);
    }

    #[test]
    fn many_series_cycle_colours_and_fold_the_legend() {
        let series: Vec<_> = (0..40)
            .map(|s| {
                named(
                    &format!("a rather long series name number {s}"),
                    vec![(0.0, f64::from(s)), (1.0, 1.0)],
                )
            })
            .collect();
        let (img, l) = line("many", &series);
        assert!(l.right - l.left > 400);
        for c in PALETTE {
            assert!(img.count(c, plot_area(&l)) > 0);
        }
    }

    #[test]
    fn bar_chart_draws_every_bar() {
        let bars = vec![
            ("bsp".to_string(), 1.0),
            ("ssp(3)".to_string(), 1.8),
            ("dssp".to_string(), 2.4),
            ("broken".to_string(), f64::NAN),
            ("slower".to_string(), -0.5),
        ];
        let tmp = Temp::new("bars");
        bar_chart(&tmp.0, "throughput / bsp", &bars).unwrap();
        let img = decode(&tmp.0);
        assert_eq!((img.w, img.h), (W, H));
        for (i, (_, v)) in bars.iter().enumerate() {
            let n = img.count(colour(i), img.everywhere());
            if v.is_finite() {
                assert!(n > 200, "bar {i} has only {n} pixels");
            } else {
                assert_eq!(n, 0);
            }
        }
        assert!(img.count(MUTED, img.everywhere()) > 10, "n/a is drawn");

        for (name, bars) in [
            ("bars-empty", vec![]),
            ("bars-one", vec![("only".to_string(), 3.0)]),
            ("bars-zero", vec![("zero".to_string(), 0.0)]),
            ("bars-nan", vec![("nan".to_string(), f64::NAN)]),
            (
                "bars-many",
                (0..500).map(|i| (format!("b{i}"), f64::from(i))).collect(),
            ),
        ] {
            let tmp = Temp::new(name);
            bar_chart(&tmp.0, name, &bars).unwrap();
            let img = decode(&tmp.0);
            assert_eq!((img.w, img.h), (W, H));
            if name == "bars-one" || name == "bars-many" {
                assert!(img.count(colour(0), img.everywhere()) > 0);
            }
        }
    }

    #[test]
    fn ticks_are_nice_and_compact() {
        let labels = |a: &Axis| a.ticks.iter().map(|&t| a.label(t)).collect::<Vec<_>>();
        assert_eq!(
            labels(&nice_axis(0.0, 1.6, true)),
            ["0", "0.5", "1", "1.5", "2"]
        );
        assert_eq!(
            labels(&nice_axis(0.0, 45_000.0, true)),
            ["0", "10k", "20k", "30k", "40k", "50k"]
        );
        assert_eq!(
            labels(&nice_axis(3.0, 47.0, true)),
            ["0", "10", "20", "30", "40", "50"]
        );
        assert_eq!(
            labels(&nice_axis(-1.0, 1.0, true)),
            ["-1", "-0.5", "0", "0.5", "1"]
        );
        let tiny = nice_axis(0.0, 3e-6, true);
        assert!(
            labels(&tiny).iter().all(|s| s.chars().count() <= 8),
            "{:?}",
            labels(&tiny)
        );
        for (lo, hi) in [
            (0.0, 1e-300),
            (-1e300, 1e300),
            (1e15, 1e15 + 1.0),
            (0.1, 0.1000001),
            (7.0, 7.0),
        ] {
            let (lo, hi) = widen(lo, hi);
            let a = nice_axis(lo, hi, true);
            assert!(a.hi > a.lo, "{lo}..{hi}");
            assert!(a.ticks.len() <= 50);
        }
        assert_eq!(format_value(1.8), "1.8");
        assert_eq!(format_value(123_456.0), "123k");
        assert_eq!(format_value(0.01234), "0.0123");
        assert_eq!(format_value(f64::NAN), "n/a");
    }

    #[test]
    fn font_covers_printable_ascii() {
        let boxed = glyph('\u{1}');
        for ch in ' '..='~' {
            assert_ne!(glyph(ch), boxed, "{ch:?}");
        }
        assert_eq!(text_width("ab", 1), 11);
        assert_eq!(shorten("abcdef", 4), "ab..");
    }

    /// Writes a chart to `name.svg` with `draw`, checks that the file is a well-formed SVG
    /// document and returns it.
    fn svg_of(name: &str, draw: impl FnOnce(&Path) -> io::Result<()>) -> String {
        let tmp = Temp::file(&format!("{name}.svg"));
        draw(&tmp.0).unwrap();
        let svg = std::fs::read_to_string(&tmp.0).unwrap();
        assert_well_formed(&svg);
        svg
    }

    /// Tags balance under one `<svg>` root, attribute values are quoted, and character data
    /// holds no `<` or `>` and no `&` but one of XML's predefined entities.
    fn assert_well_formed(svg: &str) {
        let head = &svg[..svg.len().min(200)];
        assert!(
            svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\" "),
            "{head}"
        );
        assert!(svg.trim_end().ends_with("</svg>"));
        let data = |t: &str| {
            assert!(!t.contains('>'), "{t:?}");
            for after in t.split('&').skip(1) {
                assert!(
                    ["amp;", "lt;", "gt;", "quot;", "apos;"]
                        .iter()
                        .any(|e| after.starts_with(e)),
                    "{t:?}"
                );
            }
        };
        let (mut open, mut roots, mut rest) = (Vec::new(), 0, svg.trim_end());
        while let Some(lt) = rest.find('<') {
            data(&rest[..lt]);
            let gt = lt + rest[lt..].find('>').expect("an unclosed tag");
            let tag = &rest[lt + 1..gt];
            if let Some(name) = tag.strip_prefix('/') {
                assert_eq!(open.pop(), Some(name), "</{name}>");
            } else {
                assert_eq!(tag.matches('"').count() % 2, 0, "<{tag}>");
                roots += usize::from(open.is_empty());
                if !tag.ends_with('/') {
                    open.push(tag.split_whitespace().next().unwrap());
                }
            }
            rest = &rest[gt + 1..];
        }
        data(rest);
        assert!(open.is_empty(), "unclosed {open:?}");
        assert_eq!(roots, 1);
    }

    /// The contents of every `<text>` element, as written (escaped).
    fn texts(svg: &str) -> Vec<&str> {
        svg.split("<text ")
            .skip(1)
            .map(|t| {
                let t = &t[t.find('>').unwrap() + 1..];
                &t[..t.find("</text>").unwrap()]
            })
            .collect()
    }

    /// The number of points of each `<polyline>` stroked in `c`.
    fn polylines(svg: &str, c: Rgb) -> Vec<usize> {
        let stroke = format!("stroke=\"{}\"", Hex(c));
        svg.lines()
            .filter(|l| l.starts_with("<polyline ") && l.contains(&stroke))
            .map(|l| l.split('"').nth(1).unwrap().split(' ').count())
            .collect()
    }

    #[test]
    fn svg_line_chart_is_well_formed_and_complete() {
        let series: Vec<_> = (0..3)
            .map(|s| {
                let pts = (0..20)
                    .map(|i| {
                        (
                            f64::from(i),
                            f64::from(s) * 3.0 + (f64::from(i) / 3.0).sin(),
                        )
                    })
                    .collect();
                named(&format!("policy {s}"), pts)
            })
            .collect();
        let svg = svg_of("svg-line", |p| line_chart(p, "Throughput", &series));
        assert!(svg.contains(r#"width="900" height="560" viewBox="0 0 900 560""#));
        assert!(svg.contains(r##"<rect width="900" height="560" fill="#ffffff"/>"##));
        let l = LineLayout::new(&clean(&series));
        let texts = texts(&svg);
        assert_eq!(texts[0], "Throughput");
        for t in &l.y.ticks {
            assert!(texts.contains(&l.y.label(*t).as_str()), "y label {t}");
        }
        assert!(texts.contains(&l.x.label(l.x.ticks[0]).as_str()));
        for (name, _) in &series {
            assert!(texts.contains(&name.as_str()), "{name}");
        }
        let x_labels = l.x.ticks.len().div_ceil(label_stride(
            &l.x.ticks.iter().map(|&t| l.x.label(t)).collect::<Vec<_>>(),
            &l.x.ticks
                .iter()
                .map(|&t| l.px(t).round() as i64)
                .collect::<Vec<_>>(),
        ));
        assert_eq!(
            texts.len(),
            1 + l.y.ticks.len() + x_labels + series.len(),
            "{texts:?}"
        );
        // A line through the points and one in the legend; a marker on each point.
        for (i, (_, pts)) in series.iter().enumerate() {
            assert_eq!(polylines(&svg, colour(i)), [pts.len(), 2], "series {i}");
            let disc = format!("r=\"3\" fill=\"{}\"", Hex(colour(i)));
            assert_eq!(svg.matches(&disc).count(), pts.len() + 1, "series {i}");
        }
        assert!(svg.contains(&format!("fill=\"{}\"", Hex(GRID))));
        // Text is one element, not also a rect per font pixel.
        assert!(svg.lines().count() < 300, "{} lines", svg.lines().count());
    }

    #[test]
    fn svg_bar_chart_is_well_formed_and_complete() {
        let bars = vec![
            ("bsp".to_string(), 1.0),
            ("ssp(3)".to_string(), 1.8),
            ("dssp".to_string(), 2.4),
            ("broken".to_string(), f64::NAN),
            ("slower".to_string(), -0.5),
        ];
        let svg = svg_of("svg-bars", |p| bar_chart(p, "throughput / bsp", &bars));
        let texts = texts(&svg);
        assert_eq!(texts[0], "throughput / bsp");
        for (i, (name, v)) in bars.iter().enumerate() {
            assert!(texts.contains(&name.as_str()), "{name}");
            assert!(texts.contains(&format_value(*v).as_str()), "{v}");
            let bar = format!("fill=\"{}\"/>", Hex(colour(i)));
            assert_eq!(
                svg.matches(&bar).count(),
                usize::from(v.is_finite()),
                "bar {i}"
            );
        }
        assert!(texts.contains(&"n/a"));
    }

    #[test]
    fn svg_empty_input_draws_title_and_no_data() {
        let line = svg_of("svg-empty-line", |p| line_chart(p, "empty lines", &[]));
        let bars = svg_of("svg-empty-bars", |p| bar_chart(p, "empty bars", &[]));
        assert_eq!(texts(&line), ["empty lines", "no data"]);
        assert_eq!(texts(&bars), ["empty bars", "no data"]);
        for c in PALETTE {
            assert!(!line.contains(&Hex(c).to_string()) && !bars.contains(&Hex(c).to_string()));
        }
        let only_empty = svg_of("svg-only-empty", |p| {
            line_chart(p, "t", &[named("a", vec![]), named("b", vec![])])
        });
        assert!(texts(&only_empty).contains(&"no data"));
    }

    #[test]
    fn svg_text_is_escaped() {
        let title = r#"a <&> "b" 'c'"#;
        let series = [named("<x> & \u{1}", vec![(0.0, 1.0), (1.0, 2.0)])];
        let svg = svg_of("svg-escape", |p| line_chart(p, title, &series));
        let shown = texts(&svg);
        assert_eq!(shown[0], "a &lt;&amp;&gt; &quot;b&quot; &apos;c&apos;");
        assert!(shown.contains(&"&lt;x&gt; &amp; \u{FFFD}"), "{shown:?}");
        let bars = [("<&>".to_string(), 1.0)];
        let svg = svg_of("svg-escape-bars", |p| bar_chart(p, "<&>", &bars));
        assert_eq!(
            texts(&svg)
                .iter()
                .filter(|t| **t == "&lt;&amp;&gt;")
                .count(),
            2
        );
    }

    #[test]
    fn svg_skips_non_finite_points() {
        let pts = vec![
            (0.0, 1.0),
            (1.0, f64::NAN),
            (2.0, 3.0),
            (f64::INFINITY, 2.0),
            (3.0, f64::NEG_INFINITY),
            (4.0, 2.0),
            (f64::NAN, f64::NAN),
            (5.0, 1e308),
        ];
        let series = [
            named("holes", pts),
            named("all gone", vec![(f64::NAN, f64::NAN); 4]),
        ];
        let svg = svg_of("svg-nan", |p| line_chart(p, "holes", &series));
        assert!(!svg.contains("NaN") && !svg.contains("inf"), "{svg}");
        // Three points left, and the legend's line.
        assert_eq!(polylines(&svg, colour(0)), [3, 2]);
        assert_eq!(polylines(&svg, colour(1)), [2]);
        let bars = [
            ("x".to_string(), f64::NAN),
            ("y".to_string(), f64::INFINITY),
        ];
        let svg = svg_of("svg-nan-bars", |p| bar_chart(p, "holes", &bars));
        assert!(!svg.contains("NaN") && !svg.contains("inf"), "{svg}");
        assert_eq!(Num(-0.001).to_string(), "0");
        assert_eq!(Num(12.345_6).to_string(), "12.35");
        assert_eq!(Num(7.0).to_string(), "7");
    }

    #[test]
    fn extension_picks_the_format() {
        let series = [named("s", vec![(0.0, 1.0), (1.0, 2.0)])];
        let bars = [("b".to_string(), 1.0)];
        for (file, svg) in [
            ("dispatch.png", false),
            ("dispatch-plain", false),
            ("dispatch.svg.png", false),
            ("dispatch.svg", true),
            ("dispatch-upper.SVG", true),
            ("dispatch-mixed.Svg", true),
        ] {
            let tmp = Temp::file(file);
            let check = |what: &str| {
                let bytes = std::fs::read(&tmp.0).unwrap();
                let magic: &[u8] = if svg { b"<svg " } else { b"\x89PNG" };
                assert!(bytes.starts_with(magic), "{what} to {file}");
            };
            line_chart(&tmp.0, "t", &series).unwrap();
            check("line chart");
            bar_chart(&tmp.0, "t", &bars).unwrap();
            check("bar chart");
        }
    }

    /// Renders `/tmp/falcon-plot-example.png` (and a bar chart beside it, and each as `.svg`)
    /// to look at.
    #[test]
    #[ignore = "writes an example image for a person to look at"]
    fn example_image() {
        let series: Vec<_> = ["BSP", "SSP (s=3)", "DSSP", "FluentPS"]
            .iter()
            .enumerate()
            .map(|(k, name)| {
                let k = k as f64;
                let pts = (1..=16)
                    .map(|w| {
                        (
                            f64::from(w),
                            f64::from(w) * (0.55 + 0.12 * k)
                                / (1.0 + 0.02 * f64::from(w) * (3.0 - k)),
                        )
                    })
                    .collect();
                named(name, pts)
            })
            .collect();
        let bars = vec![
            ("BSP".to_string(), 1.0),
            ("SSP (s=3)".to_string(), 1.42),
            ("DSSP".to_string(), 1.67),
            ("FluentPS".to_string(), 1.91),
            ("ASP".to_string(), -0.2),
        ];
        // Harder inputs: many series, a long noisy one with NaNs, negative values.
        let mut edge: Vec<_> = (0..14)
            .map(|s| {
                let pts = (0..30)
                    .map(|i| (f64::from(i) * 1e4, f64::from(s) - 4.0 + f64::from(i).sqrt()))
                    .collect();
                named(&format!("series with a long name {s}"), pts)
            })
            .collect();
        edge.push(named(
            "noisy",
            (0..30_000)
                .map(|i| {
                    let y = if i % 997 == 0 {
                        f64::NAN
                    } else {
                        (f64::from(i) * 0.37).sin() * 2.0
                    };
                    (f64::from(i) * 10.0, y)
                })
                .collect(),
        ));
        for ext in ["png", "svg"] {
            let path = |name: &str| PathBuf::from(format!("/tmp/falcon-plot-example{name}.{ext}"));
            let title = "Throughput vs workers [samples/s ×1000]";
            line_chart(&path(""), title, &series).unwrap();
            bar_chart(&path("-bars"), "Speed-up over BSP (8 workers)", &bars).unwrap();
            line_chart(&path("-edge"), "edge cases", &edge).unwrap();
        }
    }
}
