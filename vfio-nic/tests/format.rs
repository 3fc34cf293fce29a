//! The engine refuses formats whose constants it cannot use, when the
//! queue is built.

use std::sync::Arc;

use pfrag::dma::{Domain, SoftIommu, SoftIommuConfig};
use pfrag::pool::{self, Policy, Pool};
use pfrag::{Iova, Order};
use vfio_nic::device::TxDevice;
use vfio_nic::format::{Buf, Format, Packet, Status};
use vfio_nic::offload::{Layout, Offload};
use vfio_nic::tx::{Config, Queue};
use vfio_nic::Error;

/// A format with a descriptor of `SIZE` bytes and its status word at `AT`.
#[derive(Clone, Copy, Debug)]
struct Odd<const SIZE: usize, const AT: usize>;

// SAFETY: it writes no descriptor at all (every word stays zero, which
// the test device never reads).
unsafe impl<const SIZE: usize, const AT: usize> Format for Odd<SIZE, AT> {
    const NAME: &'static str = "odd";
    const DESC_SIZE: usize = SIZE;
    const MAX_BUF: usize = 4096;
    const MAX_PAYLOAD: usize = 4096;
    const STATUS_OFFSET: usize = AT;
    const HAS_CONTEXT: bool = false;
    type Context = ();
    fn context(&self, _: &Layout, _: Offload) {}
    fn write_context(&self, _: &mut [u64], _: &()) {}
    fn write_data(&self, _: &mut [u64], _: Buf, _: &Packet) {}
    fn status(&self, _: u32) -> Option<Status> {
        None
    }
}

/// A device that reads `F` and counts attaches.
#[derive(Default)]
struct Dev<F> {
    attached: usize,
    _f: std::marker::PhantomData<F>,
}

impl<F: Format + Copy + Default> TxDevice for Dev<F> {
    type Format = F;
    fn format(&self) -> F {
        F::default()
    }
    unsafe fn attach(&mut self, _: Iova, _: u16) -> vfio_nic::Result<()> {
        self.attached += 1;
        Ok(())
    }
    unsafe fn kick(&mut self, _: u16) -> vfio_nic::Result<()> {
        Ok(())
    }
}

impl<const SIZE: usize, const AT: usize> Default for Odd<SIZE, AT> {
    fn default() -> Self {
        Odd
    }
}

fn build<F: Format + Copy + Default>() -> vfio_nic::Result<()> {
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu));
    let pcfg = pool::Config::new(Order::new(0).unwrap(), Policy::Persistent);
    let pool = Pool::new(domain.clone(), pcfg).unwrap();
    Queue::new(domain, pool, Dev::<F>::default(), Config::default()).map(|q| {
        assert_eq!(q.device().attached, 1);
    })
}

#[test]
fn formats_the_engine_cannot_use_are_refused_when_the_queue_is_built() {
    let refused = |r: vfio_nic::Result<()>| matches!(r, Err(Error::BadConfig { .. }));
    assert!(refused(build::<Odd<12, 8>>()), "not whole 64-bit words");
    assert!(refused(build::<Odd<72, 8>>()), "longer than 64 bytes");
    assert!(refused(build::<Odd<16, 14>>()), "status word unaligned");
    assert!(refused(build::<Odd<16, 16>>()), "status word outside");
    build::<Odd<16, 12>>().unwrap();
    build::<Odd<64, 60>>().unwrap();
}
