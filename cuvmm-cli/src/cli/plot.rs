//! Plain-SVG line charts for the tour's pictures.

/// One line of a chart.
pub struct Series {
    pub name: String,
    pub color: &'static str,
    pub dashed: bool,
    pub points: Vec<(f64, f64)>,
}

fn esc(t: &str) -> String {
    t.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

fn nice_max(v: f64) -> f64 {
    if v <= 0.0 {
        return 1.0;
    }
    let p = 10f64.powf(v.log10().floor());
    for m in [1.0, 2.0, 2.5, 5.0, 10.0] {
        if m * p >= v {
            return m * p;
        }
    }
    10.0 * p
}

/// A chart with a linear y axis from 0 and a linear or log2 x axis; `x_label_of` formats x ticks.
pub fn line_chart(
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    log_x: bool,
    x_label_of: &dyn Fn(f64) -> String,
) -> String {
    let (w, h, l, r, t, b) = (800.0, 420.0, 70.0, 230.0, 40.0, 55.0);
    let fx = |x: f64| if log_x { x.log2() } else { x };
    let xs: Vec<f64> = series.iter().flat_map(|s| s.points.iter().map(|p| fx(p.0))).collect();
    let (x0, x1) = xs.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
    let (x0, x1) = if x1 > x0 { (x0, x1) } else { (x0 - 1.0, x0 + 1.0) };
    let ymax = nice_max(series.iter().flat_map(|s| s.points.iter().map(|p| p.1)).fold(0.0, f64::max));
    let px = |x: f64| l + (fx(x) - x0) / (x1 - x0) * (w - l - r);
    let py = |y: f64| h - b - y / ymax * (h - t - b);
    let mut o = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{l}\" y=\"24\" font-size=\"15\">{}</text>\n",
        esc(title)
    );
    for i in 0..=5 {
        let y = ymax * i as f64 / 5.0;
        o += &format!(
            "<line x1=\"{l}\" y1=\"{0:.1}\" x2=\"{1:.1}\" y2=\"{0:.1}\" stroke=\"#e5e5e5\"/><text x=\"{2:.1}\" y=\"{3:.1}\" text-anchor=\"end\">{4}</text>\n",
            py(y),
            w - r,
            l - 6.0,
            py(y) + 4.0,
            if ymax >= 10.0 { format!("{y:.0}") } else { format!("{y:.2}") }
        );
    }
    let mut ticks: Vec<f64> = series.iter().flat_map(|s| s.points.iter().map(|p| p.0)).collect();
    ticks.sort_by(f64::total_cmp);
    ticks.dedup();
    let step = (ticks.len() / 8).max(1);
    for x in ticks.iter().step_by(step) {
        o += &format!(
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\n",
            px(*x),
            h - b + 18.0,
            esc(&x_label_of(*x))
        );
    }
    o += &format!("<line x1=\"{l}\" y1=\"{0}\" x2=\"{1}\" y2=\"{0}\" stroke=\"#444\"/>\n", h - b, w - r);
    o += &format!("<line x1=\"{l}\" y1=\"{t}\" x2=\"{l}\" y2=\"{0}\" stroke=\"#444\"/>\n", h - b);
    o += &format!(
        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\n",
        (l + w - r) / 2.0,
        h - 12.0,
        esc(x_label)
    );
    o += &format!(
        "<text transform=\"translate(18,{:.1}) rotate(-90)\" text-anchor=\"middle\">{}</text>\n",
        (t + h - b) / 2.0,
        esc(y_label)
    );
    for (i, s) in series.iter().enumerate() {
        let pts: Vec<String> = s.points.iter().map(|p| format!("{:.1},{:.1}", px(p.0), py(p.1))).collect();
        let dash = if s.dashed { " stroke-dasharray=\"6,4\"" } else { "" };
        o += &format!(
            "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"2\"{dash} points=\"{}\"/>\n",
            s.color,
            pts.join(" ")
        );
        let ly = t + 10.0 + 20.0 * i as f64;
        o += &format!(
            "<line x1=\"{0:.1}\" y1=\"{ly:.1}\" x2=\"{1:.1}\" y2=\"{ly:.1}\" stroke=\"{2}\" stroke-width=\"2\"{dash}/><text x=\"{3:.1}\" y=\"{4:.1}\">{5}</text>\n",
            w - r + 12.0,
            w - r + 40.0,
            s.color,
            w - r + 46.0,
            ly + 4.0,
            esc(&s.name)
        );
    }
    o + "</svg>\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chart_has_a_line_and_a_legend_entry_per_series() {
        let s = vec![
            Series { name: "a<b".into(), color: "#111", dashed: false, points: vec![(1.0, 2.0), (4.0, 8.0)] },
            Series { name: "c".into(), color: "#222", dashed: true, points: vec![(1.0, 1.0), (4.0, 3.0)] },
        ];
        let svg = line_chart("t", "x", "y", &s, true, &|x| format!("{x}"));
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("a&lt;b") && svg.contains("stroke-dasharray"));
        assert_eq!(nice_max(7.3), 10.0);
        assert_eq!(nice_max(0.0), 1.0);
        assert_eq!(nice_max(42.0), 50.0);
    }
}
