//! The peers table: its ratios, rounds and summary line.

use super::*;

fn t(ns: f64) -> Result<Timing, String> {
    Ok(Timing::from_samples(vec![ns * 0.9, ns, ns * 1.1]))
}

#[test]
fn summary_has_the_documented_form() {
    let mut tab = Table::default();
    tab.push(Group::Single, "pfrag", "frag", t(3.0), true);
    tab.push(Group::Single, "dpdk", MEMPOOL_SINGLE, t(4.0), false);
    tab.push(Group::Bulk, "pfrag", "bulk", t(1.0), true);
    tab.push(Group::Bulk, "dpdk", MEMPOOL_BULK, t(0.5), false);
    tab.push(
        Group::Bulk,
        "dpdk",
        format!("{MBUF_BULK} (32)"),
        t(4.0),
        false,
    );
    tab.push(Group::Txonly, "pfrag", TX_STRICT, t(50.0), true);
    tab.push(Group::Txonly, "pfrag", TX_OFF, t(40.0), false);
    tab.push(Group::Txonly, "pfrag", TX_DRIVER, t(20.0), false);
    tab.push(Group::Txonly, "pfrag", TX_VIRTIO, t(30.0), false);
    tab.push(Group::Txonly, "dpdk", run::TESTPMD, t(25.0), false);
    assert!(
        tab.spread()
            .contains("virtio/82576 format, the driver's ns per 64 B frame: 1.50 "),
        "{}",
        tab.spread()
    );
    assert_eq!(
        tab.summary(),
        "peers: single pfrag/dpdk=0.75 bulk pfrag/mbuf=0.25 txonly-driver pfrag/dpdk=1.25 \
         txonly-off pfrag/dpdk=0.62 txonly-strict pfrag/dpdk=0.50"
    );
    let text = tab.render();
    assert!(text.contains("1.33"), "{text}");
}

/// A round's txonly rows: pfrag's three rows at `drv`, `off` and
/// `strict` ns, testpmd at `pmd`.
fn txonly_round(drv: f64, off: f64, strict: f64, pmd: f64) -> Table {
    txonly_round_with(drv, off, strict, t(pmd))
}

/// [`txonly_round`] with testpmd's result as given (it may fail).
fn txonly_round_with(drv: f64, off: f64, strict: f64, pmd: Result<Timing, String>) -> Table {
    let mut tab = Table::default();
    tab.push(Group::Txonly, "pfrag", TX_STRICT, t(strict), true);
    tab.push(Group::Txonly, "pfrag", TX_OFF, t(off), false);
    tab.push(Group::Txonly, "pfrag", TX_DRIVER, t(drv), false);
    tab.push(Group::Txonly, "dpdk", run::TESTPMD, pmd, false);
    tab.rounds = vec![tab.txonly()];
    tab
}

/// A peer that failed in a round is compared with pfrag's rows of the
/// rounds it ran in only: pfrag's samples of the other round (here a
/// slow one) do not enter the ratios, as they do not enter the line
/// by round.
#[test]
fn ratios_pair_only_the_rounds_both_sides_ran_in() {
    let mut tab = txonly_round(10.0, 20.0, 40.0, 10.0);
    tab.merge(txonly_round_with(
        40.0,
        80.0,
        160.0,
        Err("no samples".into()),
    ))
    .unwrap();
    tab.merge(txonly_round(10.0, 20.0, 40.0, 10.0)).unwrap();
    assert!(
        tab.spread()
            .contains("(driver/off/strict): 1.00/0.50/0.25, n/a/n/a/n/a, 1.00/0.50/0.25\n"),
        "{}",
        tab.spread()
    );
    assert!(
        tab.summary().ends_with(
            "txonly-driver pfrag/dpdk=1.00 txonly-off pfrag/dpdk=0.50 \
             txonly-strict pfrag/dpdk=0.25"
        ),
        "{}",
        tab.summary()
    );
    assert!(
        tab.spread()
            .contains("pfrag/dpdk packets per second, txonly: 0.25 (spread 0.20-0.31;"),
        "{}",
        tab.spread()
    );
    // The table's column of multiples pairs the same rounds.
    let text = tab.render();
    let pmd = text.lines().find(|l| l.contains(run::TESTPMD)).unwrap();
    assert!(pmd.ends_with(" 0.25"), "{text}");
}

/// Each ratio compares with the DPDK row its line names: when
/// `rte_mempool`'s rows did not run, A and the bulk line against
/// `rte_mempool` say n/a, not pfrag against `rte_pktmbuf`.
#[test]
fn each_ratio_names_the_dpdk_row_it_compares_with() {
    let mut tab = Table::default();
    let gone = || Err("missing from the child's output".to_string());
    tab.push(Group::Single, "pfrag", "frag", t(3.0), true);
    tab.push(Group::Bulk, "pfrag", "bulk", t(1.0), true);
    tab.push(Group::Single, "dpdk", MEMPOOL_SINGLE, gone(), false);
    let bulk = format!("{MEMPOOL_BULK} (32), per object");
    tab.push(Group::Bulk, "dpdk", bulk, gone(), false);
    tab.push(
        Group::Single,
        "dpdk",
        "rte_pktmbuf_alloc + free",
        t(6.0),
        false,
    );
    let mbuf = format!("{MBUF_BULK} (32), per mbuf");
    tab.push(Group::Bulk, "dpdk", mbuf, t(4.0), false);
    assert!(
        tab.summary()
            .starts_with("peers: single pfrag/dpdk=n/a bulk pfrag/mbuf=0.25 "),
        "{}",
        tab.summary()
    );
    let spread = tab.spread();
    assert!(spread.contains("bulk against rte_mempool: n/a"), "{spread}");
    assert!(spread.contains("ns per object, single: n/a"), "{spread}");
}

#[test]
fn rounds_keep_their_own_ratios_and_the_summary_takes_all_samples() {
    let mut tab = txonly_round(10.0, 20.0, 40.0, 10.0);
    // testpmd four times as slow in the second round, pfrag twice.
    tab.merge(txonly_round(20.0, 40.0, 80.0, 40.0)).unwrap();
    let (a, b) = (
        Txonly {
            driver: Some(1.0),
            off: Some(0.5),
            strict: Some(0.25),
        },
        Txonly {
            driver: Some(2.0),
            off: Some(1.0),
            strict: Some(0.5),
        },
    );
    assert_eq!(tab.rounds, vec![a, b]);
    let line = "pfrag/dpdk packets per second by round (driver/off/strict): \
                1.00/0.50/0.25, 2.00/1.00/0.50\n";
    assert!(tab.spread().ends_with(line), "{}", tab.spread());
    // The summary's ratios are of the medians of both rounds' samples
    // together (testpmd 23.5 ns, the driver 14.5), not of one round
    // nor the mean of the rounds' ratios.
    let driver = tab.txonly().driver.unwrap();
    assert!((driver - 23.5 / 14.5).abs() < 1e-9, "{driver}");
    assert!(tab.summary().contains("txonly-driver pfrag/dpdk=1.62 "));
    // A round without testpmd says n/a there, and keeps its place.
    let mut lone = Table::default();
    lone.push(Group::Txonly, "pfrag", TX_DRIVER, t(5.0), false);
    lone.rounds = vec![lone.txonly()];
    assert_eq!(lone.rounds, vec![Txonly::default()]);
    assert!(lone
        .spread()
        .ends_with("(driver/off/strict): n/a/n/a/n/a\n"));
}

#[test]
fn a_peer_that_fails_in_one_round_keeps_the_others_and_says_so() {
    let round = |i: usize, pmd: Result<Timing, String>| {
        let mut tab = txonly_round_with(10.0, 20.0, 40.0, pmd);
        tab.note_failures(i);
        tab
    };
    let mut tab = round(1, t(10.0));
    tab.merge(round(2, Err("testpmd gave 0 of 2 samples".into())))
        .unwrap();
    tab.merge(round(3, t(10.0))).unwrap();
    assert!(
        tab.summary().ends_with("txonly-driver pfrag/dpdk=1.00 txonly-off pfrag/dpdk=0.50 txonly-strict pfrag/dpdk=0.25"),
        "{}",
        tab.summary()
    );
    let spread = tab.spread();
    assert!(
        spread.contains("1.00/0.50/0.25, n/a/n/a/n/a, 1.00/0.50/0.25"),
        "{spread}"
    );
    assert!(
        spread.contains(&format!(
            "dpdk {}: failed in round 2: testpmd gave 0 of 2 samples; its other rounds are kept",
            run::TESTPMD
        )),
        "{spread}"
    );
    // Failed in every round: the row says why itself, once.
    let mut all = round(1, Err("no testpmd".into()));
    all.merge(round(2, Err("no testpmd".into()))).unwrap();
    assert!(all.summary().contains("txonly-driver pfrag/dpdk=n/a"));
    assert!(!all.spread().contains("failed in"), "{}", all.spread());
    assert!(all.render().contains("skipped: no testpmd"));
    // A pfrag row that failed in one round stays failed.
    let mut bad = txonly_round(10.0, 20.0, 40.0, 10.0);
    bad.rows[0].result = Err("device delivered 0 of 64 bytes".into());
    let mut tab = txonly_round(10.0, 20.0, 40.0, 10.0);
    tab.merge(bad).unwrap();
    assert!(tab.rows[0].result.is_err());
    assert!(tab.summary().ends_with("txonly-strict pfrag/dpdk=n/a"));
}

#[test]
fn a_table_without_rounds_prints_no_round_line() {
    let tab = txonly_round(10.0, 20.0, 40.0, 10.0);
    let mut bare = tab.clone();
    bare.rounds.clear();
    assert!(!bare.spread().contains("by round"));
    assert!(tab.spread().contains("by round"));
}

#[test]
fn a_skipped_peer_is_printed_with_its_reason_and_ratios_say_na() {
    let mut tab = Table::default();
    tab.push(Group::Single, "pfrag", "frag", t(3.0), true);
    tab.push(
        Group::Single,
        "dpdk",
        "mempool",
        Err("no libdpdk".into()),
        false,
    );
    assert!(tab.render().contains("skipped: no libdpdk"));
    assert_eq!(
        tab.summary(),
        "peers: single pfrag/dpdk=n/a bulk pfrag/mbuf=n/a txonly-driver pfrag/dpdk=n/a \
         txonly-off pfrag/dpdk=n/a txonly-strict pfrag/dpdk=n/a"
    );
}

/// Rounds whose rows are not the same measurements, in the same order,
/// are not merged: their samples would mix. Only their number was
/// compared before.
#[test]
fn rounds_with_other_rows_are_not_merged() {
    let mut first = txonly_round(10.0, 15.0, 30.0, 13.0);
    let mut other = txonly_round(10.0, 15.0, 30.0, 13.0);
    other.rows.swap(1, 2);
    let e = first.clone().merge(other).unwrap_err();
    assert!(e.contains(TX_OFF) && e.contains(TX_DRIVER), "{e}");
    let same = txonly_round(11.0, 16.0, 31.0, 14.0);
    first.merge(same).unwrap();
    assert_eq!(first.rows[0].rounds.len(), 2);
}

/// Two rows with different numbers of rounds are not paired: zipping
/// them would pair rounds that are not the same.
#[test]
fn rows_of_different_round_counts_are_not_paired() {
    let mut tab = txonly_round(10.0, 15.0, 30.0, 13.0);
    tab.merge(txonly_round(11.0, 16.0, 31.0, 14.0)).unwrap();
    let (a, mut b) = (tab.rows[0].clone(), tab.rows[3].clone());
    assert!(paired(&a, &b).is_some());
    b.rounds.truncate(1);
    assert!(paired(&a, &b).is_none());
}
