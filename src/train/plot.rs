//! Training curves from the JSON-lines logs: train loss, val loss, learning rate, gradient norm,
//! tokens/s and HellaSwag accuracy against step, one panel each, several runs overlaid; written
//! as PNG and SVG.

use anyhow::{bail, Context, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::{Path, PathBuf};

/// The curves of one run.
#[derive(Debug, Default, Clone)]
pub struct RunLog {
    pub name: String,
    pub train_loss: Vec<(f64, f64)>,
    pub val_loss: Vec<(f64, f64)>,
    pub lr: Vec<(f64, f64)>,
    pub grad_norm: Vec<(f64, f64)>,
    pub tok_per_s: Vec<(f64, f64)>,
    pub hellaswag: Vec<(f64, f64)>,
}

/// Read `log.jsonl` as `llmrs train` writes it. The run is named after its directory.
pub fn read_log(path: &Path) -> Result<RunLog> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let name = path
        .parent()
        .and_then(|p| p.file_name())
        .or_else(|| path.file_stem())
        .map_or_else(|| path.display().to_string(), |s| s.to_string_lossy().into_owned());
    let mut r = RunLog { name, ..Default::default() };
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("{}: line {} is not JSON", path.display(), i + 1))?;
        let Some(step) = v["step"].as_f64() else { bail!("{}: line {} has no step", path.display(), i + 1) };
        let put = |key: &str, into: &mut Vec<(f64, f64)>| {
            if let Some(x) = v[key].as_f64().filter(|x| x.is_finite()) {
                into.push((step, x));
            }
        };
        put("train_loss", &mut r.train_loss);
        put("val_loss", &mut r.val_loss);
        put("lr", &mut r.lr);
        put("grad_norm", &mut r.grad_norm);
        put("tok_per_s", &mut r.tok_per_s);
        put("hellaswag", &mut r.hellaswag);
    }
    // A resumed run appends steps it had already logged: keep the latest value of each step.
    for s in [&mut r.train_loss, &mut r.val_loss, &mut r.lr, &mut r.grad_norm, &mut r.tok_per_s, &mut r.hellaswag] {
        let mut seen = std::collections::BTreeMap::new();
        for &(x, y) in s.iter() {
            seen.insert(x as i64, y);
        }
        *s = seen.into_iter().map(|(x, y)| (x as f64, y)).collect();
    }
    Ok(r)
}

fn ensure_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // DejaVu Sans, embedded, so PNGs render the same on machines without system fonts.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular());
    });
}

/// Exponential moving average, for the noisy per-step train loss.
fn smooth(s: &[(f64, f64)], alpha: f64) -> Vec<(f64, f64)> {
    let mut acc = None;
    s.iter()
        .map(|&(x, y)| {
            let a = acc.map_or(y, |a: f64| alpha * a + (1.0 - alpha) * y);
            acc = Some(a);
            (x, a)
        })
        .collect()
}

/// A short, readable axis label: 11.0, 6.25, 850, 1.0e-3.
fn tick(y: f64) -> String {
    let a = y.abs();
    if a == 0.0 {
        "0".into()
    } else if !(1e-2..1e5).contains(&a) {
        format!("{y:.1e}")
    } else if a >= 100.0 {
        format!("{y:.0}")
    } else if a >= 10.0 {
        format!("{y:.1}")
    } else {
        format!("{y:.2}")
    }
}

type Pick = fn(&RunLog) -> &Vec<(f64, f64)>;

fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    title: &str,
    runs: &[RunLog],
    pick: Pick,
    smooth_it: bool,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let all: Vec<(f64, f64)> = runs.iter().flat_map(|r| pick(r).iter().copied()).collect();
    if all.is_empty() {
        area.titled(title, ("sans-serif", 22))?.draw(&Text::new("no data", (20, 20), ("sans-serif", 16)))?;
        return Ok(());
    }
    let (x0, x1) = all.iter().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let (y0, y1) = all.iter().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
    let pad = ((y1 - y0) * 0.05).max(y1.abs() * 1e-3).max(1e-12);
    let x1 = if x1 > x0 { x1 } else { x0 + 1.0 };
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 22))
        .margin(10)
        .x_label_area_size(32)
        .y_label_area_size(64)
        .build_cartesian_2d(x0..x1, (y0 - pad)..(y1 + pad))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .label_style(("sans-serif", 13))
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| tick(*y))
        .draw()?;
    for (i, r) in runs.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let pts = pick(r);
        if pts.is_empty() {
            continue;
        }
        if smooth_it && pts.len() > 10 {
            chart.draw_series(LineSeries::new(pts.iter().copied(), color.mix(0.25)))?;
            chart
                .draw_series(LineSeries::new(smooth(pts, 0.9), color.stroke_width(2)))?
                .label(&r.name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        } else {
            let series = chart.draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))?;
            series
                .label(&r.name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
            if pts.len() <= 60 {
                chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
            }
        }
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()?;
    Ok(())
}

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, runs: &[RunLog]) -> Result<()>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    let panels = root.split_evenly((2, 3));
    let spec: [(&str, Pick, bool); 6] = [
        ("train loss", |r| &r.train_loss, true),
        ("val loss", |r| &r.val_loss, false),
        ("learning rate", |r| &r.lr, false),
        ("grad norm", |r| &r.grad_norm, true),
        ("tokens/s", |r| &r.tok_per_s, true),
        ("HellaSwag acc_norm", |r| &r.hellaswag, false),
    ];
    for (area, (title, pick, sm)) in panels.iter().zip(spec) {
        panel(area, title, runs, pick, sm)?;
    }
    root.present()?;
    Ok(())
}

/// Draw `runs` to `OUT.png` and `OUT.svg` (the extension of `out`, if any, is replaced).
pub fn plot(runs: &[RunLog], out: &Path) -> Result<(PathBuf, PathBuf)> {
    if runs.is_empty() {
        bail!("no training logs to plot");
    }
    ensure_font();
    let (png, svg) = (out.with_extension("png"), out.with_extension("svg"));
    if let Some(d) = png.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(d)?;
    }
    let size = (1500, 900);
    let mut rgb = vec![0u8; 3 * size.0 as usize * size.1 as usize]; // (H, W, 3)
    draw(BitMapBackend::with_buffer(&mut rgb, size).into_drawing_area(), runs)
        .with_context(|| format!("cannot draw {}", png.display()))?;
    write_png(&png, &rgb, size)?;
    draw(SVGBackend::new(&svg, size).into_drawing_area(), runs)
        .with_context(|| format!("cannot draw {}", svg.display()))?;
    Ok((png, svg))
}

/// An RGB image (H, W, 3) as a PNG file, written whole or not at all.
fn write_png(path: &Path, rgb: &[u8], (w, h): (u32, u32)) -> Result<()> {
    crate::core::files::write_atomic_with(path, |f| {
        let mut enc = png::Encoder::new(f, w, h);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        let mut png = enc.write_header().map_err(std::io::Error::other)?;
        png.write_image_data(rgb).map_err(std::io::Error::other)
    })
    .with_context(|| format!("cannot write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_logs_and_draws_png_and_svg() {
        let dir = tempfile::tempdir().unwrap();
        let mut runs = vec![];
        for (k, name) in ["run_a", "run_b"].iter().enumerate() {
            let d = dir.path().join(name);
            std::fs::create_dir_all(&d).unwrap();
            let mut log = String::new();
            for s in 0..50 {
                let loss = 10.0 / (1.0 + s as f64 * 0.1) + k as f64 * 0.3;
                log += &format!("{{\"step\":{s},\"train_loss\":{loss},\"lr\":0.001,\"grad_norm\":1.5,\"ms\":10.0,\"tok_per_s\":{}}}\n", 1000 + s);
                if s % 10 == 0 {
                    log += &format!("{{\"step\":{s},\"val_loss\":{}}}\n", loss + 0.1);
                }
            }
            log += "{\"step\":49,\"train_loss\":1.0}\n"; // resumed: a later value for a step
            std::fs::write(d.join("log.jsonl"), log).unwrap();
            runs.push(read_log(&d.join("log.jsonl")).unwrap());
        }
        assert_eq!(runs[0].name, "run_a");
        assert_eq!((runs[0].train_loss.len(), runs[0].val_loss.len()), (50, 5));
        assert_eq!(runs[0].train_loss[49], (49.0, 1.0));
        let (png, svg) = plot(&runs, &dir.path().join("curves")).unwrap();
        let bytes = std::fs::read(&png).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        let svg = std::fs::read_to_string(svg).unwrap();
        assert!(svg.contains("<svg") && svg.contains("train loss") && svg.contains("run_b"));
        std::fs::write(dir.path().join("bad.jsonl"), "{\"train_loss\": 1}\n").unwrap();
        assert!(read_log(&dir.path().join("bad.jsonl")).is_err());
    }
}
