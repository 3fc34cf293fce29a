//! The flows experiment's chart: pool bytes over bytes in flight against
//! the number of flows, one line per (cache, order), on log axes.

use std::ops::Range;
use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::FlowsRow;
use crate::report::{save_svg, OrDraw, ReportError};

/// Draws mean amplification against flows, one line per (cache, order).
pub fn write_svg(path: &Path, rows: &[FlowsRow]) -> Result<(), ReportError> {
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for r in rows {
        let name = format!("{} order {}", r.cache, r.order);
        let p = (r.flows as f64, r.amplification_mean.max(1e-3));
        match series.iter_mut().find(|s| s.0 == name) {
            Some(s) => s.1.push(p),
            None => series.push((name, vec![p])),
        }
    }
    let pts = || series.iter().flat_map(|s| s.1.iter());
    let xmax = pts().map(|p| p.0).fold(10.0f64, f64::max) * 1.5;
    let xmin = pts()
        .map(|p| p.0)
        .fold(f64::INFINITY, f64::min)
        .min(xmax / 10.0)
        / 1.5;
    let ymax = pts().map(|p| p.1).fold(2.0f64, f64::max) * 1.5;
    let ymin = pts().map(|p| p.1).fold(1.0f64, f64::min) / 1.5;
    save_svg(path, (900, 600), |root| {
        draw_chart(root, &series, (xmin..xmax, ymin..ymax))
    })
}

/// Draws `series` on `root`, over `xs` across and `ys` up (log axes).
fn draw_chart(
    root: &DrawingArea<SVGBackend<'_>, Shift>,
    series: &[(String, Vec<(f64, f64)>)],
    (xs, ys): (Range<f64>, Range<f64>),
) -> Result<(), ReportError> {
    root.fill(&WHITE).or_draw()?;
    let mut c = ChartBuilder::on(root)
        .caption(
            "Pool memory over bytes in flight (frags held until ACK)",
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(xs.log_scale(), ys.log_scale())
        .or_draw()?;
    c.configure_mesh()
        .x_desc("flows")
        .y_desc("amplification (mean)")
        .draw()
        .or_draw()?;
    for (i, (name, p)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        c.draw_series(LineSeries::new(p.iter().copied(), color.stroke_width(2)))
            .or_draw()?
            .label(name.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
            });
        c.draw_series(p.iter().map(|&q| Circle::new(q, 3, color.filled())))
            .or_draw()?;
    }
    c.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .or_draw()?;
    Ok(())
}
