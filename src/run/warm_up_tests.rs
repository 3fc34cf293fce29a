//! A warm-up that loses packets fails the run: the measured part's
//! counters start after it, so its losses would never show in a row.

use super::*;
use pfrag::dma::Identity;
use pfrag::Iova;
use vfio_nic::model::softnic::{self, NicStats, SoftNic};

/// The software NIC, whose counters show one loss, made by the edit, once
/// it has seen a packet (as if the first packet were lost).
struct FaultFirst<D>(D, Edit);

/// Adds one loss to a model's counters.
type Edit = fn(&mut NicStats);

impl<D: TxDevice> TxDevice for FaultFirst<D> {
    type Format = D::Format;
    fn format(&self) -> D::Format {
        self.0.format()
    }
    unsafe fn attach(&mut self, ring: Iova, len: u16) -> vfio_nic::Result<()> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.0.attach(ring, len) }
    }
    unsafe fn kick(&mut self, tail: u16) -> vfio_nic::Result<()> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.0.kick(tail) }
    }
    fn detach(&mut self) -> vfio_nic::Result<()> {
        self.0.detach()
    }
    fn head(&mut self) -> Option<u16> {
        self.0.head()
    }
    fn check_running(&mut self) -> vfio_nic::Result<()> {
        self.0.check_running()
    }
}

impl<D: Model> Model for FaultFirst<D> {
    fn counters(&self) -> NicStats {
        let mut c = self.0.counters();
        if c.packets > 0 {
            (self.1)(&mut c);
        }
        c
    }
}

fn cfg(warmup: u64) -> RunConfig {
    test_config(IommuMode::Off, warmup)
}

fn run_on_fault_first(c: &RunConfig) -> Result<Vec<Row>, RunError> {
    run_on_loss(c, |c| c.faults += 1)
}

fn run_on_loss(c: &RunConfig, edit: Edit) -> Result<Vec<Row>, RunError> {
    let nic = move |m: Arc<Identity>| {
        let cfg = softnic::Config {
            touch: Touch::Checksum,
            capture: false,
            verify: true,
        };
        FaultFirst(SoftNic::new(m, cfg), edit)
    };
    measure_on(c, Arc::new(Identity::new()), &nic, &mut |_| {})
}

#[test]
fn a_fault_in_the_measured_part_is_in_the_row() {
    assert_eq!(run_on_fault_first(&cfg(0)).unwrap()[0].faults, 1);
}

#[test]
fn a_fault_in_the_warm_up_fails_the_run() {
    let r = run_on_fault_first(&cfg(8));
    assert!(
        matches!(r, Err(RunError::WarmUp { lost: 1 })),
        "{:?}",
        r.map(|rows| rows[0].faults)
    );
}

/// Every loss a model's counters can show, each alone: a stop without a
/// fault counted (the ring changed under the device), and a faulted packet
/// whose fault is missing (a model that miscounts).
const LOSSES: [(&str, Edit); 5] = [
    ("a fault", |c| c.faults += 1),
    ("a faulted packet", |c| c.faulted_packets += 1),
    ("a corrupt packet", |c| c.bad_payload += 1),
    ("a malformed descriptor", |c| c.bad_desc += 1),
    ("a stop", |c| c.stops += 1),
];

/// Each loss alone fails the warm-up, and in the measured part is in the
/// row's `faults` and among its problems.
#[test]
fn every_loss_alone_fails_the_warm_up_and_shows_in_the_row() {
    for (what, edit) in LOSSES {
        let r = run_on_loss(&cfg(8), edit);
        assert!(
            matches!(r, Err(RunError::WarmUp { lost: 1 })),
            "{what} in the warm-up: {:?}",
            r.map(|rows| rows[0].faults)
        );
        let row = &run_on_loss(&cfg(0), edit).unwrap()[0];
        assert_eq!(row.faults, 1, "{what} in the measured part");
        assert!(!row.problems().is_empty(), "{what} passed: {row:?}");
    }
}
