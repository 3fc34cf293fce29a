//! DPDK's rows of the peers table.
//!
//! - `rte_mempool` get/put, single and bulk, and `rte_pktmbuf` alloc/free,
//!   timed by the same harness as pfrag's rows. DPDK's loops run in C
//!   (`dpdk.c`, built when `pkg-config` finds `libdpdk`); they run in a
//!   child process, the peers example started again with `--dpdk-child`,
//!   because DPDK's EAL wants a process of its own.
//! - `dpdk-testpmd --forward-mode=txonly` on a `net_null` vdev: packets per
//!   second from its own periodic statistics.
//!
//! EAL runs without huge pages or devices (`--no-huge -m 1024 --no-pci
//! --no-shconf --no-telemetry`). Run as root, both run as `nobody` with
//! `XDG_RUNTIME_DIR` in a private directory under the system's temporary
//! directory (the child's executable is copied there too, as `nobody` may
//! not reach the build tree), removed afterwards, so EAL writes nothing
//! under `/var/run/dpdk`.

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::{Pid, User};

use super::bench::{Harness, Timing};

/// Why DPDK's rows cannot run in this build, if they cannot.
pub fn unavailable() -> Option<&'static str> {
    if cfg!(pfrag_dpdk) {
        None
    } else {
        Some(
            "built without libdpdk (pkg-config found no libdpdk >= 22.11 when the lab was \
             built, or PFRAG_NO_DPDK was set): install libdpdk-dev, then rebuild; if the \
             build does not notice, `touch build.rs` first",
        )
    }
}

/// The EAL arguments of every DPDK process here, on `cpus` (an lcore list).
fn eal_args(cpus: &str) -> Vec<String> {
    [
        "-l",
        cpus,
        "--no-huge",
        "-m",
        "1024",
        "--no-pci",
        "--no-shconf",
        "--no-telemetry",
        "--log-level=error",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// A private directory for EAL's runtime files (and the child's
/// executable), owned by `nobody` when this process is root; removed on
/// drop.
pub struct RunDir {
    path: PathBuf,
    nobody: Option<User>,
}

impl RunDir {
    /// Creates `$TMPDIR/pfrag-peers-<pid>`.
    pub fn new() -> Result<RunDir, String> {
        let path = std::env::temp_dir().join(format!("pfrag-peers-{}", std::process::id()));
        std::fs::create_dir_all(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let nobody = if nix::unistd::geteuid().is_root() {
            let u = User::from_name("nobody")
                .map_err(|e| format!("looking up nobody: {e}"))?
                .ok_or("no user nobody")?;
            std::os::unix::fs::chown(&path, Some(u.uid.as_raw()), Some(u.gid.as_raw()))
                .map_err(|e| format!("chown {}: {e}", path.display()))?;
            Some(u)
        } else {
            None
        };
        Ok(RunDir { path, nobody })
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Makes `cmd` run as `nobody` (when root) with EAL's runtime
    /// directory here.
    fn apply(&self, cmd: &mut Command) {
        if let Some(u) = &self.nobody {
            cmd.uid(u.uid.as_raw()).gid(u.gid.as_raw());
        }
        cmd.env("XDG_RUNTIME_DIR", &self.path);
    }

    /// A copy of this program's executable inside the directory, readable
    /// and executable by anyone.
    fn copy_exe(&self) -> Result<PathBuf, String> {
        let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
        let to = self.path.join("peers-child");
        std::fs::copy(&exe, &to).map_err(|e| format!("copying {}: {e}", exe.display()))?;
        std::fs::set_permissions(&to, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .map_err(|e| format!("chmod {}: {e}", to.display()))?;
        Ok(to)
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// The keys of the child's rows, in order.
pub const CHILD_ROWS: [&str; 4] = [
    "mempool_single",
    "mempool_bulk",
    "pktmbuf_single",
    "pktmbuf_bulk",
];

/// Starts this program again as the DPDK child (`--dpdk-child`) and reads
/// its rows: `(key, timing)` for each of [`CHILD_ROWS`].
pub fn run_child(h: &Harness, cpu: usize) -> Result<Vec<(String, Timing)>, String> {
    if let Some(why) = unavailable() {
        return Err(why.into());
    }
    let dir = RunDir::new()?;
    let mut cmd = Command::new(dir.copy_exe()?);
    cmd.args([
        "--dpdk-child",
        "--reps",
        &h.reps.to_string(),
        "--target-ms",
        &h.target.as_millis().to_string(),
        "--cpu",
        &cpu.to_string(),
    ]);
    dir.apply(&mut cmd);
    let out = cmd
        .output()
        .map_err(|e| format!("starting the DPDK child: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let rows = parse_child(&text);
    if !out.status.success() || !has_every_row_once(&rows) {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("");
        return Err(format!("DPDK child failed ({}): {last}", out.status));
    }
    Ok(rows)
}

/// Whether `rows` are the child's rows: each of [`CHILD_ROWS`] once, and
/// no other (a row twice and another missing is no full set, though the
/// count matches).
pub fn has_every_row_once(rows: &[(String, Timing)]) -> bool {
    rows.len() == CHILD_ROWS.len()
        && CHILD_ROWS
            .iter()
            .all(|k| rows.iter().filter(|(key, _)| key == k).count() == 1)
}

/// The child's `peer KEY NS,NS,...` lines (one figure per repetition,
/// each a positive, finite number of ns, and nothing after them; a line
/// with any other figure or with more text is left out, so that the
/// child's output counts as failed).
pub fn parse_child(text: &str) -> Vec<(String, Timing)> {
    text.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            if w.next()? != "peer" {
                return None;
            }
            let key = w.next()?.to_string();
            let ns: Option<Vec<f64>> = w
                .next()?
                .split(',')
                .map(|v| v.parse().ok().filter(|x: &f64| x.is_finite() && *x > 0.0))
                .collect();
            // Nothing may follow the figures.
            if w.next().is_some() {
                return None;
            }
            let ns = ns.filter(|v| !v.is_empty())?;
            Some((key, Timing::from_samples(ns)))
        })
        .collect()
}

/// The child's side: EAL on `cpu`, then each row, printed as
/// `peer KEY NS,NS,...`.
#[cfg(pfrag_dpdk)]
pub fn child_main(h: &Harness, cpu: usize) -> Result<(), String> {
    for (key, t) in ffi::measure(h, &eal_args(&cpu.to_string()))? {
        let ns: Vec<String> = t.samples.iter().map(f64::to_string).collect();
        println!("peer {key} {}", ns.join(","));
    }
    Ok(())
}

/// The child's side, in a build without DPDK: an error.
#[cfg(not(pfrag_dpdk))]
pub fn child_main(_h: &Harness, _cpu: usize) -> Result<(), String> {
    Err(unavailable().unwrap_or("no DPDK").into())
}

/// `dpdk-testpmd` txonly on `net_null0`, main lcore `main`, forwarding
/// lcore `fwd`: Mpps of `samples` statistics periods of `period` each
/// (after one period of warm-up), as a [`Timing`] of nanoseconds per
/// packet.
pub fn testpmd(
    main: usize,
    fwd: usize,
    period: Duration,
    samples: usize,
) -> Result<Timing, String> {
    let bin = which("dpdk-testpmd").ok_or("dpdk-testpmd not found (install dpdk-dev)")?;
    let secs = period.as_secs().max(1);
    let within = Duration::from_secs(secs * (samples as u64 + 3) + 20);
    run_testpmd(&bin, (main, fwd), secs, samples, within)
}

/// [`testpmd`] with the program `bin`, lcores `(main, fwd)`, statistics
/// every `secs` seconds, given `within` for its `samples` samples: one
/// that goes quiet (prints nothing, never exits) is stopped then, its
/// samples short, rather than waited for.
fn run_testpmd(
    bin: &Path,
    (main, fwd): (usize, usize),
    secs: u64,
    samples: usize,
    within: Duration,
) -> Result<Timing, String> {
    let mut cmd = Command::new(bin);
    cmd.args(eal_args(&format!("{main},{fwd}")))
        .args(["--vdev", "net_null0", "--"])
        .args(["--forward-mode=txonly", "--total-num-mbufs=16384"])
        .arg(format!("--stats-period={secs}"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let dir = RunDir::new()?;
    dir.apply(&mut cmd);
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("starting dpdk-testpmd: {e}"))?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    // Lines come through a thread of their own, so that the deadline holds
    // while testpmd prints nothing. The thread ends when the pipe closes,
    // once testpmd is stopped below.
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + within;
    let mut pps = Vec::new();
    let mut seen = 0;
    while pps.len() < samples {
        let left = deadline.saturating_duration_since(Instant::now());
        // A timeout, or testpmd's output ended.
        let Ok(line) = lines.recv_timeout(left) else {
            break;
        };
        if let Some(v) = tx_pps(&line) {
            seen += 1;
            // The first period is the warm-up (and the first report is
            // often all zeros).
            if seen > 1 {
                pps.push(v);
            }
        }
    }
    let _ = kill(Pid::from_raw(child.id() as i32), Signal::SIGINT);
    let stop = Instant::now();
    while child.try_wait().ok().flatten().is_none() && stop.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    if pps.len() < samples || pps.contains(&0) {
        return Err(format!(
            "testpmd gave {} of {samples} samples within {} s: {pps:?}",
            pps.len(),
            within.as_secs()
        ));
    }
    Ok(Timing::from_samples(
        pps.iter().map(|&p| 1e9 / p as f64).collect(),
    ))
}

/// The `Tx-pps:` figure of a testpmd statistics line.
pub fn tx_pps(line: &str) -> Option<u64> {
    let rest = line.split("Tx-pps:").nth(1)?;
    rest.split_whitespace().next()?.parse().ok()
}

fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

#[cfg(pfrag_dpdk)]
mod ffi {
    //! The C loops of `dpdk.c`. Each runs `iters` iterations and returns a
    //! negative value if DPDK refused an object.

    use std::ffi::{c_char, c_int, c_uint, c_void, CString};

    use super::{Harness, Timing};

    extern "C" {
        fn peers_eal_init(argc: c_int, argv: *mut *mut c_char) -> c_int;
        fn peers_eal_cleanup();
        fn peers_mempool_create(n: c_uint, elt_size: c_uint, cache: c_uint) -> *mut c_void;
        fn peers_pktmbuf_pool_create(n: c_uint, cache: c_uint) -> *mut c_void;
        fn peers_mempool_single(mp: *mut c_void, iters: u64) -> i64;
        fn peers_mempool_bulk(mp: *mut c_void, iters: u64, burst: c_uint) -> i64;
        fn peers_pktmbuf_single(mp: *mut c_void, iters: u64) -> i64;
        fn peers_pktmbuf_bulk(mp: *mut c_void, iters: u64, burst: c_uint) -> i64;
    }

    /// Objects per pool, and the per-lcore cache: DPDK's usual sizes.
    const OBJECTS: c_uint = 8191;
    const CACHE: c_uint = 256;
    const BURST: c_uint = super::super::local::BURST as c_uint;

    /// Initialises EAL with `args` and times the four rows.
    pub fn measure(h: &Harness, args: &[String]) -> Result<Vec<(String, Timing)>, String> {
        let owned: Vec<CString> = std::iter::once("peers".to_string())
            .chain(args.iter().cloned())
            .map(|a| CString::new(a).expect("no NUL in EAL arguments"))
            .collect();
        // EAL may permute argv: hand it pointers of its own; the strings
        // live in `owned` until the end of this function.
        let mut argv: Vec<*mut c_char> = owned.iter().map(|s| s.as_ptr() as *mut c_char).collect();
        // SAFETY: argv holds argc valid NUL-terminated strings, alive for
        // the call and after (EAL keeps no pointer past init that we free
        // before cleanup).
        let rc = unsafe { peers_eal_init(argv.len() as c_int, argv.as_mut_ptr()) };
        if rc < 0 {
            return Err(format!("rte_eal_init failed ({rc})"));
        }
        // SAFETY: EAL is initialised; the pools live until cleanup.
        let mp = unsafe { peers_mempool_create(OBJECTS, 2048, CACHE) };
        // SAFETY: as above.
        let mb = unsafe { peers_pktmbuf_pool_create(OBJECTS, CACHE) };
        if mp.is_null() || mb.is_null() {
            return Err("creating the DPDK pools failed".into());
        }
        let mut failed = false;
        let mut time = |key: &'static str, ops: c_uint| {
            let t = h.time(u64::from(ops), |i| failed |= run(key, mp, mb, i) < 0);
            (key, t)
        };
        let rows = vec![
            time("mempool_single", 1),
            time("mempool_bulk", BURST),
            time("pktmbuf_single", 1),
            time("pktmbuf_bulk", BURST),
        ];
        // SAFETY: nothing uses EAL after this.
        unsafe { peers_eal_cleanup() };
        drop(owned);
        if failed {
            return Err("a DPDK pool ran dry".into());
        }
        Ok(rows.into_iter().map(|(k, t)| (k.to_string(), t)).collect())
    }

    /// Runs the loop `key` (one of [`super::CHILD_ROWS`]) for `iters`
    /// iterations on the object pool `mp` or the mbuf pool `mb`.
    fn run(key: &str, mp: *mut c_void, mb: *mut c_void, iters: u64) -> i64 {
        // SAFETY: `mp` and `mb` are live pools of this process until
        // `peers_eal_cleanup`, used by this thread only (its lcore cache);
        // each loop returns every object it takes.
        unsafe {
            match key {
                "mempool_single" => peers_mempool_single(mp, iters),
                "mempool_bulk" => peers_mempool_bulk(mp, iters, BURST),
                "pktmbuf_single" => peers_pktmbuf_single(mb, iters),
                "pktmbuf_bulk" => peers_pktmbuf_bulk(mb, iters, BURST),
                _ => -1,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_child_rows_and_ignores_other_lines() {
        let text = "EAL: something\npeer mempool_single 4.9,4.4,4.5\npeer bad x\npeer\n";
        let rows = parse_child(text);
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].0, "mempool_single");
        assert_eq!(rows[0].1.reps, 3);
        assert_eq!((rows[0].1.median, rows[0].1.min), (4.5, 4.4));
    }

    /// A figure that is not a positive, finite number of ns refuses the
    /// row (and so the child's output), instead of reaching a ratio as
    /// NaN, infinity or a division by zero.
    #[test]
    fn a_child_row_with_a_figure_that_is_no_time_is_refused() {
        for bad in ["NaN,4.5", "inf", "4.5,-1", "0,4.5", "4.5,"] {
            let text = format!("peer mempool_single {bad}\n");
            assert!(parse_child(&text).is_empty(), "{bad}");
        }
        assert_eq!(parse_child("peer mempool_single 4.5,1e-3\n").len(), 1);
    }

    /// Text after a row's figures makes the line malformed like any
    /// other: it is left out, not read as a row with the rest ignored.
    #[test]
    fn a_child_row_with_trailing_text_is_refused() {
        for bad in ["4.5,4.4 garbage", "4.5 4.4", "4.5,4.4 peer"] {
            let text = format!("peer mempool_single {bad}\n");
            assert!(parse_child(&text).is_empty(), "{bad}");
        }
        // Trailing white space is no text.
        assert_eq!(parse_child("peer mempool_single 4.5,4.4  \t\n").len(), 1);
    }

    /// The child's rows count as complete only with each key once: a
    /// row printed twice in place of another used to pass on the count.
    #[test]
    fn child_rows_are_complete_only_with_each_key_once() {
        let row = |k: &str| format!("peer {k} 4.5,4.4\n");
        let all: String = CHILD_ROWS.iter().map(|k| row(k)).collect();
        assert!(has_every_row_once(&parse_child(&all)));
        let twice = all.replace("peer mempool_bulk", "peer mempool_single");
        assert!(!has_every_row_once(&parse_child(&twice)));
        let stranger = all.replace("peer mempool_bulk", "peer other");
        assert!(!has_every_row_once(&parse_child(&stranger)));
        assert!(!has_every_row_once(&parse_child(&all[..all.len() / 2])));
    }

    /// A testpmd that prints nothing and never exits is stopped at its
    /// deadline, and its missing samples are an error. The run used to
    /// wait for its next line forever.
    #[test]
    fn a_testpmd_that_goes_quiet_is_stopped_at_its_deadline() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("pfrag-quiet-testpmd-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, PermissionsExt::from_mode(0o755)).unwrap();
        let bin = dir.join("quiet-testpmd");
        std::fs::write(&bin, "#!/bin/sh\nexec sleep 600\n").unwrap();
        std::fs::set_permissions(&bin, PermissionsExt::from_mode(0o755)).unwrap();
        let (tx, rx) = mpsc::channel();
        let b = bin.clone();
        std::thread::spawn(move || {
            let _ = tx.send(run_testpmd(&b, (0, 1), 1, 2, Duration::from_millis(200)));
        });
        // Far beyond the deadline however busy the machine: no timing is
        // asserted, only that the run came back.
        let r = rx.recv_timeout(Duration::from_secs(60));
        let _ = std::fs::remove_dir_all(&dir);
        match r {
            Ok(Err(e)) => assert!(e.contains("0 of 2 samples"), "{e}"),
            Ok(Ok(t)) => panic!("a quiet testpmd gave a timing: {t:?}"),
            Err(_) => panic!("the run waited for a quiet testpmd"),
        }
    }

    #[test]
    fn reads_testpmd_tx_pps() {
        assert_eq!(
            tx_pps("  Tx-pps:     37203198          Tx-bps:            0"),
            Some(37203198)
        );
        assert_eq!(
            tx_pps("  Rx-pps:            0          Rx-bps:            0"),
            None
        );
    }
}
