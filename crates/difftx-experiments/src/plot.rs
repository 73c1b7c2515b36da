//! Shared plotting setup: a bundled font (DejaVu Sans, free licence, see assets/) so PNG text
//! renders the same on every machine without system fonts.
//!
//! Also the report plots: lines with shaded bands ([`draw_bands`]), a loss / difference-to-baseline
//! pair ([`draw_loss_panels`]) and parameter efficiency ([`draw_param_efficiency`]). They share one
//! print-safe palette (Okabe–Ito) plus a marker shape per series, put the legend outside the data,
//! label counts with [`fmt_count`] and ignore non-finite values; without any data they still write
//! a PNG that says "no data".

use std::fmt::Display;
use std::path::Path;
use std::sync::Once;

use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint};
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");
static INIT: Once = Once::new();

/// Registers the bundled font as "sans-serif"; call before drawing any text.
pub fn init_fonts() {
    INIT.call_once(|| {
        let _ = plotters::style::register_font("sans-serif", plotters::style::FontStyle::Normal, FONT);
    });
}

/// Compact count for axis labels and text: 950, 12k, 200k, 1.5M, 2M, 3.2B (no trailing ".0").
///
/// Values a tick can land on keep up to two decimals (1.25M, 12.5k); other values are rounded to
/// one decimal below 10 of a unit and to whole units above (12_345 -> "12k"). Below 1 the value
/// keeps three significant digits (0.25, 0.00123). Non-finite values print as Rust prints them.
pub fn fmt_count(x: f64) -> String {
    if !x.is_finite() {
        return format!("{x}");
    }
    const UNITS: [(f64, &str); 5] = [(1.0, ""), (1e3, "k"), (1e6, "M"), (1e9, "B"), (1e12, "T")];
    let a = x.abs();
    let mut u = UNITS.iter().rposition(|&(s, _)| a >= s).unwrap_or(0);
    loop {
        let (scale, suffix) = UNITS[u];
        let txt = short_num(a / scale);
        if u + 1 < UNITS.len() && txt.parse::<f64>().is_ok_and(|v| v >= 1000.0) {
            u += 1;
            continue;
        }
        if txt == "0" {
            return txt;
        }
        let sign = if x < 0.0 { "-" } else { "" };
        return format!("{sign}{txt}{suffix}");
    }
}

fn short_num(s: f64) -> String {
    for d in 0..=2 {
        let t = format!("{s:.d$}");
        if t.parse::<f64>().is_ok_and(|v| (v - s).abs() <= 1e-6 * s.max(1e-300)) {
            return trim_zeros(t);
        }
    }
    let t = if s >= 10.0 {
        format!("{s:.0}")
    } else if s >= 1.0 {
        format!("{s:.1}")
    } else {
        let d = (2 - s.log10().floor() as i64).clamp(0, 12) as usize;
        format!("{s:.d$}")
    };
    trim_zeros(t)
}

fn trim_zeros(t: String) -> String {
    if t.contains('.') {
        t.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        t
    }
}

/// One series of a band plot: x values with a centre line and a lower/upper band
/// (e.g. mean and 95% CI over seeds).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Band {
    pub label: String,
    pub points: Vec<BandPoint>,
}

/// One x position of a [`Band`]: centre `mid` and band `lo..hi`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BandPoint {
    pub x: f64,
    pub mid: f64,
    pub lo: f64,
    pub hi: f64,
}

/// One family of a parameter-efficiency plot.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EfficiencySeries {
    pub label: String,
    /// (parameters, mid, lo, hi)
    pub points: Vec<(f64, f64, f64, f64)>,
    /// (a, b) of loss = a + b·ln(params)
    pub fit: Option<(f64, f64)>,
}

// ---------------------------------------------------------------------------------------------
// shared pieces

/// Okabe–Ito colours (colour-blind safe, distinct in print), most contrasting first; yellow left out.
const PALETTE: [RGBColor; 7] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
    RGBColor(0, 0, 0),
];
const N_SHAPES: usize = 5;
const GRID: RGBColor = RGBColor(222, 222, 222);
const FONT_NAME: &str = "sans-serif";

fn colour(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// Series i gets colour i and shape i; past the palette the shape still changes so entries stay distinct.
fn shape(i: usize) -> usize {
    (i + i / PALETTE.len()) % N_SHAPES
}

type Root<'a> = DrawingArea<BitMapBackend<'a>, Shift>;

/// Maps any plotters error to a one-line anyhow error naming the file.
fn pe<E: Display>(path: &Path) -> impl Fn(E) -> anyhow::Error + '_ {
    move |e| {
        let msg = e.to_string().split_whitespace().collect::<Vec<_>>().join(" ");
        anyhow::anyhow!("plot {}: {msg}", path.display())
    }
}

fn fin(v: f64) -> bool {
    v.is_finite()
}

/// Range of the finite values with `margin` (a fraction of the span) on each side; a single value
/// gets ±10 % (±1 at 0). None when nothing is finite.
fn span(vals: impl IntoIterator<Item = f64>, margin: f64) -> Option<(f64, f64)> {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in vals.into_iter().filter(|v| v.is_finite()) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if lo > hi {
        return None;
    }
    if hi - lo <= 1e-12 * lo.abs().max(hi.abs()) {
        let pad = if lo == 0.0 { 1.0 } else { lo.abs() * 0.1 };
        return Some((lo - pad, hi + pad));
    }
    let pad = (hi - lo) * margin;
    Some((lo - pad, hi + pad))
}

/// x range: 2 % margin, but never below 0 for data that starts at or above 0.
fn x_span(vals: impl IntoIterator<Item = f64>) -> Option<(f64, f64)> {
    let v: Vec<f64> = vals.into_iter().filter(|v| v.is_finite()).collect();
    let (lo, hi) = span(v.iter().copied(), 0.02)?;
    let min = v.iter().copied().fold(f64::INFINITY, f64::min);
    let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    // a single x stays centred; a range starting at or above 0 is not padded below 0
    Some((if min >= 0.0 && lo < 0.0 && max > min { 0.0 } else { lo }, hi))
}

/// Tick label for a linear axis spanning `span`: enough decimals for the tick step, trailing zeros and "-0" dropped.
fn fmt_tick(v: f64, span: f64) -> String {
    let d = if span > 0.0 && span.is_finite() { (2 - span.log10().floor() as i64).clamp(0, 10) as usize } else { 3 };
    let t = trim_zeros(format!("{v:.d$}"));
    if t == "-0" {
        "0".into()
    } else {
        t
    }
}

fn text_style(size: u32) -> TextStyle<'static> {
    (FONT_NAME, size).into_font().color(&BLACK)
}

fn centred(size: u32, colour: RGBColor) -> TextStyle<'static> {
    (FONT_NAME, size).into_font().color(&colour).pos(Pos::new(HPos::Center, VPos::Center))
}

type DErr = DrawingAreaErrorKind<<BitMapBackend<'static> as DrawingBackend>::ErrorType>;

/// Marker `shape` of radius r centred on `p` (pixels of `area`).
fn marker(area: &Root, p: (i32, i32), shape: usize, c: RGBColor, r: i32) -> Result<(), DErr> {
    let (x, y) = p;
    let fill = c.filled();
    match shape % N_SHAPES {
        0 => area.draw(&Circle::new((x, y), r, fill)),
        1 => area.draw(&Polygon::new(vec![(x, y - r - 1), (x - r - 1, y + r), (x + r + 1, y + r)], fill)),
        2 => area.draw(&Rectangle::new([(x - r + 1, y - r + 1), (x + r - 1, y + r - 1)], fill)),
        3 => area.draw(&Polygon::new(vec![(x, y - r - 1), (x + r + 1, y), (x, y + r + 1), (x - r - 1, y)], fill)),
        _ => area.draw(&Polygon::new(vec![(x, y + r + 1), (x - r - 1, y - r), (x + r + 1, y - r)], fill)),
    }
}

/// Writes "no data" in the middle of `area` under its caption, with a light frame.
fn no_data(area: &Root, caption: &str) -> Result<(), DErr> {
    let (w, h) = area.dim_in_pixel();
    let (w, h) = (w as i32, h as i32);
    area.draw(&Rectangle::new([(10, 34), (w - 10, h - 10)], GRID.stroke_width(1)))?;
    area.draw_text(caption, &centred(16, BLACK), (w / 2, 18))?;
    area.draw_text("no data", &centred(20, RGBColor(120, 120, 120)), (w / 2, h / 2))
}

struct LegendEntry {
    label: String,
    ci: usize,
    /// shaded swatch behind the sample (band plots)
    band: bool,
    /// vertical error bar instead of a line sample (efficiency points)
    errbar: bool,
    /// dashed line sample (fitted line)
    dashed: bool,
}

const LEGEND_ROW: i32 = 22;
const LEGEND_TEXT_X: i32 = 48;

/// Width of the legend column: the widest label, between 110 px and `max_w` (longer labels are cut).
fn legend_width(root: &Root, entries: &[LegendEntry], max_w: u32) -> u32 {
    let font = text_style(13);
    let widest = entries.iter().map(|e| root.estimate_text_size(&e.label, &font).map_or(0, |s| s.0)).max();
    (widest.unwrap_or(0) + LEGEND_TEXT_X as u32 + 10).clamp(110, max_w.max(110))
}

/// Legend rows from pixel row `top` of `area` (a column beside the plots, so it never covers data).
fn draw_legend(area: &Root, entries: &[LegendEntry], top: i32) -> Result<(), DErr> {
    let font = text_style(13).pos(Pos::new(HPos::Left, VPos::Center));
    let room = area.dim_in_pixel().0.saturating_sub(LEGEND_TEXT_X as u32 + 4);
    let width = |s: &str| area.estimate_text_size(s, &font).map_or(0, |s| s.0);
    for (k, e) in entries.iter().enumerate() {
        let y = top + LEGEND_ROW * k as i32;
        let c = colour(e.ci);
        if e.band {
            area.draw(&Rectangle::new([(6, y - 7), (40, y + 7)], c.mix(0.2).filled()))?;
        }
        if e.dashed {
            for x0 in [6, 19, 32] {
                area.draw(&PathElement::new(vec![(x0, y), (x0 + 8, y)], c.stroke_width(2)))?;
            }
        } else if e.errbar {
            area.draw(&PathElement::new(vec![(6, y), (40, y)], c.stroke_width(1)))?;
        } else {
            area.draw(&PathElement::new(vec![(6, y), (40, y)], c.stroke_width(2)))?;
        }
        if e.errbar {
            area.draw(&PathElement::new(vec![(23, y - 8), (23, y + 8)], c.stroke_width(2)))?;
        }
        marker(area, (23, y), shape(e.ci), c, 4)?;
        let mut label = e.label.clone();
        if width(&label) > room {
            let mut chars: Vec<char> = label.chars().collect();
            while chars.len() > 3 && width(&format!("{}…", chars.iter().collect::<String>())) > room {
                chars.pop();
            }
            label = format!("{}…", chars.iter().collect::<String>());
        }
        area.draw_text(&label, &font, (LEGEND_TEXT_X, y))?;
    }
    Ok(())
}

/// Finite points of a band sorted by x (x and mid finite; lo/hi may still be NaN).
fn clean(b: &Band) -> Vec<BandPoint> {
    let mut p: Vec<BandPoint> = b.points.iter().copied().filter(|p| fin(p.x) && fin(p.mid)).collect();
    p.sort_by(|a, b| a.x.total_cmp(&b.x));
    p
}

/// One band chart in `area`: caption, axes (x labelled with fmt_count), bands, lines, markers, zero line.
/// `series` pairs each band with its colour index. Returns Ok(false) when there was nothing finite to draw.
#[allow(clippy::too_many_arguments)]
fn band_chart(
    root: &Root,
    area: &Root,
    caption: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[(usize, Vec<BandPoint>)],
    zero_line: bool,
    x_labels: usize,
) -> Result<bool, DErr> {
    let all = || series.iter().flat_map(|(_, p)| p.iter());
    let xs = x_span(all().map(|p| p.x));
    let ys = span(
        all().flat_map(|p| [p.mid, p.lo, p.hi]).chain(if zero_line && xs.is_some() { Some(0.0) } else { None }),
        0.05,
    );
    let (Some((x0, x1)), Some((y0, y1))) = (xs, ys) else {
        no_data(area, caption)?;
        return Ok(false);
    };
    let mut builder = ChartBuilder::on(area);
    builder.margin(8).margin_right(18).x_label_area_size(46).y_label_area_size(64);
    if !caption.is_empty() {
        builder.caption(caption, (FONT_NAME, 16));
    }
    let mut chart = builder.build_cartesian_2d(x0..x1, y0..y1)?;
    chart
        .configure_mesh()
        .light_line_style(TRANSPARENT)
        .bold_line_style(GRID.stroke_width(1))
        .x_labels(x_labels)
        .y_labels(8)
        .x_label_formatter(&|v| fmt_count(*v))
        .y_label_formatter(&|v| fmt_tick(*v, y1 - y0))
        .x_desc(x_desc)
        .y_desc(y_desc)
        .label_style((FONT_NAME, 13))
        .axis_desc_style((FONT_NAME, 14))
        .draw()?;
    if zero_line {
        let style = RGBColor(60, 60, 60).stroke_width(1);
        chart.draw_series(DashedLineSeries::new(vec![(x0, 0.0), (x1, 0.0)], 8, 6, style))?;
    }
    // bands first so that no band covers another family's line
    for (ci, pts) in series {
        let c = colour(*ci);
        for seg in pts.split(|p| !(fin(p.lo) && fin(p.hi))).filter(|s| s.len() > 1) {
            let mut poly: Vec<(f64, f64)> = seg.iter().map(|p| (p.x, p.hi)).collect();
            poly.extend(seg.iter().rev().map(|p| (p.x, p.lo)));
            chart.draw_series(std::iter::once(Polygon::new(poly, c.mix(0.18).filled())))?;
        }
    }
    let n = series.len().max(1);
    for (k, (ci, pts)) in series.iter().enumerate() {
        let c = colour(*ci);
        if pts.len() > 1 {
            chart.draw_series(LineSeries::new(pts.iter().map(|p| (p.x, p.mid)), c.stroke_width(2)))?;
        }
        // single points show their band as an error bar, nudged sideways so families do not cover each other
        if pts.len() == 1 {
            let p = pts[0];
            let nudge = ((k as f64 - (n as f64 - 1.0) / 2.0) * 9.0).round() as i32;
            if fin(p.lo) && fin(p.hi) {
                let (a, b) = (chart.backend_coord(&(p.x, p.lo)), chart.backend_coord(&(p.x, p.hi)));
                let x = a.0 + nudge;
                root.draw(&PathElement::new(vec![(x, a.1), (x, b.1)], c.stroke_width(2)))?;
                for y in [a.1, b.1] {
                    root.draw(&PathElement::new(vec![(x - 5, y), (x + 5, y)], c.stroke_width(2)))?;
                }
            }
            let (x, y) = chart.backend_coord(&(p.x, p.mid));
            marker(root, (x + nudge, y), shape(*ci), c, 4)?;
            continue;
        }
        // a few markers per line, staggered between series, so lines can be told apart without colour
        let marks = 6usize;
        let last = pts.len().saturating_sub(1);
        let mut idx: Vec<usize> = (0..marks)
            .map(|j| (((j as f64 + (k as f64 + 0.5) / n as f64) / marks as f64) * last as f64).round() as usize)
            .collect();
        idx.dedup();
        for i in idx.into_iter().filter(|&i| i < pts.len()) {
            marker(root, chart.backend_coord(&(pts[i].x, pts[i].mid)), shape(*ci), c, 4)?;
        }
    }
    Ok(true)
}

fn band_entries(labels: &[(usize, &str)]) -> Vec<LegendEntry> {
    labels
        .iter()
        .map(|&(ci, l)| LegendEntry { label: l.to_string(), ci, band: true, errbar: false, dashed: false })
        .collect()
}

/// Splits `root` below the title into the plot area and a legend column of the needed width.
fn with_legend<'a>(root: &Root<'a>, title: &str, entries: &[LegendEntry]) -> Result<(Root<'a>, Root<'a>), DErr> {
    let body = root.margin(6, 0, 0, 0).titled(title, (FONT_NAME, 20))?;
    let (w, _) = body.dim_in_pixel();
    let lw = if entries.is_empty() { 0 } else { legend_width(root, entries, w / 4) };
    let (plots, legend) = body.split_horizontally(w - lw);
    draw_legend(&legend, entries, 44)?;
    Ok((plots, legend))
}

// ---------------------------------------------------------------------------------------------
// public plots

/// Lines with shaded bands, one colour per series (a fixed palette that stays readable when printed),
/// legend outside or in a free corner, x axis labelled with fmt_count, optional horizontal reference line
/// at y = 0 (dashed) when `zero_line`.
///
/// Each line also carries a few markers of a per-series shape, so series can be told apart in grey print.
/// The legend sits in a column right of the plot. Points with a non-finite x or mid are skipped; a
/// non-finite lo/hi interrupts the band only. A series with a single point is drawn as a marker with an
/// error bar. Without any finite point the PNG says "no data".
pub fn draw_bands(
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[Band],
    zero_line: bool,
) -> anyhow::Result<()> {
    init_fonts();
    let root = BitMapBackend::new(path, (1000, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(pe(path))?;
    let pts: Vec<(usize, Vec<BandPoint>)> = series.iter().enumerate().map(|(i, b)| (i, clean(b))).collect();
    let labels: Vec<(usize, &str)> = series.iter().enumerate().map(|(i, b)| (i, b.label.as_str())).collect();
    let entries = band_entries(&labels);
    let (plots, _) = with_legend(&root, title, &entries).map_err(pe(path))?;
    band_chart(&root, &plots, "", x_desc, y_desc, &pts, zero_line, 8).map_err(pe(path))?;
    root.present().map_err(pe(path))?;
    Ok(())
}

/// Two panels side by side in one PNG: left = draw_bands-style loss vs tokens for every family; right =
/// the difference to the baseline (family − baseline, with its band) vs tokens and a dashed zero line, so
/// one sees at a glance where families separate.
///
/// A `delta` series takes the colour, marker and legend entry of the `loss` series with the same label, or
/// failing that of the loss series whose label starts its own (so "diff-v1 − baseline" matches "diff-v1");
/// otherwise it gets its own colour and legend entry. Each panel says "no data" on its own when empty.
pub fn draw_loss_panels(path: &Path, title: &str, loss: &[Band], delta: &[Band]) -> anyhow::Result<()> {
    init_fonts();
    let root = BitMapBackend::new(path, (1500, 580)).into_drawing_area();
    root.fill(&WHITE).map_err(pe(path))?;
    let mut labels: Vec<(usize, &str)> = loss.iter().enumerate().map(|(i, b)| (i, b.label.as_str())).collect();
    let mut delta_ci = Vec::with_capacity(delta.len());
    for d in delta {
        let exact = loss.iter().position(|l| l.label == d.label);
        let prefix = || {
            loss.iter()
                .enumerate()
                .filter(|(_, l)| !l.label.is_empty() && d.label.starts_with(l.label.as_str()))
                .max_by_key(|(i, l)| (l.label.len(), std::cmp::Reverse(*i)))
                .map(|(i, _)| i)
        };
        let ci = match exact.or_else(prefix) {
            Some(i) => i,
            None => {
                let i = labels.len();
                labels.push((i, d.label.as_str()));
                i
            }
        };
        delta_ci.push(ci);
    }
    let entries = band_entries(&labels);
    let (plots, _) = with_legend(&root, title, &entries).map_err(pe(path))?;
    let halves = plots.split_evenly((1, 2));
    let lp: Vec<(usize, Vec<BandPoint>)> = loss.iter().enumerate().map(|(i, b)| (i, clean(b))).collect();
    let dp: Vec<(usize, Vec<BandPoint>)> = delta.iter().zip(&delta_ci).map(|(b, &ci)| (ci, clean(b))).collect();
    band_chart(&root, &halves[0], "loss", "tokens", "loss (nats)", &lp, false, 6).map_err(pe(path))?;
    let cap = "difference to baseline (family − baseline; below 0 = better)";
    band_chart(&root, &halves[1], cap, "tokens", "Δ loss (nats)", &dp, true, 6).map_err(pe(path))?;
    root.present().map_err(pe(path))?;
    Ok(())
}

/// Tick positions (values, not logs) for a log axis over lo..hi (both > 0): powers of ten, or 1-2-5 or
/// 1…9 steps per decade when the range is narrower, or plain linear steps inside one short range.
fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let (d0, d1) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
    let inside = |m: &[f64]| -> Vec<f64> {
        (d0..=d1)
            .flat_map(|d| m.iter().map(move |&k| k * 10f64.powi(d)))
            .filter(|&v| v >= lo * (1.0 - 1e-9) && v <= hi * (1.0 + 1e-9))
            .collect()
    };
    for m in [&[1.0][..], &[1.0, 2.0, 5.0], &[1.0, 2.0, 3.0, 5.0, 7.0], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]]
    {
        let t = inside(m);
        if t.len() >= 3 {
            let step = t.len().div_ceil(8);
            return t.into_iter().step_by(step).collect();
        }
    }
    // narrow range: linear 1-2-5 steps
    let raw = (hi - lo) / 4.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * mag).find(|s| *s >= raw).unwrap_or(10.0 * mag);
    let mut t = Vec::new();
    let mut v = (lo / step).ceil() * step;
    while v <= hi * (1.0 + 1e-12) && t.len() < 20 {
        t.push(v);
        v += step;
    }
    t
}

/// A linear f64 axis (used over log10 values) whose ticks are given, with formatting supplied by the caller.
struct TickAxis {
    lin: RangedCoordf64,
    ticks: Vec<f64>,
}

impl Ranged for TickAxis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;
    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        self.lin.map(v, limit)
    }
    fn key_points<H: KeyPointHint>(&self, hint: H) -> Vec<f64> {
        if hint.weight().allow_light_points() {
            Vec::new()
        } else {
            self.ticks.clone()
        }
    }
    fn range(&self) -> std::ops::Range<f64> {
        self.lin.range()
    }
}

/// Parameter efficiency: per family, points (parameters, loss) with vertical error bars (lo, hi) and, when
/// given, its fitted line loss = a + b·ln(params) drawn over the plotted range; log-scaled x axis labelled
/// with fmt_count.
///
/// Families at the same parameter count are nudged a few pixels apart so their error bars do not hide each
/// other. Without a fit the points of a family are joined by a thin line; with one, the fit is dashed and
/// its formula is shown in the legend. Points with non-positive or non-finite parameters or a non-finite
/// mid are skipped; without any the PNG says "no data".
pub fn draw_param_efficiency(path: &Path, title: &str, series: &[EfficiencySeries]) -> anyhow::Result<()> {
    init_fonts();
    let root = BitMapBackend::new(path, (1000, 580)).into_drawing_area();
    root.fill(&WHITE).map_err(pe(path))?;
    let fit_ok = |f: &Option<(f64, f64)>| f.filter(|(a, b)| fin(*a) && fin(*b));
    let entries: Vec<LegendEntry> = series
        .iter()
        .enumerate()
        .map(|(ci, s)| {
            let fit = fit_ok(&s.fit);
            let label = match fit {
                Some((a, b)) => {
                    let sign = if b < 0.0 { '−' } else { '+' };
                    format!("{}  (fit {} {sign} {}·ln N)", s.label, fmt_tick(a, 0.1), fmt_tick(b.abs(), 0.1))
                }
                None => s.label.clone(),
            };
            LegendEntry { label, ci, band: false, errbar: true, dashed: fit.is_some() }
        })
        .collect();
    let (plots, _) = with_legend(&root, title, &entries).map_err(pe(path))?;
    let pts: Vec<Vec<(f64, f64, f64, f64)>> = series
        .iter()
        .map(|s| {
            let mut p: Vec<_> = s.points.iter().copied().filter(|p| fin(p.0) && p.0 > 0.0 && fin(p.1)).collect();
            p.sort_by(|a, b| a.0.total_cmp(&b.0));
            p
        })
        .collect();
    let caption = "loss vs parameters (log scale; bars: lo–hi)";
    let Some((l0, l1)) = span(pts.iter().flatten().map(|p| p.0.log10()), 0.06) else {
        no_data(&plots, caption).map_err(pe(path))?;
        root.present().map_err(pe(path))?;
        return Ok(());
    };
    let (x0, x1) = (10f64.powf(l0), 10f64.powf(l1));
    let fit_ends = series.iter().filter_map(|s| fit_ok(&s.fit)).flat_map(|(a, b)| [a + b * x0.ln(), a + b * x1.ln()]);
    let (y0, y1) = span(pts.iter().flatten().flat_map(|p| [p.1, p.2, p.3]).chain(fit_ends), 0.06).unwrap_or((0.0, 1.0));
    let ticks: Vec<f64> = log_ticks(x0, x1).into_iter().map(f64::log10).collect();
    let mut chart = ChartBuilder::on(&plots)
        .caption(caption, (FONT_NAME, 16))
        .margin(8)
        .margin_right(18)
        .x_label_area_size(46)
        .y_label_area_size(64)
        .build_cartesian_2d(TickAxis { lin: (l0..l1).into(), ticks }, y0..y1)
        .map_err(pe(path))?;
    chart
        .configure_mesh()
        .light_line_style(TRANSPARENT)
        .bold_line_style(GRID.stroke_width(1))
        .y_labels(8)
        .x_label_formatter(&|v| fmt_count(10f64.powf(*v)))
        .y_label_formatter(&|v| fmt_tick(*v, y1 - y0))
        .x_desc("parameters (log scale)")
        .y_desc("loss (nats)")
        .label_style((FONT_NAME, 13))
        .axis_desc_style((FONT_NAME, 14))
        .draw()
        .map_err(pe(path))?;
    let n = series.len();
    for (ci, (s, p)) in series.iter().zip(&pts).enumerate() {
        let c = colour(ci);
        if let Some((a, b)) = fit_ok(&s.fit) {
            let line: Vec<(f64, f64)> = (0..=100)
                .map(|i| l0 + (l1 - l0) * i as f64 / 100.0)
                .map(|l| (l, a + b * (l * std::f64::consts::LN_10)))
                .collect();
            chart.draw_series(DashedLineSeries::new(line, 9, 6, c.stroke_width(2))).map_err(pe(path))?;
        }
        let nudge = ((ci as f64 - (n as f64 - 1.0) / 2.0) * 7.0).round() as i32;
        if fit_ok(&s.fit).is_none() && p.len() > 1 {
            let line = p.iter().map(|q| chart.backend_coord(&(q.0.log10(), q.1))).map(|(x, y)| (x + nudge, y));
            root.draw(&PathElement::new(line.collect::<Vec<_>>(), c.stroke_width(1))).map_err(pe(path))?;
        }
        for q in p {
            let (px, py) = chart.backend_coord(&(q.0.log10(), q.1));
            let px = px + nudge;
            if fin(q.2) && fin(q.3) {
                let (ylo, yhi) =
                    (chart.backend_coord(&(q.0.log10(), q.2)).1, chart.backend_coord(&(q.0.log10(), q.3)).1);
                let bar = |v: Vec<(i32, i32)>| PathElement::new(v, c.stroke_width(2));
                root.draw(&bar(vec![(px, ylo), (px, yhi)])).map_err(pe(path))?;
                root.draw(&bar(vec![(px - 5, ylo), (px + 5, ylo)])).map_err(pe(path))?;
                root.draw(&bar(vec![(px - 5, yhi), (px + 5, yhi)])).map_err(pe(path))?;
            }
            marker(&root, (px, py), shape(ci), c, 5).map_err(pe(path))?;
        }
    }
    root.present().map_err(pe(path))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use plotters::prelude::*;

    #[test]
    fn draws_a_png_with_text() {
        super::init_fonts();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.png");
        {
            let root = BitMapBackend::new(&path, (200, 100)).into_drawing_area();
            root.fill(&WHITE).unwrap();
            root.draw_text("difftx", &("sans-serif", 20).into_font().color(&BLACK), (10, 10)).unwrap();
            root.present().unwrap();
        }
        assert!(std::fs::metadata(&path).unwrap().len() > 100);
    }

    #[test]
    fn spans_and_ticks() {
        assert_eq!(super::span([f64::NAN, f64::INFINITY], 0.05), None);
        assert_eq!(super::span([0.0], 0.05), Some((-1.0, 1.0)));
        let (lo, hi) = super::span([1.0, 2.0, f64::NAN], 0.1).unwrap();
        assert!((lo - 0.9).abs() < 1e-12 && (hi - 2.1).abs() < 1e-12);
        assert_eq!(super::x_span([0.0, 100.0]), Some((0.0, 102.0)));
        assert_eq!(super::log_ticks(1e5, 2e8), vec![1e5, 1e6, 1e7, 1e8]);
        assert_eq!(super::log_ticks(1e6, 3e7), vec![1e6, 2e6, 5e6, 1e7, 2e7]);
        let t = super::log_ticks(1.1e6, 1.3e6);
        assert!(t.len() >= 2 && t.iter().all(|&v| (1.1e6..=1.3e6).contains(&v)), "{t:?}");
    }
}
