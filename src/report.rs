//! Output of a sweep: a table for people, CSV with the contract's columns,
//! and an SVG chart.

use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};

use plotters::coord::types::{RangedCoordf64, RangedCoordu32};
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::run::Row;

/// The CSV columns, in order: the names of [`Row`]'s fields, which are the
/// one definition of the schema (the first 21 are the design's contract,
/// never renamed; the rest are additions).
pub fn columns() -> Vec<String> {
    columns_of::<Row>()
}

/// The CSV columns of any row type: its field names, in order.
pub fn columns_of<T: serde::Serialize + Default>() -> Vec<String> {
    let mut w = csv::Writer::from_writer(Vec::new());
    // Serializing into memory cannot fail for a plain struct of numbers
    // and strings; an error leaves the list empty, which every test sees.
    if w.serialize(T::default()).is_err() {
        return Vec::new();
    }
    first_record(w.into_inner().unwrap_or_default())
}

/// A row's values, in [`columns`] order, as the CSV writes them (an
/// unmeasured figure is an empty cell).
pub fn record<T: serde::Serialize>(r: &T) -> Vec<String> {
    let mut w = csv::WriterBuilder::new()
        .has_headers(false)
        .from_writer(Vec::new());
    if w.serialize(r).is_err() {
        return Vec::new();
    }
    first_record(w.into_inner().unwrap_or_default())
}

fn first_record(data: Vec<u8>) -> Vec<String> {
    csv::ReaderBuilder::new()
        .has_headers(false)
        .from_reader(&data[..])
        .records()
        .next()
        .and_then(|r| r.ok())
        .map(|r| r.iter().map(str::to_string).collect())
        .unwrap_or_default()
}

/// A cell for people: fractional numbers rounded.
fn human(cell: &str) -> String {
    match cell.parse::<f64>() {
        Ok(v) if cell.contains('.') => f(v),
        _ => cell.to_string(),
    }
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

/// Writes the rows as CSV with a header line.
pub fn write_csv<T: serde::Serialize>(path: &Path, rows: &[T]) -> Result<(), csv::Error> {
    let mut w = csv::Writer::from_path(path)?;
    for r in rows {
        w.serialize(r)?;
    }
    w.flush()?;
    Ok(())
}

/// Writes the columns `cols` (header, [`Row`] field) of the rows as CSV.
pub fn write_csv_columns(
    path: &Path,
    rows: &[Row],
    cols: &[(&str, &str)],
) -> Result<(), csv::Error> {
    let mut w = csv::Writer::from_path(path)?;
    w.write_record(cols.iter().map(|c| c.0))?;
    for r in rows {
        w.write_record(select(&record(r), cols))?;
    }
    w.flush()?;
    Ok(())
}

/// The cells of `cols` (header, field) from a full record.
fn select(rec: &[String], cols: &[(&str, &str)]) -> Vec<String> {
    select_in(&columns(), rec, cols)
}

/// The cells of `cols` (header, field) from a record whose fields are
/// `names`.
fn select_in(names: &[String], rec: &[String], cols: &[(&str, &str)]) -> Vec<String> {
    cols.iter()
        .map(|(_, field)| {
            names
                .iter()
                .position(|n| n == field)
                .and_then(|i| rec.get(i).cloned())
                .unwrap_or_default()
        })
        .collect()
}

/// Prints the columns `cols` (header, [`Row`] field) of the rows as an
/// aligned table, numbers rounded.
pub fn print_columns<T: serde::Serialize + Default>(
    out: &mut impl Write,
    rows: &[T],
    cols: &[(&str, &str)],
) -> std::io::Result<()> {
    let names = columns_of::<T>();
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            select_in(&names, &record(r), cols)
                .iter()
                .map(|c| human(c))
                .collect()
        })
        .collect();
    let width: Vec<usize> = (0..cols.len())
        .map(|i| {
            cells
                .iter()
                .map(|c| c[i].len())
                .max()
                .unwrap_or(0)
                .max(cols[i].0.len())
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
        line(cols.iter().map(|c| c.0.to_string()).collect())
    )?;
    for c in cells {
        writeln!(out, "{}", line(c))?;
    }
    Ok(())
}

/// The columns of the human table.
const TABLE: [&str; 18] = [
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
    "gbit_s_min",
    "gbit_s_max",
    "driver_ns_per_pkt",
    "device_ns_per_pkt",
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
    let mss = rows.iter().any(|r| r.mss != rows[0].mss);
    let mut extra: Vec<&str> = Vec::new();
    if multi {
        extra.extend(MULTI);
    }
    if mss {
        extra.extend(["mss", "pages_per_segment"]);
    }
    let short = |n: &str| {
        n.trim_end_matches("_per_pkt")
            .replace("invalidations", "invals")
            .replace("model_iommu_ns", "model_ns")
            .replace("skipped_pressured", "skipped")
            .replace("gbit_s_", "gbit_")
    };
    let names: Vec<(String, &str)> = TABLE.iter().chain(&extra).map(|&n| (short(n), n)).collect();
    let cols: Vec<(&str, &str)> = names.iter().map(|(s, n)| (s.as_str(), *n)).collect();
    print_columns(out, rows, &cols)
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
    /// Writing the chart's file failed.
    #[error("writing {}: {source}", .path.display())]
    Write {
        /// The chart's file.
        path: PathBuf,
        /// What the write said.
        source: std::io::Error,
    },
}

/// Turns a plotting error into [`ReportError::Draw`] (the one way every
/// chart does).
pub(crate) trait OrDraw<T> {
    /// The error, if any, as [`ReportError::Draw`] with its text.
    fn or_draw(self) -> Result<T, ReportError>;
}

impl<T, E: std::fmt::Display> OrDraw<T> for Result<T, E> {
    fn or_draw(self) -> Result<T, ReportError> {
        self.map_err(|e| ReportError::Draw(e.to_string()))
    }
}

/// One plotted point.
#[derive(Clone, Copy, Debug)]
struct Point {
    order: u32,
    /// Median Gbit/s, and the repetitions' range.
    gbit: f64,
    gbit_min: f64,
    gbit_max: f64,
    maps: f64,
}

impl Point {
    fn of(r: &Row) -> Result<Point, ReportError> {
        Ok(Point {
            order: r.order.parse().or_draw()?,
            gbit: r.gbit_s,
            gbit_min: r.gbit_s_min.min(r.gbit_s),
            gbit_max: r.gbit_s_max.max(r.gbit_s),
            maps: r.maps_per_pkt.unwrap_or(0.0),
        })
    }
}

/// Draws Gbit/s (median, with the repetitions' range as error bars) and
/// maps per packet against chunk order, one line per (policy, iommu,
/// header) series, with the limit as a dashed level.
pub fn write_svg(path: &Path, rows: &[Row]) -> Result<(), ReportError> {
    let series = series_of(rows)?;
    let limit = rows.iter().find(|r| r.policy == "limit").map(|r| r.gbit_s);
    let e = Extent::of(&series, limit);
    save_svg(path, (1200, 520), |root| {
        draw_sweep(root, &series, limit, &e)
    })
}

/// Draws a `size` chart with `draw` and writes it to `path`: every byte,
/// or [`ReportError::Write`] with the path. The one place a chart reaches
/// its file (plotters' own file target writes through a buffer whose
/// error, on drop, goes unseen: a chart smaller than the buffer failed
/// silently).
pub fn save_svg(
    path: &Path,
    size: (u32, u32),
    draw: impl FnOnce(&DrawingArea<SVGBackend<'_>, Shift>) -> Result<(), ReportError>,
) -> Result<(), ReportError> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
        draw(&root)?;
        root.present().or_draw()?;
    }
    std::fs::write(path, svg).map_err(|source| ReportError::Write {
        path: path.to_path_buf(),
        source,
    })
}

/// The sweep's two charts on `root`: Gbit/s and maps per packet of each
/// of `series`, the `limit` as a dashed level.
fn draw_sweep(
    root: &DrawingArea<SVGBackend<'_>, Shift>,
    series: &[(String, Vec<Point>)],
    limit: Option<f64>,
    e: &Extent,
) -> Result<(), ReportError> {
    root.fill(&WHITE).or_draw()?;
    let (left, right) = root.split_horizontally(600);
    let xs = e.min_order..e.max_order.max(e.min_order + 1);
    let mut g = panel(
        &left,
        "Gbit/s (median; bars: range over repetitions)",
        "Gbit/s",
        xs.clone(),
        e.gmax,
    )?;
    let mut m = panel(
        &right,
        "DMA map calls per packet",
        "maps / packet",
        xs,
        e.mmax,
    )?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        draw_gbit(&mut g, name, pts, color)?;
        draw_maps(&mut m, pts, color)?;
    }
    if let Some(l) = limit {
        draw_limit(&mut g, l, e.min_order, e.max_order)?;
    }
    g.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .or_draw()?;
    Ok(())
}

/// The chart's series: the points of the rows for all queues that have an
/// order, grouped by (policy, iommu, header) in the order first met.
fn series_of(rows: &[Row]) -> Result<Vec<(String, Vec<Point>)>, ReportError> {
    let mut series: Vec<(String, Vec<Point>)> = Vec::new();
    for r in rows
        .iter()
        .filter(|r| !r.order.is_empty() && r.queue == "all")
    {
        let name = format!("{} {} {}", r.policy, r.iommu, r.header);
        let p = Point::of(r)?;
        match series.iter_mut().find(|s| s.0 == name) {
            Some(s) => s.1.push(p),
            None => series.push((name, vec![p])),
        }
    }
    Ok(series)
}

/// How far the axes reach: the orders plotted, and the tops of the two
/// charts (a tenth above the highest point, and at least 1.1).
struct Extent {
    min_order: u32,
    max_order: u32,
    /// Top of the Gbit/s chart (the limit included).
    gmax: f64,
    /// Top of the maps-per-packet chart.
    mmax: f64,
}

impl Extent {
    fn of(series: &[(String, Vec<Point>)], limit: Option<f64>) -> Extent {
        let points = || series.iter().flat_map(|s| s.1.iter());
        Extent {
            min_order: points().map(|p| p.order).min().unwrap_or(0),
            max_order: points().map(|p| p.order).max().unwrap_or(4),
            gmax: points()
                .map(|p| p.gbit_max)
                .chain(limit)
                .fold(1.0f64, f64::max)
                * 1.1,
            mmax: points().map(|p| p.maps).fold(1.0f64, f64::max) * 1.1,
        }
    }
}

/// One of the two charts: chunk order across, a number up.
type Panel<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordu32, RangedCoordf64>>;

/// Builds a chart on `area` with its caption, orders `xs` across and
/// 0..`ymax` up, and draws its mesh.
fn panel<'a, 'b>(
    area: &'a DrawingArea<SVGBackend<'b>, Shift>,
    caption: &str,
    y_desc: &str,
    xs: Range<u32>,
    ymax: f64,
) -> Result<Panel<'a, 'b>, ReportError> {
    let mut c = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(xs, 0.0..ymax)
        .or_draw()?;
    c.configure_mesh()
        .x_desc("chunk order")
        .y_desc(y_desc)
        .x_labels(8)
        .draw()
        .or_draw()?;
    Ok(c)
}

/// Draws one series on the Gbit/s chart: its line (with a legend entry
/// `name`), the repetitions' range as error bars, and the points.
fn draw_gbit(
    g: &mut Panel<'_, '_>,
    name: &str,
    pts: &[Point],
    color: RGBAColor,
) -> Result<(), ReportError> {
    g.draw_series(LineSeries::new(
        pts.iter().map(|p| (p.order, p.gbit)),
        color.stroke_width(2),
    ))
    .or_draw()?
    .label(name)
    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
    g.draw_series(pts.iter().map(|p| {
        ErrorBar::new_vertical(
            p.order,
            p.gbit_min,
            p.gbit,
            p.gbit_max,
            color.stroke_width(1),
            8,
        )
    }))
    .or_draw()?;
    g.draw_series(
        pts.iter()
            .map(|p| Circle::new((p.order, p.gbit), 3, color.filled())),
    )
    .or_draw()?;
    Ok(())
}

/// Draws one series on the maps-per-packet chart: its line and points.
fn draw_maps(m: &mut Panel<'_, '_>, pts: &[Point], color: RGBAColor) -> Result<(), ReportError> {
    m.draw_series(LineSeries::new(
        pts.iter().map(|p| (p.order, p.maps)),
        color.stroke_width(2),
    ))
    .or_draw()?;
    m.draw_series(
        pts.iter()
            .map(|p| Circle::new((p.order, p.maps), 3, color.filled())),
    )
    .or_draw()?;
    Ok(())
}

/// Draws the limit `l` as a dashed level across the Gbit/s chart, from
/// order `from` to `to`, with its legend entry.
fn draw_limit(g: &mut Panel<'_, '_>, l: f64, from: u32, to: u32) -> Result<(), ReportError> {
    g.draw_series(DashedLineSeries::new(
        vec![(from, l), (to, l)],
        6,
        4,
        BLACK.stroke_width(1),
    ))
    .or_draw()?
    .label("limit (payload write + NIC read)")
    .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], BLACK));
    Ok(())
}
