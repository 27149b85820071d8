//! The loss curve: `loss.csv` and a hand-written SVG (no plotting dependency) with the raw
//! training loss, its moving average, the held-out loss, axes with ticks and a legend.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::Path;

const W: f64 = 800.0;
const H: f64 = 480.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 60.0;

/// One line of the plot: `(step, loss)` points, a colour, a width, a legend label.
pub struct Series<'a> {
    pub points: &'a [(f64, f64)],
    pub color: &'a str,
    pub width: f64,
    pub label: &'a str,
    pub dots: bool,
}

/// Writes `out/loss.csv` (step, training loss, held-out loss where evaluated) and
/// `out/loss.svg`; `train` and `val` are `(step, loss)` points.
pub fn write_curves(
    out: &Path,
    title: &str,
    train: &[(f64, f64)],
    val: &[(f64, f64)],
) -> std::io::Result<()> {
    let val_at: BTreeMap<u64, f64> = val.iter().map(|&(s, v)| (s as u64, v)).collect();
    let mut csv = String::from("step,train_loss,heldout_loss\n");
    if let Some(v) = val_at.get(&0) {
        let _ = writeln!(csv, "0,,{v:.5}");
    }
    for &(s, l) in train {
        let v = val_at.get(&(s as u64)).map(|v| format!("{v:.5}"));
        let _ = writeln!(csv, "{s},{l:.5},{}", v.unwrap_or_default());
    }
    std::fs::write(out.join("loss.csv"), csv)?;

    // Trailing moving average of the training loss over ~steps/30 steps.
    let win = (train.len() / 30).max(1);
    let smooth: Vec<(f64, f64)> = (0..train.len())
        .map(|i| {
            let w = &train[i.saturating_sub(win - 1)..=i];
            let mean = w.iter().map(|p| p.1).sum::<f64>() / w.len() as f64;
            (train[i].0, mean)
        })
        .collect();
    let label = format!("train (mean of {win})");
    let mut series = vec![
        Series {
            points: train,
            color: "#9ecae1",
            width: 1.0,
            label: "train (per step)",
            dots: false,
        },
        Series {
            points: val,
            color: "#e6550d",
            width: 2.0,
            label: "held-out",
            dots: true,
        },
    ];
    if win > 1 {
        let smooth = Series {
            points: &smooth,
            color: "#08519c",
            width: 2.0,
            label: &label,
            dots: false,
        };
        series.insert(1, smooth);
    }
    let max_step = train.last().map_or(1.0, |p| p.0);
    std::fs::write(out.join("loss.svg"), loss_svg(title, &series, max_step))
}

/// "Nice" tick spacing: 1, 2 or 5 times a power of ten, about `n` ticks over `span`.
fn tick_step(span: f64, n: f64) -> f64 {
    let raw = (span / n).max(f64::MIN_POSITIVE);
    let mag = 10f64.powf(raw.log10().floor());
    let r = raw / mag;
    mag * if r < 1.5 {
        1.0
    } else if r < 3.5 {
        2.0
    } else if r < 7.5 {
        5.0
    } else {
        10.0
    }
}

fn fmt_tick(v: f64, step: f64) -> String {
    let decimals = (-step.log10().floor()).max(0.0) as usize;
    format!("{v:.decimals$}")
}

/// Renders `series` against steps `0..=max_step`; the y axis spans all points.
pub fn loss_svg(title: &str, series: &[Series], max_step: f64) -> String {
    let ys = series.iter().flat_map(|s| s.points.iter().map(|p| p.1));
    let (mut lo, mut hi) = ys.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), y| {
        (a.min(y), b.max(y))
    });
    if !lo.is_finite() || !hi.is_finite() {
        (lo, hi) = (0.0, 1.0);
    }
    let ystep = tick_step(hi - lo, 6.0);
    let (lo, hi) = ((lo / ystep).floor() * ystep, (hi / ystep).ceil() * ystep);
    let hi = if hi > lo { hi } else { lo + ystep };
    let xmax = max_step.max(1.0);
    let xstep = tick_step(xmax, 8.0);
    let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
    let sx = |x: f64| LEFT + x / xmax * pw;
    let sy = |y: f64| TOP + (hi - y) / (hi - lo) * ph;

    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="DejaVu Sans, Arial, sans-serif" font-size="13">"#
    );
    let _ = writeln!(s, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="28" text-anchor="middle" font-size="16">{}</text>"#,
        W / 2.0,
        escape(title)
    );
    // Grid and ticks.
    let mut y = lo;
    while y <= hi + ystep * 1e-6 {
        let py = sy(y);
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}" stroke="#e5e5e5"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            W - RIGHT,
            LEFT - 8.0,
            py + 4.0,
            fmt_tick(y, ystep)
        );
        y += ystep;
    }
    let mut x = 0.0;
    while x <= xmax + xstep * 1e-6 {
        let px = sx(x);
        let _ = writeln!(
            s,
            r##"<line x1="{px:.1}" y1="{TOP}" x2="{px:.1}" y2="{:.1}" stroke="#f0f0f0"/><text x="{px:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            H - BOTTOM,
            H - BOTTOM + 18.0,
            fmt_tick(x, xstep)
        );
        x += xstep;
    }
    let _ = writeln!(
        s,
        r#"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="black"/>"#
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">step</text>"#,
        LEFT + pw / 2.0,
        H - 18.0
    );
    let _ = writeln!(
        s,
        r#"<text transform="translate(20 {:.1}) rotate(-90)" text-anchor="middle">loss (nats/byte)</text>"#,
        TOP + ph / 2.0
    );
    // Series and legend.
    for (i, ser) in series.iter().enumerate() {
        let pts: Vec<String> = ser
            .points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{}" stroke-width="{}" points="{}"/>"#,
            ser.color,
            ser.width,
            pts.join(" ")
        );
        if ser.dots {
            for &(x, y) in ser.points {
                let _ = writeln!(
                    s,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="3.5" fill="{}"/>"#,
                    sx(x),
                    sy(y),
                    ser.color
                );
            }
        }
        let ly = TOP + 20.0 + 20.0 * i as f64;
        let lx = W - RIGHT - 210.0;
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{}" stroke-width="3"/><text x="{}" y="{}">{}</text>"#,
            lx + 24.0,
            ser.color,
            lx + 32.0,
            ly + 4.0,
            escape(ser.label)
        );
    }
    s.push_str("</svg>\n");
    s
}

fn escape(t: &str) -> String {
    t.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
