//! A small hand-written SVG line-chart writer: axes with "nice" ticks and labels, one polyline
//! per series, a legend when there are several.

use std::fmt::Write;

/// One curve of a [`LineChart`].
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// The legend label.
    pub label: String,
    /// `(x, y)` points; non-finite ones are skipped when drawing.
    pub points: Vec<(f64, f64)>,
    /// `(x, low, high)`: a band drawn shaded behind the curve in its colour (a spread over
    /// seeds); empty for none.
    pub band: Vec<(f64, f64, f64)>,
}

impl Series {
    /// A series from a label and points.
    pub fn new(label: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Self {
            label: label.into(),
            points,
            band: Vec::new(),
        }
    }

    /// The series with a band `(x, low, high)` shaded behind it.
    pub fn with_band(mut self, band: Vec<(f64, f64, f64)>) -> Self {
        self.band = band;
        self
    }

    /// The finite band points, sorted by x.
    fn finite_band(&self) -> Vec<(f64, f64, f64)> {
        let mut pts: Vec<(f64, f64, f64)> = self
            .band
            .iter()
            .copied()
            .filter(|(x, lo, hi)| x.is_finite() && lo.is_finite() && hi.is_finite())
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        pts
    }

    /// The finite points, sorted by x (stable).
    fn finite_points(&self) -> Vec<(f64, f64)> {
        let mut pts: Vec<(f64, f64)> = self
            .points
            .iter()
            .copied()
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        pts
    }
}

/// A line chart: a title, axis labels and series.
#[derive(Debug, Clone, PartialEq)]
pub struct LineChart {
    /// The title, drawn above the plot.
    pub title: String,
    /// The label under the x axis.
    pub x_label: String,
    /// The label left of the y axis.
    pub y_label: String,
    /// The curves.
    pub series: Vec<Series>,
}

const WIDTH: f64 = 720.0;
const HEIGHT: f64 = 400.0;
const LEFT: f64 = 78.0;
const RIGHT: f64 = 24.0;
const TOP: f64 = 44.0;
const BOTTOM: f64 = 56.0;
/// Series with at most this many points also get a dot on each point.
const MARKERS_UP_TO: usize = 60;
const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

/// Escapes text for SVG content and attribute values.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c if (c as u32) < 0x20 && c != '\t' && c != '\n' => {}
            c => out.push(c),
        }
    }
    out
}

/// A "nice" step (1, 2 or 5 times a power of ten) close to `raw`.
fn nice_step(raw: f64) -> f64 {
    let exp = raw.log10().floor();
    let base = 10f64.powf(exp);
    let frac = raw / base;
    let nice = if frac <= 1.0 {
        1.0
    } else if frac <= 2.0 {
        2.0
    } else if frac <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * base
}

/// The axis domain and tick values for data in `[lo, hi]` with about `target` intervals.
fn ticks(lo: f64, hi: f64, target: usize) -> (f64, f64, Vec<f64>, f64) {
    let (lo, hi) = if hi > lo {
        (lo, hi)
    } else {
        let pad = if lo == 0.0 { 1.0 } else { lo.abs() * 0.1 };
        (lo - pad, hi + pad)
    };
    let step = nice_step((hi - lo) / target.max(1) as f64);
    let start = (lo / step).floor() * step;
    let end = (hi / step).ceil() * step;
    let n = ((end - start) / step).round() as usize;
    let values = (0..=n).map(|i| start + i as f64 * step).collect();
    (start, end, values, step)
}

/// A tick label: as many decimals as the step needs, scientific notation for very large or
/// very small magnitudes.
fn tick_label(v: f64, step: f64) -> String {
    if v.abs() < step * 1e-9 {
        return "0".to_string();
    }
    if v.abs() >= 1e6 || step < 1e-4 {
        return format!("{v:.2e}");
    }
    let decimals = (-step.log10().floor()).max(0.0) as usize;
    format!("{v:.decimals$}")
}

impl LineChart {
    /// A chart with a title, `step` on the x axis and no series yet.
    pub fn new(title: impl Into<String>) -> Self {
        Self {
            title: title.into(),
            x_label: "step".into(),
            y_label: String::new(),
            series: Vec::new(),
        }
    }

    /// Adds a series.
    pub fn with_series(mut self, series: Series) -> Self {
        self.series.push(series);
        self
    }

    /// Sets the y-axis label.
    pub fn with_y_label(mut self, label: impl Into<String>) -> Self {
        self.y_label = label.into();
        self
    }

    /// How many finite points the chart draws, over all series.
    pub fn point_count(&self) -> usize {
        self.series.iter().map(|s| s.finite_points().len()).sum()
    }

    /// Renders the chart as a standalone SVG document.
    pub fn to_svg(&self) -> String {
        let series: Vec<(&Series, Vec<(f64, f64)>)> =
            self.series.iter().map(|s| (s, s.finite_points())).collect();
        let mut all: Vec<(f64, f64)> = series.iter().flat_map(|(_, p)| p.iter().copied()).collect();
        let bands: Vec<Vec<(f64, f64, f64)>> =
            self.series.iter().map(Series::finite_band).collect();
        all.extend(
            bands
                .iter()
                .flatten()
                .flat_map(|&(x, lo, hi)| [(x, lo), (x, hi)]),
        );
        let (x0, x1, y0, y1) = if all.is_empty() {
            (0.0, 1.0, 0.0, 1.0)
        } else {
            let fold = |f: fn(&(f64, f64)) -> f64| {
                all.iter()
                    .map(f)
                    .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
                        (lo.min(v), hi.max(v))
                    })
            };
            let (x0, x1) = fold(|p| p.0);
            let (y0, y1) = fold(|p| p.1);
            (x0, x1, y0, y1)
        };
        let (xa, xb, xticks, xstep) = ticks(x0, x1, 8);
        let (ya, yb, yticks, ystep) = ticks(y0, y1, 5);
        let frame = Frame {
            xa,
            xb,
            ya,
            yb,
            pw: WIDTH - LEFT - RIGHT,
            ph: HEIGHT - TOP - BOTTOM,
        };

        let mut s = String::new();
        self.write_frame(&mut s, &frame, (&xticks, xstep), (&yticks, ystep));
        if all.is_empty() {
            let _ = writeln!(
                s,
                r##"<text x="{:.2}" y="{:.2}" text-anchor="middle" fill="#888888">no data</text>"##,
                LEFT + frame.pw / 2.0,
                TOP + frame.ph / 2.0
            );
        }
        write_bands(&mut s, &frame, &bands);
        write_curves(&mut s, &frame, &series);
        write_legend(&mut s, &frame, &series);
        s.push_str("</svg>\n");
        s
    }

    /// The document's head, the title, the grid, the axes with their tick labels and the axis
    /// labels.
    fn write_frame(
        &self,
        s: &mut String,
        frame: &Frame,
        (xticks, xstep): (&[f64], f64),
        (yticks, ystep): (&[f64], f64),
    ) {
        let (pw, ph) = (frame.pw, frame.ph);
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(s, "<title>{}</title>", escape(&self.title));
        let _ = writeln!(
            s,
            r#"<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="white"/>"#
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="24" text-anchor="middle" font-size="16" font-weight="bold">{}</text>"#,
            WIDTH / 2.0,
            escape(&self.title)
        );
        // Grid and ticks.
        let _ = writeln!(s, r##"<g class="grid" stroke="#e0e0e0" stroke-width="1">"##);
        for &t in xticks {
            let x = frame.sx(t);
            let _ = writeln!(
                s,
                r#"<line x1="{x:.2}" y1="{TOP:.2}" x2="{x:.2}" y2="{:.2}"/>"#,
                TOP + ph
            );
        }
        for &t in yticks {
            let y = frame.sy(t);
            let _ = writeln!(
                s,
                r#"<line x1="{LEFT:.2}" y1="{y:.2}" x2="{:.2}" y2="{y:.2}"/>"#,
                LEFT + pw
            );
        }
        let _ = writeln!(s, "</g>");
        let _ = writeln!(
            s,
            r##"<g class="axes" stroke="#333333" stroke-width="1"><line x1="{LEFT:.2}" y1="{:.2}" x2="{:.2}" y2="{:.2}"/><line x1="{LEFT:.2}" y1="{TOP:.2}" x2="{LEFT:.2}" y2="{:.2}"/></g>"##,
            TOP + ph,
            LEFT + pw,
            TOP + ph,
            TOP + ph
        );
        let _ = writeln!(s, r#"<g class="xticks" text-anchor="middle">"#);
        for &t in xticks {
            let _ = writeln!(
                s,
                r#"<text x="{:.2}" y="{:.2}">{}</text>"#,
                frame.sx(t),
                TOP + ph + 16.0,
                escape(&tick_label(t, xstep))
            );
        }
        let _ = writeln!(s, "</g>");
        let _ = writeln!(s, r#"<g class="yticks" text-anchor="end">"#);
        for &t in yticks {
            let _ = writeln!(
                s,
                r#"<text x="{:.2}" y="{:.2}">{}</text>"#,
                LEFT - 6.0,
                frame.sy(t) + 4.0,
                escape(&tick_label(t, ystep))
            );
        }
        let _ = writeln!(s, "</g>");
        let _ = writeln!(
            s,
            r#"<text class="xlabel" x="{:.2}" y="{:.2}" text-anchor="middle">{}</text>"#,
            LEFT + pw / 2.0,
            HEIGHT - 12.0,
            escape(&self.x_label)
        );
        if !self.y_label.is_empty() {
            let (x, y) = (16.0, TOP + ph / 2.0);
            let _ = writeln!(
                s,
                r#"<text class="ylabel" x="{x:.2}" y="{y:.2}" text-anchor="middle" transform="rotate(-90 {x:.2} {y:.2})">{}</text>"#,
                escape(&self.y_label)
            );
        }
    }
}

/// The plot area: the axis domains (`xa..xb`, `ya..yb`) and the plot's width and height in
/// pixels, which map data to SVG coordinates.
struct Frame {
    xa: f64,
    xb: f64,
    ya: f64,
    yb: f64,
    pw: f64,
    ph: f64,
}

impl Frame {
    /// The SVG x coordinate of data x.
    fn sx(&self, x: f64) -> f64 {
        LEFT + (x - self.xa) / (self.xb - self.xa) * self.pw
    }

    /// The SVG y coordinate of data y.
    fn sy(&self, y: f64) -> f64 {
        TOP + self.ph - (y - self.ya) / (self.yb - self.ya) * self.ph
    }
}

/// The series' bands, shaded behind every curve.
fn write_bands(s: &mut String, frame: &Frame, bands: &[Vec<(f64, f64, f64)>]) {
    for (i, band) in bands.iter().enumerate().filter(|(_, b)| !b.is_empty()) {
        let color = COLORS[i % COLORS.len()];
        let coords: Vec<String> = band
            .iter()
            .map(|&(x, _, hi)| format!("{:.2},{:.2}", frame.sx(x), frame.sy(hi)))
            .chain(
                band.iter()
                    .rev()
                    .map(|&(x, lo, _)| format!("{:.2},{:.2}", frame.sx(x), frame.sy(lo))),
            )
            .collect();
        let _ = writeln!(
            s,
            r#"<polygon class="band" fill="{color}" fill-opacity="0.18" stroke="none" points="{}"/>"#,
            coords.join(" ")
        );
    }
}

/// One polyline per series, with a dot on each point when it has few.
fn write_curves(s: &mut String, frame: &Frame, series: &[(&Series, Vec<(f64, f64)>)]) {
    for (i, (ser, pts)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let coords: Vec<String> = pts
            .iter()
            .map(|&(x, y)| format!("{:.2},{:.2}", frame.sx(x), frame.sy(y)))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline class="series" data-label="{}" fill="none" stroke="{color}" stroke-width="1.8" stroke-linejoin="round" points="{}"/>"#,
            escape(&ser.label),
            coords.join(" ")
        );
        if pts.len() <= MARKERS_UP_TO {
            let _ = writeln!(s, r#"<g class="markers" fill="{color}">"#);
            for &(x, y) in pts {
                let _ = writeln!(
                    s,
                    r#"<circle cx="{:.2}" cy="{:.2}" r="2.5"/>"#,
                    frame.sx(x),
                    frame.sy(y)
                );
            }
            let _ = writeln!(s, "</g>");
        }
    }
}

/// The legend, when there are several series.
fn write_legend(s: &mut String, frame: &Frame, series: &[(&Series, Vec<(f64, f64)>)]) {
    if series.len() > 1 {
        let width = series
            .iter()
            .map(|(ser, _)| ser.label.chars().count())
            .max()
            .unwrap_or(0) as f64
            * 7.0
            + 36.0;
        let (lx, ly) = (LEFT + frame.pw - width - 8.0, TOP + 8.0);
        let _ = writeln!(
            s,
            r##"<g class="legend"><rect x="{lx:.2}" y="{ly:.2}" width="{width:.2}" height="{:.2}" fill="white" fill-opacity="0.85" stroke="#cccccc"/>"##,
            series.len() as f64 * 16.0 + 8.0
        );
        for (i, (ser, _)) in series.iter().enumerate() {
            let y = ly + 16.0 + i as f64 * 16.0;
            let color = COLORS[i % COLORS.len()];
            let _ = writeln!(
                s,
                r#"<line x1="{:.2}" y1="{:.2}" x2="{:.2}" y2="{:.2}" stroke="{color}" stroke-width="2.5"/><text x="{:.2}" y="{:.2}">{}</text>"#,
                lx + 6.0,
                y - 4.0,
                lx + 24.0,
                y - 4.0,
                lx + 30.0,
                y,
                escape(&ser.label)
            );
        }
        let _ = writeln!(s, "</g>");
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use quick_xml::Reader;
    use quick_xml::events::Event;

    /// Parses `svg` with quick-xml (end tags must match) and returns, per `<polyline>`, its
    /// `data-label` and the number of points of its `points` attribute.
    pub(crate) fn polylines(svg: &str) -> Vec<(String, usize)> {
        let mut reader = Reader::from_str(svg);
        let mut depth = 0i64;
        let mut root = None;
        let mut out = Vec::new();
        loop {
            match reader.read_event().expect("well-formed SVG") {
                Event::Start(e) => {
                    if depth == 0 {
                        root = Some(String::from_utf8(e.name().as_ref().to_vec()).unwrap());
                    }
                    depth += 1;
                }
                Event::End(_) => depth -= 1,
                Event::Empty(e) if e.name().as_ref() == b"polyline" => {
                    let mut label = String::new();
                    let mut n = 0;
                    for a in e.attributes() {
                        let a = a.expect("well-formed attribute");
                        let v = a.unescape_value().unwrap().to_string();
                        match a.key.as_ref() {
                            b"data-label" => label = v,
                            b"points" => {
                                n = v.split_whitespace().count();
                                for p in v.split_whitespace() {
                                    let (x, y) = p.split_once(',').unwrap();
                                    let (x, y): (f64, f64) =
                                        (x.parse().unwrap(), y.parse().unwrap());
                                    assert!((0.0..=WIDTH).contains(&x), "{x}");
                                    assert!((0.0..=HEIGHT).contains(&y), "{y}");
                                }
                            }
                            _ => {}
                        }
                    }
                    out.push((label, n));
                }
                Event::Eof => break,
                _ => {}
            }
        }
        assert_eq!(depth, 0, "unbalanced tags");
        assert_eq!(root.as_deref(), Some("svg"));
        out
    }

    #[test]
    fn chart_is_well_formed_and_draws_every_finite_point() {
        let chart = LineChart::new("EM <train & eval>")
            .with_y_label("exact match")
            .with_series(Series::new(
                "train",
                (1..=30)
                    .map(|s| (s as f64, if s == 7 { f64::NAN } else { s as f64 / 30.0 }))
                    .collect(),
            ))
            .with_series(Series::new(
                "eval \"greedy\"",
                vec![(0.0, 0.1), (10.0, 0.3), (20.0, f64::INFINITY), (30.0, 0.5)],
            ));
        assert_eq!(chart.point_count(), 29 + 3);
        let svg = chart.to_svg();
        let lines = polylines(&svg);
        assert_eq!(
            lines,
            vec![("train".into(), 29), ("eval \"greedy\"".into(), 3)]
        );
        assert!(svg.contains("EM &lt;train &amp; eval&gt;"));
        assert!(svg.contains("class=\"legend\""));
        assert_eq!(svg.matches("<circle").count(), 32);
        // Tick labels on both axes: 0 to 30 by 5 on x.
        for label in [">0<", ">5<", ">30<", ">0.4<", ">1.0<"] {
            assert!(svg.contains(label), "missing tick {label}");
        }
    }

    #[test]
    fn a_band_is_shaded_behind_its_curve_and_widens_the_axis() {
        let chart = LineChart::new("seeds").with_series(
            Series::new("arm", vec![(0.0, 0.5), (1.0, 0.6)]).with_band(vec![
                (0.0, 0.4, 0.6),
                (1.0, 0.5, 2.0),
                (2.0, f64::NAN, 1.0),
            ]),
        );
        let svg = chart.to_svg();
        let band = svg.find("class=\"band\"").expect("a band polygon");
        assert!(
            band < svg.find("class=\"series\"").unwrap(),
            "the band is drawn first"
        );
        // Two finite band points: four corners; the band's high end (2.0) sets the y axis.
        let poly = &svg[band..svg[band..].find("/>").unwrap() + band];
        assert_eq!(
            poly.split("points=\"").nth(1).unwrap().split(' ').count(),
            4
        );
        assert!(svg.contains(">2.0<"), "the y axis reaches the band's top");
    }

    #[test]
    fn degenerate_charts_still_render() {
        // One point, a flat line, no data, huge and tiny values.
        for chart in [
            LineChart::new("one").with_series(Series::new("a", vec![(3.0, 2.0)])),
            LineChart::new("flat").with_series(Series::new("a", vec![(0.0, 0.0), (1.0, 0.0)])),
            LineChart::new("none").with_series(Series::new("a", vec![(1.0, f64::NAN)])),
            LineChart::new("empty"),
            LineChart::new("big").with_series(Series::new("a", vec![(0.0, 1e9), (1.0, 3e9)])),
            LineChart::new("tiny").with_series(Series::new("a", vec![(0.0, 1e-7), (1.0, 3e-7)])),
        ] {
            let svg = chart.to_svg();
            let lines = polylines(&svg);
            assert_eq!(
                lines.iter().map(|l| l.1).sum::<usize>(),
                chart.point_count(),
                "{}",
                chart.title
            );
            assert!(!svg.contains("NaN") && !svg.contains("inf"), "{svg}");
            assert!(!svg.contains("legend"));
        }
        assert!(LineChart::new("none").to_svg().contains("no data"));
    }

    #[test]
    fn ticks_are_nice() {
        let (lo, hi, t, step) = ticks(0.03, 0.97, 5);
        assert_eq!((lo, hi, step), (0.0, 1.0, 0.2));
        assert_eq!(t.len(), 6);
        assert_eq!(tick_label(t[1], step), "0.2");
        let (lo, hi, _, step) = ticks(1.0, 40.0, 8);
        assert_eq!((lo, hi, step), (0.0, 40.0, 5.0));
        assert_eq!(tick_label(-0.0, 0.5), "0");
        assert_eq!(tick_label(2.0e7, 1e7), "2.00e7");
        let (lo, hi, _, _) = ticks(5.0, 5.0, 5);
        assert!(lo < 5.0 && hi > 5.0);
    }
}
