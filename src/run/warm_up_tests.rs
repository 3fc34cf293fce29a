//! A warm-up that loses packets fails the run: the measured part's
//! counters start after it, so its losses would never show in a row.

use super::*;
use pfrag::dma::Identity;
use pfrag::Iova;
use vfio_nic::model::softnic::{self, NicStats, SoftNic};

/// The software NIC, whose counters show one fault once it has seen a
/// packet (as if the first packet faulted).
struct FaultFirst<D>(D);

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
            c.faults += 1;
        }
        c
    }
}

fn cfg(warmup: u64) -> RunConfig {
    test_config(IommuMode::Off, warmup)
}

fn run_on_fault_first(c: &RunConfig) -> Result<Vec<Row>, RunError> {
    let nic = |m: Arc<Identity>| {
        let cfg = softnic::Config {
            touch: Touch::Checksum,
            capture: false,
            verify: true,
        };
        FaultFirst(SoftNic::new(m, cfg))
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
