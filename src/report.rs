//! Output of a sweep: a table for people, CSV with the contract's columns,
//! and an SVG chart.

use std::io::Write;
use std::path::Path;

use plotters::prelude::*;

use crate::run::Row;

/// CSV columns, in order. The first 21 are the design's contract (never
/// renamed); the rest are additions.
pub const COLUMNS: [&str; 38] = [
    "backend",
    "order",
    "policy",
    "iommu",
    "header",
    "flows",
    "packets",
    "payload_bytes",
    "maps_per_pkt",
    "unmaps_per_pkt",
    "map_pages_per_pkt",
    "invalidations_per_pkt",
    "iotlb_misses_per_pkt",
    "pages_per_pkt",
    "descs_per_pkt",
    "waste_bytes_per_pkt",
    "ns_per_pkt",
    "gbit_s",
    "model_iommu_ns_per_pkt",
    "faults",
    "bytes_verified",
    "fit_whole",
    "pool_bytes",
    "warmup",
    "touch",
    "backing",
    "queues",
    "queue",
    "reclaim",
    "borrows_per_pkt",
    "skipped_pressured_per_pkt",
    "reclaim_calls_per_pkt",
    "shared_pool_ops_per_pkt",
    "pressure_hook_calls",
    "pressure_transitions",
    "peak_bytes",
    "iotlb_entries",
    "device_model",
];

/// An optional figure: empty where it was not measured.
fn fo(v: Option<f64>) -> String {
    v.map(f).unwrap_or_default()
}

fn f(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.abs() >= 100.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.4}")
    }
}

/// A row's values, in [`COLUMNS`] order.
pub fn record(r: &Row) -> Vec<String> {
    vec![
        r.backend.clone(),
        r.order.clone(),
        r.policy.clone(),
        r.iommu.clone(),
        r.header.clone(),
        r.flows.to_string(),
        r.packets.to_string(),
        r.payload_bytes.to_string(),
        fo(r.maps_per_pkt),
        fo(r.unmaps_per_pkt),
        fo(r.map_pages_per_pkt),
        fo(r.invalidations_per_pkt),
        fo(r.iotlb_misses_per_pkt),
        fo(r.pages_per_pkt),
        f(r.descs_per_pkt),
        f(r.waste_bytes_per_pkt),
        f(r.ns_per_pkt),
        format!("{:.2}", r.gbit_s),
        fo(r.model_iommu_ns_per_pkt),
        r.faults.to_string(),
        r.bytes_verified.to_string(),
        r.fit_whole.to_string(),
        r.pool_bytes.to_string(),
        r.warmup.to_string(),
        r.touch.clone(),
        r.backing.clone(),
        r.queues.to_string(),
        r.queue.clone(),
        r.reclaim.clone(),
        f(r.borrows_per_pkt),
        f(r.skipped_pressured_per_pkt),
        f(r.reclaim_calls_per_pkt),
        f(r.shared_pool_ops_per_pkt),
        r.pressure_hook_calls.to_string(),
        r.pressure_transitions.to_string(),
        r.peak_bytes.to_string(),
        r.iotlb_entries.map(|n| n.to_string()).unwrap_or_default(),
        r.device_model.clone(),
    ]
}

/// Writes the rows as CSV with a header line.
pub fn write_csv(path: &Path, rows: &[Row]) -> Result<(), csv::Error> {
    let mut w = csv::Writer::from_path(path)?;
    w.write_record(COLUMNS)?;
    for r in rows {
        w.write_record(record(r))?;
    }
    w.flush()?;
    Ok(())
}

/// The columns of the human table.
const TABLE: [&str; 14] = [
    "order",
    "policy",
    "iommu",
    "header",
    "maps_per_pkt",
    "unmaps_per_pkt",
    "invalidations_per_pkt",
    "iotlb_misses_per_pkt",
    "pages_per_pkt",
    "descs_per_pkt",
    "ns_per_pkt",
    "gbit_s",
    "model_iommu_ns_per_pkt",
    "faults",
];

/// Columns the table adds when a run has more than one queue.
const MULTI: [&str; 4] = [
    "queue",
    "borrows_per_pkt",
    "skipped_pressured_per_pkt",
    "shared_pool_ops_per_pkt",
];

/// Prints an aligned table of the main columns to `out`.
pub fn print_table(out: &mut impl Write, rows: &[Row]) -> std::io::Result<()> {
    let multi = rows.iter().any(|r| r.queues > 1);
    let extra: &[&str] = if multi { &MULTI } else { &[] };
    let idx: Vec<usize> = TABLE
        .iter()
        .chain(extra)
        .map(|n| {
            COLUMNS
                .iter()
                .position(|c| c == n)
                .expect("table column is a CSV column")
        })
        .collect();
    let cells: Vec<Vec<String>> = rows.iter().map(record).collect();
    let short = |n: &str| {
        n.trim_end_matches("_per_pkt")
            .replace("invalidations", "invals")
            .replace("model_iommu_ns", "model_ns")
            .replace("skipped_pressured", "skipped")
    };
    let width: Vec<usize> = idx
        .iter()
        .map(|&i| {
            cells
                .iter()
                .map(|c| c[i].len())
                .max()
                .unwrap_or(0)
                .max(short(COLUMNS[i]).len())
        })
        .collect();
    let line = |vals: Vec<String>| -> String {
        vals.iter()
            .zip(&width)
            .map(|(v, w)| format!("{v:>w$}"))
            .collect::<Vec<_>>()
            .join("  ")
    };
    writeln!(
        out,
        "{}",
        line(idx.iter().map(|&i| short(COLUMNS[i])).collect())
    )?;
    for c in &cells {
        writeln!(out, "{}", line(idx.iter().map(|&i| c[i].clone()).collect()))?;
    }
    Ok(())
}

/// Why a report could not be written.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// Drawing the SVG failed (what plotters said).
    #[error("drawing the chart: {0}")]
    Draw(String),
    /// Writing the CSV failed.
    #[error(transparent)]
    Csv(#[from] csv::Error),
}

/// Turns a plotting error into [`ReportError::Draw`].
trait OrDraw<T> {
    fn or_draw(self) -> Result<T, ReportError>;
}

impl<T, E: std::fmt::Display> OrDraw<T> for Result<T, E> {
    fn or_draw(self) -> Result<T, ReportError> {
        self.map_err(|e| ReportError::Draw(e.to_string()))
    }
}

/// One plotted point: order, Gbit/s, maps per packet.
type Point = (u32, f64, f64);

/// Draws Gbit/s and maps per packet against chunk order, one line per
/// (policy, iommu, header) series, with the limit as a dashed level.
pub fn write_svg(path: &Path, rows: &[Row]) -> Result<(), ReportError> {
    let mut series: Vec<(String, Vec<Point>)> = Vec::new();
    for r in rows
        .iter()
        .filter(|r| !r.order.is_empty() && r.queue == "all")
    {
        let name = format!("{} {} {}", r.policy, r.iommu, r.header);
        let o: u32 = r.order.parse().or_draw()?;
        match series.iter_mut().find(|s| s.0 == name) {
            Some(s) => s.1.push((o, r.gbit_s, r.maps_per_pkt.unwrap_or(0.0))),
            None => series.push((name, vec![(o, r.gbit_s, r.maps_per_pkt.unwrap_or(0.0))])),
        }
    }
    let limit = rows.iter().find(|r| r.policy == "limit").map(|r| r.gbit_s);
    let max_order = series
        .iter()
        .flat_map(|s| s.1.iter().map(|p| p.0))
        .max()
        .unwrap_or(4);
    let min_order = series
        .iter()
        .flat_map(|s| s.1.iter().map(|p| p.0))
        .min()
        .unwrap_or(0);
    let gmax = series
        .iter()
        .flat_map(|s| s.1.iter().map(|p| p.1))
        .chain(limit)
        .fold(1.0f64, f64::max)
        * 1.1;
    let mmax = series
        .iter()
        .flat_map(|s| s.1.iter().map(|p| p.2))
        .fold(1.0f64, f64::max)
        * 1.1;

    let root = SVGBackend::new(path, (1200, 520)).into_drawing_area();
    root.fill(&WHITE).or_draw()?;
    let (left, right) = root.split_horizontally(600);
    let xs = min_order..max_order.max(min_order + 1);
    let mut g = ChartBuilder::on(&left)
        .caption("Throughput (software NIC)", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(xs.clone(), 0.0..gmax)
        .or_draw()?;
    g.configure_mesh()
        .x_desc("chunk order")
        .y_desc("Gbit/s")
        .x_labels(8)
        .draw()
        .or_draw()?;
    let mut m = ChartBuilder::on(&right)
        .caption("DMA map calls per packet", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(xs, 0.0..mmax)
        .or_draw()?;
    m.configure_mesh()
        .x_desc("chunk order")
        .y_desc("maps / packet")
        .x_labels(8)
        .draw()
        .or_draw()?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        g.draw_series(LineSeries::new(
            pts.iter().map(|p| (p.0, p.1)),
            color.stroke_width(2),
        ))
        .or_draw()?
        .label(name.clone())
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
        g.draw_series(
            pts.iter()
                .map(|p| Circle::new((p.0, p.1), 3, color.filled())),
        )
        .or_draw()?;
        m.draw_series(LineSeries::new(
            pts.iter().map(|p| (p.0, p.2)),
            color.stroke_width(2),
        ))
        .or_draw()?;
        m.draw_series(
            pts.iter()
                .map(|p| Circle::new((p.0, p.2), 3, color.filled())),
        )
        .or_draw()?;
    }
    if let Some(l) = limit {
        g.draw_series(DashedLineSeries::new(
            vec![(min_order, l), (max_order, l)],
            6,
            4,
            BLACK.stroke_width(1),
        ))
        .or_draw()?
        .label("limit (NIC work only)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], BLACK));
    }
    g.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .or_draw()?;
    root.present().or_draw()?;
    Ok(())
}
