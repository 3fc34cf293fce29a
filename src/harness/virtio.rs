//! The virtio-net model on arbitrary virtqueue contents: descriptors with
//! any address, length, flags and `next`, an available ring with any
//! entries and index, headers of any bytes, over mappings of any direction
//! (one of them unmapped before the doorbell). The model must never panic
//! and never write outside the used ring: every buffer, the descriptor
//! table and the available ring keep their bytes. An available index the
//! device cannot accept is an error of the doorbell, not a crash.

use std::sync::Arc;

use arbitrary::{Arbitrary, Unstructured};
use pfrag::dma::Translate;
use pfrag::dma::{Coherent, Dir, DmaMapper, Domain, Invalidation, SoftIommu, SoftIommuConfig};
use vfio_nic::device::TxDevice;
use vfio_nic::format::virtio::{features, Layout, Split};
use vfio_nic::format::Format;
use vfio_nic::model::softnic;
use vfio_nic::model::virtio::VirtioNet;

use super::{dir, RegionIn};

/// Entries of the fuzzed virtqueue.
const SIZE: u16 = 16;

/// One descriptor: its address either raw or inside a region.
#[derive(Arbitrary, Debug)]
pub struct VDescIn {
    /// `Some((region, offset))`: the address lies in that region (the
    /// offset may run past its end).
    pub in_region: Option<(u8, u16)>,
    /// The address when `in_region` is `None`.
    pub raw: u64,
    /// Length.
    pub len: u32,
    /// Flags (`NEXT`, `WRITE`, `INDIRECT`, and the rest).
    pub flags: u16,
    /// The next descriptor's index.
    pub next: u16,
}

/// A fuzzed virtio-net run.
#[derive(Arbitrary, Debug)]
pub struct VirtqIn {
    /// Offer `EVENT_IDX`.
    pub event_idx: bool,
    /// Lazy invalidation.
    pub lazy: bool,
    /// Data regions (at most 4 used).
    pub regions: Vec<RegionIn>,
    /// Bytes at the start of the first region: a `virtio_net_hdr` and the
    /// frame's headers, for the parser to chew on.
    pub head: Vec<u8>,
    /// Descriptors (at most 16 used).
    pub descs: Vec<VDescIn>,
    /// Available ring entries (at most 16 used).
    pub avail: Vec<u16>,
    /// The available index.
    pub avail_idx: u16,
    /// Unmap this region before the doorbell.
    pub unmap: Option<u8>,
    /// Doorbells (1..=3).
    pub kicks: u8,
}

/// The virtio-net model on arbitrary virtqueue contents; see the module
/// docs.
pub fn virtio_ring(data: &[u8]) -> Result<(), String> {
    let Ok(input) = VirtqIn::arbitrary(&mut Unstructured::new(data)) else {
        return Ok(());
    };
    let cfg = SoftIommuConfig {
        invalidation: if input.lazy {
            Invalidation::Lazy
        } else {
            Invalidation::Strict
        },
        flush_queue: 2,
        iotlb_entries: 8,
        ..SoftIommuConfig::default()
    };
    let m = Arc::new(SoftIommu::new(cfg).map_err(|e| e.to_string())?);
    run(m, &input)
}

fn run<M: DmaMapper + Translate + 'static>(m: Arc<M>, input: &VirtqIn) -> Result<(), String> {
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let domain = Arc::new(Domain::new(m.clone()));
    let l = Layout::new(SIZE);
    let ring = Coherent::new(domain.clone(), Split::ring_bytes(SIZE), Dir::BIDIRECTIONAL)
        .map_err(|x| e(&x))?;
    let mut regions = Vec::new();
    for (k, r) in input.regions.iter().take(4).enumerate() {
        let pages = usize::from(r.pages % 4) + 1;
        let c = Coherent::new(domain.clone(), pages * 4096, dir(r.dir)).map_err(|x| e(&x))?;
        let mut bytes = vec![r.fill; pages * 4096];
        if k == 0 {
            let n = input.head.len().min(bytes.len());
            bytes[..n].copy_from_slice(&input.head[..n]);
        }
        c.write(0, &bytes).map_err(|x| e(&x))?;
        regions.push((c, bytes));
    }
    let mut table = vec![0u8; l.avail];
    for (i, d) in input.descs.iter().take(usize::from(SIZE)).enumerate() {
        let addr = match d.in_region {
            Some((k, off)) if !regions.is_empty() => {
                let (c, _) = &regions[usize::from(k) % regions.len()];
                c.iova().raw().wrapping_add(u64::from(off))
            }
            _ => d.raw,
        };
        let at = &mut table[16 * i..16 * i + 16];
        at[..8].copy_from_slice(&addr.to_le_bytes());
        at[8..12].copy_from_slice(&d.len.to_le_bytes());
        at[12..14].copy_from_slice(&d.flags.to_le_bytes());
        at[14..16].copy_from_slice(&d.next.to_le_bytes());
    }
    let mut avail = vec![0u8; l.used - l.avail];
    avail[2..4].copy_from_slice(&input.avail_idx.to_le_bytes());
    for (i, a) in input.avail.iter().take(usize::from(SIZE)).enumerate() {
        avail[4 + 2 * i..6 + 2 * i].copy_from_slice(&a.to_le_bytes());
    }
    ring.write(0, &table).map_err(|x| e(&x))?;
    ring.write(l.avail, &avail).map_err(|x| e(&x))?;
    if let (Some(k), false) = (input.unmap, regions.is_empty()) {
        // Dropping a region unmaps it: descriptors now point at nothing.
        let k = usize::from(k) % regions.len();
        drop(regions.remove(k));
    }
    let mut offered = features::USED;
    if !input.event_idx {
        offered &= !features::EVENT_IDX;
    }
    let ncfg = softnic::Config {
        capture: true,
        verify: input.lazy,
        ..softnic::Config::default()
    };
    let mut nic = VirtioNet::offering(m, ncfg, offered).map_err(|x| e(&x))?;
    // SAFETY: `ring` is this run's, kept for the device until it drops.
    unsafe { nic.attach(ring.iova(), SIZE) }.map_err(|x| e(&x))?;
    for _ in 0..input.kicks % 3 + 1 {
        // SAFETY: the descriptors may name any IOVA, but `m` is this run's
        // own mapper: its only mappings are `ring` and `regions`,
        // `Coherent` memory that the CPU reaches only through its atomic
        // accessors, and not during the call. Anything else faults. A
        // doorbell the device refuses (an available index past the ring)
        // is an error, which is fine here.
        let _ = unsafe { nic.kick(0) };
    }
    let _ = nic.stats();
    untouched(&ring, &table, &avail, l.avail, &regions)
}

/// Regions, the descriptor table and the available ring keep every byte.
fn untouched<M: DmaMapper>(
    ring: &Coherent<M>,
    table: &[u8],
    avail: &[u8],
    avail_at: usize,
    regions: &[(Coherent<M>, Vec<u8>)],
) -> Result<(), String> {
    let same = |c: &Coherent<M>, off: usize, want: &[u8], what: &str| {
        let mut b = vec![0u8; want.len()];
        c.read(off, &mut b).map_err(|x| x.to_string())?;
        match b.iter().zip(want).position(|(x, y)| x != y) {
            Some(i) => Err(format!("{what} changed at byte {i}")),
            None => Ok(()),
        }
    };
    same(ring, 0, table, "the descriptor table")?;
    same(ring, avail_at, avail, "the available ring")?;
    for (k, (c, bytes)) in regions.iter().enumerate() {
        same(c, 0, bytes, &format!("region {k}"))?;
    }
    Ok(())
}
