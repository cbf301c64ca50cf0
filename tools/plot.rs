//! The reports' charts, shared by `train`, `sim`, `experiment` and `bench`: line charts of
//! accuracy (or anything) against time, and bar charts, drawn with plotters.
//!
//! A path ending in `.svg` (any case) gets SVG, anything else PNG. PNG text is drawn with the
//! bundled DejaVu Sans (`tools/assets/`, registered once), so nothing is read from the system;
//! SVG names the font family and lets the viewer draw it.
//!
//! What every chart does: points or values that are NaN, infinite or beyond ±1e300 are
//! skipped; no data at all draws the title and "no data"; a series of more than 10 000 points
//! is reduced to the minimum and maximum of each of 2 000 buckets (its spikes kept); every
//! series is drawn to its last point; the y axis is fitted to the data (and the target line,
//! when there is one), not pinned to 0–100; ten colours, each series named in the legend.

use std::io;
use std::ops::Range;
use std::path::Path;
use std::sync::Once;

use plotters::coord::Shift;
use plotters::prelude::*;

/// Image size, in pixels.
const W: u32 = 1000;
const H: u32 = 620;
/// Points beyond this magnitude are treated like infinities.
const LIMIT: f64 = 1e300;
/// A series longer than this is downsampled into [`BUCKETS`] buckets (two points each).
const MAX_POINTS: usize = 10_000;
const BUCKETS: usize = 2_000;
/// Series up to this long get a marker at every point (a one-point series is then visible).
const MARKERS: usize = 60;
/// The font family the charts use.
const FONT: &str = "sans-serif";

/// The Tableau 10 palette, reused beyond ten series.
const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// A line chart.
pub struct Lines<'a> {
    /// Above the chart.
    pub title: &'a str,
    /// Under the x axis.
    pub x_label: &'a str,
    /// Beside the y axis.
    pub y_label: &'a str,
    /// `(name, points)`, drawn in order.
    pub series: &'a [(String, Vec<(f64, f64)>)],
    /// A horizontal dashed line at this y (an accuracy target), with its legend text.
    pub target: Option<(f64, String)>,
}

impl<'a> Lines<'a> {
    /// Test accuracy in % against `x_label`, with the target (a fraction) drawn.
    pub fn accuracy(
        title: &'a str,
        x_label: &'a str,
        series: &'a [(String, Vec<(f64, f64)>)],
        target: f64,
    ) -> Lines<'a> {
        Lines {
            title,
            x_label,
            y_label: "test accuracy (%)",
            series,
            target: Some((100.0 * target, format!("target {:.0} %", 100.0 * target))),
        }
    }
}

/// Writes a line chart to `path` (SVG or PNG by its extension).
pub fn line_chart(path: &Path, chart: &Lines<'_>) -> io::Result<()> {
    write(path, chart)
}

/// Writes a chart of horizontal bars, one per `(name, value)` from the top, each labelled
/// with its value; the value axis includes 0 (negative values extend left of it) and a
/// non-finite value is written "n/a" without a bar.
pub fn bar_chart(path: &Path, title: &str, bars: &[(String, f64)]) -> io::Result<()> {
    write(path, &Bars { title, bars })
}

type Drawn = Result<(), String>;

/// A chart that can be drawn on any backend.
trait Chart {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Drawn;
}

impl Chart for Lines<'_> {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Drawn {
        draw_lines(root, self)
    }
}

struct Bars<'a> {
    title: &'a str,
    bars: &'a [(String, f64)],
}

impl Chart for Bars<'_> {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Drawn {
        draw_bars(root, self.title, self.bars)
    }
}

fn fonts() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The bundled font is a valid TTF (a test draws with it); were it not, text would be
        // missing from PNG charts, not the program.
        let _ = plotters::style::register_font(
            FONT,
            FontStyle::Normal,
            include_bytes!("assets/DejaVuSans.ttf"),
        );
    });
}

fn err<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// Draws `chart` on the backend `path` asks for, and writes the file.
fn write(path: &Path, chart: &impl Chart) -> io::Result<()> {
    fonts();
    let svg = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("svg"));
    let failed = |why: String| io::Error::other(format!("chart {}: {why}", path.display()));
    if svg {
        let mut text = String::new();
        {
            let root = SVGBackend::with_string(&mut text, (W, H)).into_drawing_area();
            chart.draw(&root).map_err(failed)?;
            root.present().map_err(|e| failed(e.to_string()))?;
        }
        return std::fs::write(path, text);
    }
    let mut rgb = vec![255u8; (W * H * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, (W, H)).into_drawing_area();
        chart.draw(&root).map_err(failed)?;
        root.present().map_err(|e| failed(e.to_string()))?;
    }
    let file = std::fs::File::create(path)?;
    let mut enc = png::Encoder::new(io::BufWriter::new(file), W, H);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let mut w = enc.write_header().map_err(io::Error::other)?;
    w.write_image_data(&rgb).map_err(io::Error::other)?;
    w.finish().map_err(io::Error::other)
}

fn usable(v: f64) -> bool {
    v.is_finite() && v.abs() < LIMIT
}

/// A series' usable points, downsampled when long (the minimum and maximum of each bucket,
/// in order, and always the last point).
fn prepared(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let pts: Vec<(f64, f64)> = points
        .iter()
        .copied()
        .filter(|&(x, y)| usable(x) && usable(y))
        .collect();
    if pts.len() <= MAX_POINTS {
        return pts;
    }
    let per = pts.len().div_ceil(BUCKETS);
    let mut out = Vec::with_capacity(2 * BUCKETS + 1);
    for b in pts.chunks(per) {
        let lo = b
            .iter()
            .copied()
            .fold(b[0], |m, p| if p.1 < m.1 { p } else { m });
        let hi = b
            .iter()
            .copied()
            .fold(b[0], |m, p| if p.1 > m.1 { p } else { m });
        if lo.0 <= hi.0 {
            out.extend([lo, hi]);
        } else {
            out.extend([hi, lo]);
        }
    }
    if let Some(&last) = pts.last() {
        out.push(last);
    }
    out
}

/// `lo..hi` widened by a margin of `frac` of its span (or by 1 when it is a point).
fn padded(lo: f64, hi: f64, frac: f64) -> Range<f64> {
    let span = hi - lo;
    if span <= f64::EPSILON * hi.abs().max(1.0) {
        let d = (lo.abs() * 0.05).max(1.0);
        return lo - d..hi + d;
    }
    lo - span * frac..hi + span * frac
}

/// Tick labels short enough for the axis: `1.5`, `120`, `35k`, `2.5e-6`.
fn tick(v: &f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        "0".into()
    } else if !(1e-3..1e6).contains(&a) {
        format!("{v:.2e}")
    } else if a >= 1e4 {
        format!("{:.0}k", v / 1e3)
    } else if (v - v.round()).abs() < 1e-9 {
        format!("{v:.0}")
    } else {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

fn title_style(size: u32) -> TextStyle<'static> {
    (FONT, size).into_font().color(&BLACK)
}

fn no_data<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, title: &str) -> Drawn {
    root.fill(&WHITE).map_err(err)?;
    root.draw(&Text::new(title.to_string(), (20, 15), title_style(24)))
        .map_err(err)?;
    root.draw(&Text::new(
        "no data",
        ((W / 2 - 40) as i32, (H / 2) as i32),
        title_style(22),
    ))
    .map_err(err)
}

fn draw_lines<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, c: &Lines<'_>) -> Drawn {
    let series: Vec<(&str, Vec<(f64, f64)>)> = c
        .series
        .iter()
        .map(|(n, p)| (n.as_str(), prepared(p)))
        .collect();
    let all = || series.iter().flat_map(|(_, p)| p.iter().copied());
    if all().next().is_none() {
        return no_data(root, c.title);
    }
    let (mut xlo, mut xhi, mut ylo, mut yhi) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for (x, y) in all() {
        (xlo, xhi, ylo, yhi) = (xlo.min(x), xhi.max(x), ylo.min(y), yhi.max(y));
    }
    let target = c.target.as_ref().filter(|(t, _)| usable(*t));
    if let Some((t, _)) = target {
        (ylo, yhi) = (ylo.min(*t), yhi.max(*t));
    }
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(root)
        .caption(c.title, title_style(24))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d(padded(xlo, xhi, 0.02), padded(ylo, yhi, 0.06))
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(c.x_label)
        .y_desc(c.y_label)
        .x_label_formatter(&tick)
        .y_label_formatter(&tick)
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 17))
        .light_line_style(RGBColor(238, 238, 238))
        .bold_line_style(RGBColor(215, 215, 215))
        .draw()
        .map_err(err)?;
    if let Some((t, label)) = target {
        let x = padded(xlo, xhi, 0.02);
        chart
            .draw_series(DashedLineSeries::new(
                [(x.start, *t), (x.end, *t)],
                10,
                6,
                BLACK.stroke_width(2),
            ))
            .map_err(err)?
            .label(label.clone())
            .legend(|(x, y)| {
                EmptyElement::at((x, y))
                    + PathElement::new(vec![(0, 0), (7, 0)], BLACK.stroke_width(2))
                    + PathElement::new(vec![(12, 0), (20, 0)], BLACK.stroke_width(2))
            });
    }
    for (i, (name, pts)) in series.iter().enumerate() {
        let colour = PALETTE[i % PALETTE.len()];
        let drawn = chart
            .draw_series(LineSeries::new(pts.iter().copied(), colour.stroke_width(2)))
            .map_err(err)?;
        drawn.label(*name).legend(move |(x, y)| {
            PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(3))
        });
        if pts.len() <= MARKERS {
            chart
                .draw_series(pts.iter().map(|&p| Circle::new(p, 3, colour.filled())))
                .map_err(err)?;
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .label_font((FONT, 15))
        .background_style(WHITE.mix(0.9))
        .border_style(RGBColor(190, 190, 190))
        .draw()
        .map_err(err)
}

fn draw_bars<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    title: &str,
    bars: &[(String, f64)],
) -> Drawn {
    if bars.is_empty() {
        return no_data(root, title);
    }
    let values = || bars.iter().map(|b| b.1).filter(|v| usable(*v));
    let lo = values().fold(0.0f64, f64::min);
    let hi = values().fold(0.0f64, f64::max);
    let x = padded(lo, hi, 0.12);
    let n = bars.len();
    root.fill(&WHITE).map_err(err)?;
    let names: Vec<String> = bars.iter().map(|b| b.0.clone()).collect();
    // Row i (from the top) is centred at y = n - 1 - i; a tick at each row's centre.
    let centre = |i: usize| (n - 1 - i) as f64;
    let label = move |y: &f64| {
        let i = n as f64 - 1.0 - y.round();
        if (y - y.round()).abs() < 1e-6 && i >= 0.0 {
            names.get(i as usize).cloned().unwrap_or_default()
        } else {
            String::new()
        }
    };
    let rows = -0.6..n as f64 - 0.4;
    let mut chart = ChartBuilder::on(root)
        .caption(title, title_style(24))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(170)
        .build_cartesian_2d(x.clone(), rows)
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        // Ticks every fifth of a row or closer, so every row's centre is one; the others
        // are left unlabelled.
        .y_labels(5 * n + 5)
        .y_label_formatter(&label)
        .x_label_formatter(&tick)
        .label_style((FONT, 15))
        .light_line_style(RGBColor(238, 238, 238))
        .bold_line_style(RGBColor(215, 215, 215))
        .draw()
        .map_err(err)?;
    for (i, (_, v)) in bars.iter().enumerate() {
        let (y, colour) = (centre(i), PALETTE[i % PALETTE.len()]);
        if !usable(*v) {
            chart
                .draw_series([Text::new("n/a", (0.0, y), (FONT, 15))])
                .map_err(err)?;
            continue;
        }
        chart
            .draw_series([Rectangle::new(
                [(0.0, y - 0.36), (*v, y + 0.36)],
                colour.filled(),
            )])
            .map_err(err)?;
        chart
            .draw_series([Text::new(format!("  {}", tick(v)), (*v, y), (FONT, 15))])
            .map_err(err)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Temp(std::path::PathBuf);

    impl Temp {
        fn file(name: &str) -> Temp {
            Temp(std::env::temp_dir().join(format!("falcon-plot-{}-{name}", std::process::id())))
        }
    }

    impl Drop for Temp {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn named(name: &str, pts: Vec<(f64, f64)>) -> (String, Vec<(f64, f64)>) {
        (name.to_string(), pts)
    }

    fn svg_of(name: &str, draw: impl Fn(&Path) -> io::Result<()>) -> String {
        let t = Temp::file(&format!("{name}.svg"));
        draw(&t.0).unwrap();
        std::fs::read_to_string(&t.0).unwrap()
    }

    fn lines<'a>(series: &'a [(String, Vec<(f64, f64)>)], target: Option<f64>) -> Lines<'a> {
        Lines {
            title: "accuracy",
            x_label: "time (s)",
            y_label: "test accuracy (%)",
            series,
            target: target.map(|t| (t, format!("target {t} %"))),
        }
    }

    /// The y tick labels of an SVG chart (text elements right of nothing but numbers).
    fn numbers(svg: &str) -> Vec<f64> {
        svg.split("<text")
            .filter_map(|t| t.split('>').nth(1)?.split('<').next()?.trim().parse().ok())
            .collect()
    }

    #[test]
    fn nine_series_and_the_target_are_named_and_the_y_axis_fits_the_data() {
        let series: Vec<_> = (0..9)
            .map(|k| {
                named(
                    &format!("policy {k}"),
                    (0..40)
                        .map(|i| (f64::from(i) * 0.1, 60.0 + f64::from(k) + f64::from(i) * 0.6))
                        .collect(),
                )
            })
            .collect();
        let svg = svg_of("nine", |p| line_chart(p, &lines(&series, Some(75.0))));
        assert!(svg.starts_with("<svg"), "{svg}");
        for k in 0..9 {
            assert!(svg.contains(&format!("policy {k}")), "series {k} named");
        }
        assert!(svg.contains("target 75 %"));
        assert!(svg.contains("test accuracy (%)") && svg.contains("time (s)"));
        // The data span 60–92.4 (y) and 0–3.9 (x): the y axis is fitted, not 0–100, so no
        // tick falls between the two ranges.
        let ticks = numbers(&svg);
        assert!(ticks.contains(&60.0) && ticks.contains(&90.0), "{ticks:?}");
        assert!(
            !ticks.iter().any(|&t| (5.0..55.0).contains(&t)),
            "{ticks:?}"
        );
    }

    #[test]
    fn bad_points_empty_input_and_both_formats() {
        let holes = [named(
            "holes",
            vec![
                (0.0, 1.0),
                (1.0, f64::NAN),
                (f64::INFINITY, 2.0),
                (2.0, 1e301),
                (3.0, 3.0),
            ],
        )];
        let svg = svg_of("holes", |p| line_chart(p, &lines(&holes, None)));
        assert!(!svg.contains("NaN") && !svg.contains("inf"), "{svg}");
        let empty = svg_of("empty", |p| line_chart(p, &lines(&[], None)));
        assert!(empty.contains("no data") && empty.contains("accuracy"));
        let no_bars = svg_of("nobars", |p| bar_chart(p, "speed-up", &[]));
        assert!(no_bars.contains("no data"));
        let one = svg_of("onebar", |p| {
            bar_chart(p, "one", &[("only".to_string(), 2.5)])
        });
        assert!(one.contains("only") && one.contains("2.5"), "{one}");
        let bars = [
            ("BSP".to_string(), 1.0),
            ("ASP".to_string(), -0.25),
            ("broken".to_string(), f64::NAN),
        ];
        let svg = svg_of("bars", |p| bar_chart(p, "speed-up", &bars));
        assert!(
            svg.contains("BSP") && svg.contains("ASP") && svg.contains("n/a"),
            "{svg}"
        );
        // A long noisy series is thinned, and its last point kept.
        let long: Vec<_> = (0..50_000)
            .map(|i| (f64::from(i), f64::from(i % 7)))
            .collect();
        assert!(prepared(&long).len() <= 2 * BUCKETS + 1);
        assert_eq!(prepared(&long).last(), Some(&(49_999.0, 49_999.0 % 7.0)));
        for (file, svg) in [
            ("a.png", false),
            ("b", false),
            ("c.svg", true),
            ("d.SVG", true),
        ] {
            let t = Temp::file(file);
            line_chart(&t.0, &lines(&holes, Some(2.0))).unwrap();
            let bytes = std::fs::read(&t.0).unwrap();
            let magic: &[u8] = if svg { b"<svg" } else { b"\x89PNG" };
            assert!(bytes.starts_with(magic), "{file}");
            bar_chart(&t.0, "t", &bars).unwrap();
            assert!(std::fs::read(&t.0).unwrap().starts_with(magic), "{file}");
        }
    }

    #[test]
    fn png_text_is_drawn_with_the_bundled_font() {
        // The same chart with and without a title: the title's pixels differ only if the
        // registered font drew them.
        let series = [named("s", vec![(0.0, 1.0), (1.0, 2.0)])];
        let (a, b) = (Temp::file("t1.png"), Temp::file("t2.png"));
        let mut with = lines(&series, None);
        with.title = "a title drawn in DejaVu Sans";
        line_chart(&a.0, &with).unwrap();
        let mut without = lines(&series, None);
        without.title = "";
        line_chart(&b.0, &without).unwrap();
        assert_ne!(std::fs::read(&a.0).unwrap(), std::fs::read(&b.0).unwrap());
    }

    /// Writes `/tmp/falcon-plot-example.{png,svg}` to look at.
    #[test]
    #[ignore = "writes an example image for a person to look at"]
    fn example_image() {
        let series: Vec<_> = [
            "bsp",
            "ssp(3)",
            "dssp",
            "fluentps",
            "epsp(0)",
            "epsp(4)",
            "asp",
            "flexrr",
            "elasticbsp",
        ]
        .iter()
        .enumerate()
        .map(|(k, n)| {
            let k = k as f64;
            named(
                n,
                (0..30)
                    .map(|i| {
                        let t = f64::from(i) * (0.3 + 0.02 * k);
                        (t, 88.0 - 30.0 * (-f64::from(i) / (4.0 + k)).exp())
                    })
                    .collect(),
            )
        })
        .collect();
        for ext in ["png", "svg"] {
            let p = std::path::PathBuf::from(format!("/tmp/falcon-plot-example.{ext}"));
            line_chart(&p, &lines(&series, Some(84.0))).unwrap();
            let b = std::path::PathBuf::from(format!("/tmp/falcon-plot-example-bars.{ext}"));
            bar_chart(
                &b,
                "time to 84 % against BSP's",
                &[
                    ("bsp".into(), 1.0),
                    ("epsp(0)".into(), 0.78),
                    ("asp".into(), f64::NAN),
                    ("ssp(3)".into(), 1.2),
                ],
            )
            .unwrap();
        }
    }
}
