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
    const MAX_PAYLOAD: usize = 9000;
    const STATUS_OFFSET: usize = AT;
    const HAS_CONTEXT: bool = false;
    type Context = ();
    fn context(&self, _: &Layout, _: Offload) {}
    fn write_context(&self, _: &mut [u64], _: &()) {}
    fn write_data(&self, _: &mut [u64], _: Buf, _: &Packet) {}
    fn ask_report(&self, _: &mut [u64]) {}
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
    // SAFETY: the test device reads no memory at all.
    unsafe { Queue::new(domain, pool, Dev::<F>::default(), Config::default()) }.map(|q| {
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

type OddQueue = Queue<Arc<SoftIommu>, Dev<Odd<16, 12>>>;

fn domain() -> Arc<Domain<Arc<SoftIommu>>> {
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    Arc::new(Domain::new(iommu))
}

fn pool_on(d: &Arc<Domain<Arc<SoftIommu>>>) -> Pool<Arc<SoftIommu>> {
    let pcfg = pool::Config::new(Order::new(0).unwrap(), Policy::Persistent);
    Pool::new(d.clone(), pcfg).unwrap()
}

fn odd_queue(d: &Arc<Domain<Arc<SoftIommu>>>, cfg: Config) -> vfio_nic::Result<OddQueue> {
    // SAFETY: the test device reads no memory at all.
    unsafe { Queue::new(d.clone(), pool_on(d), Dev::default(), cfg) }
}

/// An IOVA means something only in its own domain: a pool, or a frag,
/// mapped in another domain than the queue's ring is refused, and a
/// refused frag comes back to the caller.
#[test]
fn memory_of_another_domain_is_refused() {
    let (a, b) = (domain(), domain());
    // SAFETY: as above.
    let r = unsafe {
        Queue::new(
            a.clone(),
            pool_on(&b),
            Dev::<Odd<16, 12>>::default(),
            Config::default(),
        )
    };
    assert!(matches!(r, Err(Error::WrongDomain { what: "the pool" })));
    let mut q = odd_queue(&a, Config::default()).unwrap();
    let mut other = pfrag::frag::FragCache::new(pool_on(&b));
    let mut frags = vec![other.refill(100, true).unwrap()];
    let hdr = [0u8; 14];
    assert!(matches!(
        q.post(&hdr, &mut frags, Offload::None, 1),
        Err(Error::WrongDomain { what: "a frag" })
    ));
    assert_eq!((frags.len(), q.in_flight(), q.stats().descs), (1, 0, 0));
    // A frag cache of another domain swapped in is refused too.
    let mut foreign_cache = pfrag::frag::FragCache::new(pool_on(&b));
    std::mem::swap(q.cache_mut(), &mut foreign_cache);
    assert!(matches!(
        q.send(&hdr, &[1u8; 200], Offload::None, 3),
        Err(Error::WrongDomain { .. })
    ));
    std::mem::swap(q.cache_mut(), &mut foreign_cache);
    // A frag of the queue's own domain goes.
    let mut own = Vec::new();
    q.frags(100, &mut own).unwrap();
    q.post(&hdr, &mut own, Offload::None, 2).unwrap();
    assert_eq!(q.in_flight(), 1);
}

/// Headers go in one buffer: more header bytes than the format's largest
/// buffer are refused, before anything is posted.
#[test]
fn headers_longer_than_one_buffer_are_refused() {
    let cfg = Config {
        mtu: 9000,
        ..Config::default()
    };
    let mut q = odd_queue(&domain(), cfg).unwrap();
    let hdr = vec![0u8; 5000];
    match q.send(&hdr, &[1u8; 10], Offload::None, 1) {
        Err(Error::BadHeaders {
            why:
                vfio_nic::offload::HeaderFault::TooLong {
                    len: 5000,
                    max: 4096,
                },
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(
        (q.in_flight(), q.stats().descs, q.stats().header_fallbacks),
        (0, 0, 0)
    );
}
