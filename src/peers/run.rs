//! One peers run: every row measured in each of several rounds (so that a
//! drift of the machine's speed hits every row alike), testpmd included,
//! the rounds' samples merged per row.

use std::time::Duration;

use super::bench::{Harness, Timing};
use super::{dpdk, local, tx, Group, Table};

/// What a run measures, and how.
#[derive(Clone, Copy, Debug)]
pub struct Settings {
    /// The timing harness (repetitions per row per round).
    pub harness: Harness,
    /// Rounds over every row.
    pub rounds: usize,
    /// The CPU every timed loop runs on (testpmd forwards on it).
    pub cpu: usize,
    /// testpmd's statistics period.
    pub testpmd_period: Duration,
    /// testpmd samples per round, after one period of warm-up.
    pub testpmd_samples: usize,
    /// Leave DPDK out.
    pub no_dpdk: bool,
}

/// Runs every round and merges them; each round's txonly ratios go to
/// [`Table::rounds`].
pub fn run(s: &Settings) -> Result<Table, String> {
    let mut table: Option<Table> = None;
    for r in 0..s.rounds.max(1) {
        eprintln!("round {} of {}", r + 1, s.rounds.max(1));
        let mut t = round(s, r % 2 == 1);
        t.rounds = vec![t.txonly()];
        t.note_failures(r + 1);
        match table.as_mut() {
            Some(all) => all.merge(t)?,
            None => table = Some(t),
        }
    }
    Ok(table.unwrap_or_default())
}

/// What testpmd's row says it measured.
pub const TESTPMD: &str = "testpmd txonly, 64 B, net_null (its own Tx-pps)";

/// One round: pfrag's frag rows, DPDK's child, pfrag's TX rows, then
/// testpmd; or, when `dpdk_first`, the same backwards (rounds alternate,
/// so that neither side always runs just after the other, and testpmd
/// runs next to the txonly rows it is compared with either way). The rows
/// are in the same order either way, testpmd's last.
pub fn round(s: &Settings, dpdk_first: bool) -> Table {
    let (mut frag, mut tx) = (Table::default(), Table::default());
    let (child, pmd);
    if dpdk_first {
        pmd = testpmd(s);
        tx_rows(&mut tx, &s.harness);
        child = dpdk_child(s);
        frag_rows(&mut frag, &s.harness);
    } else {
        frag_rows(&mut frag, &s.harness);
        child = dpdk_child(s);
        tx_rows(&mut tx, &s.harness);
        pmd = testpmd(s);
    }
    let mut t = frag;
    t.rows.extend(tx.rows);
    dpdk_rows(&mut t, child);
    t.push(Group::Txonly, "dpdk", TESTPMD, pmd, false);
    t
}

/// DPDK's loops in their child process, unless `--no-dpdk`.
fn dpdk_child(s: &Settings) -> Result<Vec<(String, Timing)>, String> {
    if s.no_dpdk {
        return Err("--no-dpdk".to_string());
    }
    dpdk::run_child(&s.harness, s.cpu)
}

/// testpmd txonly on the CPU of the timed loops, unless `--no-dpdk`.
fn testpmd(s: &Settings) -> Result<Timing, String> {
    if s.no_dpdk {
        return Err("--no-dpdk".to_string());
    }
    eprintln!("running dpdk-testpmd txonly...");
    let main = usize::from(s.cpu == 0);
    dpdk::testpmd(main, s.cpu, s.testpmd_period, s.testpmd_samples)
}

fn frag_rows(t: &mut Table, h: &Harness) {
    let e = |r: Result<Timing, pfrag::Error>| r.map_err(|e| e.to_string());
    let (s, b, n) = (local::SINGLE_LEN, local::BULK_LEN, local::BURST);
    let single = format!("FragCache::refill({s}) + complete, order 4");
    t.push(
        Group::Single,
        "pfrag",
        single,
        e(local::pfrag_single(h)),
        true,
    );
    let bulk = format!("refill_bulk({b}, {n}) + complete_burst, per frag");
    t.push(Group::Bulk, "pfrag", bulk, e(local::pfrag_bulk(h)), true);
    let singles = format!("{n} x refill({b}) + complete_burst, per frag");
    let r = e(local::pfrag_burst_of_singles(h));
    t.push(Group::Bulk, "pfrag", singles, r, false);
    let q1 = Ok(local::array_queue(h, 1));
    t.push(
        Group::Single,
        "crossbeam",
        "ArrayQueue free list pop + push",
        q1,
        false,
    );
    let qn = Ok(local::array_queue(h, n));
    let what = format!("ArrayQueue free list {n} pops + {n} pushes");
    t.push(Group::Bulk, "crossbeam", what, qn, false);
    let m1 = local::ixgbe_mempool(h, 1);
    t.push(
        Group::Single,
        "ixgbe-driver",
        "MemPool alloc_pkt + drop",
        m1,
        false,
    );
    let mn = local::ixgbe_mempool(h, n);
    let what = format!("MemPool {n} x alloc_pkt + drop");
    t.push(Group::Bulk, "ixgbe-driver", what, mn, false);
}

fn tx_rows(t: &mut Table, h: &Harness) {
    t.push(
        Group::Txonly,
        "pfrag",
        super::TX_STRICT,
        tx::small_frames(h, false),
        true,
    );
    t.push(
        Group::Txonly,
        "pfrag",
        super::TX_OFF,
        tx::small_frames_off(h),
        false,
    );
    t.push(
        Group::Txonly,
        "pfrag",
        super::TX_DRIVER,
        tx::small_frames(h, true),
        false,
    );
    t.push(
        Group::Txonly,
        "pfrag",
        super::TX_VIRTIO,
        tx::small_frames_virtio(h),
        false,
    );
    let (strict, off) = match tx::tso(h) {
        Ok((s, o)) => (Ok(s), Ok(o)),
        Err(e) => (Err(e.clone()), Err(e)),
    };
    let what = "TX 64 KB TSO driver time, strict IOMMU";
    t.push(Group::Tso, "pfrag", what, strict, true);
    t.push(
        Group::Tso,
        "pfrag",
        "TX 64 KB TSO driver time, IOMMU off",
        off,
        false,
    );
}

fn dpdk_rows(t: &mut Table, child: Result<Vec<(String, Timing)>, String>) {
    let row = |key: &str| match &child {
        Ok(rows) => rows
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, t)| Ok(t.clone()))
            .unwrap_or_else(|| Err("missing from the child's output".to_string())),
        Err(why) => Err(why.clone()),
    };
    let n = local::BURST;
    let rows = [
        (
            Group::Single,
            super::MEMPOOL_SINGLE.to_string(),
            "mempool_single",
        ),
        (
            Group::Bulk,
            format!("{} ({n}), per object", super::MEMPOOL_BULK),
            "mempool_bulk",
        ),
        (
            Group::Single,
            "rte_pktmbuf_alloc + free".to_string(),
            "pktmbuf_single",
        ),
        (
            Group::Bulk,
            format!("{} ({n}), per mbuf", super::MBUF_BULK),
            "pktmbuf_bulk",
        ),
    ];
    for (g, what, key) in rows {
        t.push(g, "dpdk", what, row(key), false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::peers::Txonly;

    #[test]
    fn a_round_has_the_same_rows_either_way_with_testpmd_last() {
        let s = Settings {
            harness: Harness {
                reps: 1,
                target: Duration::from_millis(1),
            },
            rounds: 2,
            cpu: 0,
            testpmd_period: Duration::from_secs(1),
            testpmd_samples: 1,
            no_dpdk: true,
        };
        let what = |t: &Table| -> Vec<(Group, &str, String)> {
            t.rows
                .iter()
                .map(|r| (r.group, r.who, r.what.clone()))
                .collect()
        };
        let (a, b) = (round(&s, false), round(&s, true));
        assert_eq!(what(&a), what(&b));
        let last = a.rows.last().unwrap();
        assert_eq!((last.who, last.what.as_str()), ("dpdk", TESTPMD));
        assert_eq!(last.result, Err("--no-dpdk".to_string()));
        // A run keeps each round's ratios (none here: no testpmd).
        let t = run(&s).unwrap();
        assert_eq!(t.rounds, vec![Txonly::default(); 2]);
    }
}
