//! Property harnesses shared by the fuzz targets (`fuzz/`, nightly,
//! cargo-fuzz) and the stable property tests (`tests/fuzz_props.rs`): each
//! takes raw bytes, decodes an input from them with `arbitrary`, runs it,
//! and returns `Err` with a reason when a property fails (a panic is a
//! failure too).
//!
//! - [`softnic_ring`]: the software NIC processing arbitrary ring contents
//!   over arbitrary mappings never panics and never touches memory outside
//!   what is mapped for the access: every region keeps its bytes, and only
//!   the ring's status dwords may change (to `DD`).
//! - [`wire_frame`]: the wire checker never panics, a frame it accepts
//!   parses as IPv4/TCP, and the same frame twice counts its payload bytes
//!   at most once, each frame good, bad or unplaced.
//! - [`iommu_info`]: the `VFIO_IOMMU_GET_INFO` parser never panics, and
//!   reports no more ranges than the buffer holds.
//! - [`virtio_ring`]: the virtio-net model on arbitrary virtqueue contents
//!   never panics and writes nothing but the used ring.

mod virtio;

pub use virtio::{virtio_ring, VDescIn, VirtqIn};

use std::sync::Arc;

use arbitrary::{Arbitrary, Unstructured};
use pfrag::dma::{Coherent, Dir, DmaMapper, Domain, Identity, Invalidation};
use pfrag::dma::{SoftIommu, SoftIommuConfig, Translate};
use vfio_nic::device::TxDevice;
use vfio_nic::model::softnic::{self, SoftNic, Touch};

/// Descriptors in the fuzzed ring.
const RING: usize = 16;

/// One data region of the fuzzed input.
#[derive(Arbitrary, Debug)]
pub struct RegionIn {
    /// Pages, 1..=4 after reduction.
    pub pages: u8,
    /// Direction bits (reduced to a non-empty `Dir`).
    pub dir: u8,
    /// Byte the region is filled with.
    pub fill: u8,
}

/// One descriptor: two words, the address either raw or inside a region.
#[derive(Arbitrary, Debug)]
pub struct DescIn {
    /// `Some((region, offset))`: the address lies in that region (offset
    /// may run past its end).
    pub in_region: Option<(u8, u16)>,
    /// The address word when `in_region` is `None`.
    pub raw: u64,
    /// The second word (command, length, status, PAYLEN...).
    pub w1: u64,
}

/// A fuzzed software-NIC run.
#[derive(Arbitrary, Debug)]
pub struct RingIn {
    /// Software IOMMU (and lazy invalidation) or the identity mapper.
    pub soft: bool,
    /// Lazy invalidation, with the software IOMMU.
    pub lazy: bool,
    /// Checksum every byte, or a line per page.
    pub checksum: bool,
    /// Data regions (at most 4 used).
    pub regions: Vec<RegionIn>,
    /// Descriptors (at most 16 used).
    pub descs: Vec<DescIn>,
    /// Unmap this region before the kick.
    pub unmap: Option<u8>,
    /// Doorbell values, in order (reduced mod the ring size).
    pub tails: Vec<u8>,
}

pub(crate) fn dir(bits: u8) -> Dir {
    match bits % 3 {
        0 => Dir::TO_DEVICE,
        1 => Dir::FROM_DEVICE,
        _ => Dir::BIDIRECTIONAL,
    }
}

/// The software NIC on arbitrary ring contents; see the module docs.
pub fn softnic_ring(data: &[u8]) -> Result<(), String> {
    let Ok(input) = RingIn::arbitrary(&mut Unstructured::new(data)) else {
        return Ok(());
    };
    if input.soft {
        let inv = if input.lazy {
            Invalidation::Lazy
        } else {
            Invalidation::Strict
        };
        let cfg = SoftIommuConfig {
            invalidation: inv,
            flush_queue: 2,
            iotlb_entries: 8,
            ..SoftIommuConfig::default()
        };
        run_ring(
            Arc::new(SoftIommu::new(cfg).map_err(|e| e.to_string())?),
            &input,
        )
    } else {
        run_ring(Arc::new(Identity::new()), &input)
    }
}

fn run_ring<M: DmaMapper + Translate + 'static>(m: Arc<M>, input: &RingIn) -> Result<(), String> {
    let domain = Arc::new(Domain::new(m.clone()));
    let ring =
        Coherent::new(domain.clone(), RING * 16, Dir::BIDIRECTIONAL).map_err(|e| e.to_string())?;
    let mut regions = Vec::new();
    for r in input.regions.iter().take(4) {
        let pages = usize::from(r.pages % 4) + 1;
        let c =
            Coherent::new(domain.clone(), pages * 4096, dir(r.dir)).map_err(|e| e.to_string())?;
        c.write(0, &vec![r.fill; pages * 4096])
            .map_err(|e| e.to_string())?;
        regions.push((c, r.fill));
    }
    let mut words = [0u64; RING * 2];
    for (i, d) in input.descs.iter().take(RING).enumerate() {
        let addr = match d.in_region {
            Some((k, off)) if !regions.is_empty() => {
                let (c, _) = &regions[usize::from(k) % regions.len()];
                c.iova().raw().wrapping_add(u64::from(off))
            }
            _ => d.raw,
        };
        words[2 * i] = addr;
        words[2 * i + 1] = d.w1;
    }
    for (i, w) in words.iter().enumerate() {
        ring.write_u64(i * 8, *w).map_err(|e| e.to_string())?;
    }
    if let Some(k) = input.unmap {
        if !regions.is_empty() {
            // Dropping a region unmaps it: descriptors now point at nothing.
            let k = usize::from(k) % regions.len();
            drop(regions.remove(k));
        }
    }
    let touch = if input.checksum {
        Touch::Checksum
    } else {
        Touch::Pages
    };
    let mut nic = SoftNic::new(
        m,
        softnic::Config {
            touch,
            capture: input.checksum,
            verify: input.lazy,
        },
    );
    // SAFETY: `ring` is this run's, kept for the device until it drops.
    unsafe { nic.attach(ring.iova(), RING as u16) }.map_err(|e| e.to_string())?;
    let mut walked = 0u64;
    let mut head = 0usize;
    for &t in input.tails.iter().take(4) {
        let t = usize::from(t) % RING;
        // SAFETY: the descriptors may name any IOVA, but `m` is this
        // run's own mapper: its only mappings are `ring` and `regions`,
        // `Coherent` memory that the CPU reaches only through its atomic
        // accessors (and not during the call). Anything else faults.
        unsafe { nic.kick(t as u16) }.map_err(|e| e.to_string())?;
        walked += ((t + RING - head) % RING) as u64;
        head = t;
    }
    check_untouched(&ring, &words, &regions)?;
    let st = nic.stats();
    if st.descs != walked {
        return Err(format!("walked {walked} descriptors, counted {}", st.descs));
    }
    Ok(())
}

/// Regions keep every byte; the ring changes only in status dwords, to DD.
fn check_untouched<M: DmaMapper>(
    ring: &Coherent<M>,
    words: &[u64],
    regions: &[(Coherent<M>, u8)],
) -> Result<(), String> {
    for (k, (c, fill)) in regions.iter().enumerate() {
        let mut b = vec![0u8; c.len()];
        c.read(0, &mut b).map_err(|e| e.to_string())?;
        if let Some(i) = b.iter().position(|x| x != fill) {
            return Err(format!("region {k} changed at byte {i}"));
        }
    }
    for (i, &w) in words.iter().enumerate() {
        let now = ring.read_u64(i * 8).map_err(|e| e.to_string())?;
        let status_word = i % 2 == 1;
        let allowed = now == w || (status_word && now == (w & 0xffff_ffff) | (1 << 32));
        if !allowed {
            return Err(format!("ring word {i} became {now:#x} (was {w:#x})"));
        }
    }
    Ok(())
}

/// The wire checker on arbitrary bytes; see the module docs.
pub fn wire_frame(data: &[u8]) -> Result<(), String> {
    let mut w = vfio_nic::check::wire::WireCheck::default();
    let mut payload = 0;
    if w.frame(data).is_ok() {
        let p = etherparse::SlicedPacket::from_ethernet(data)
            .map_err(|e| format!("accepted a frame that does not parse: {e}"))?;
        if let Some(etherparse::TransportSlice::Tcp(t)) = p.transport {
            payload = t.payload().len() as u64;
        }
    }
    // More frames after the first exercise the per-flow state: the same
    // frame again is a copy, whose bytes do not count again; a second
    // copy waits with the first, held until the flow's next frame.
    let _ = w.frame(data);
    let _ = w.frame(data);
    let r = w.report();
    if r.frames != r.good_frames + r.bad_frames + r.unplaced_frames {
        return Err(format!("frames miscounted: {r:?}"));
    }
    if r.payload_bytes > payload {
        return Err(format!("a {payload}-byte payload counted as {r:?}"));
    }
    Ok(())
}

/// The `VFIO_IOMMU_GET_INFO` parser on arbitrary bytes; see the module docs.
pub fn iommu_info(data: &[u8]) -> Result<(), String> {
    let info = vfio_nic::hw::vfio::parse_iommu_info(data);
    if info.ranges.len() > data.len() / 16 {
        return Err(format!(
            "{} ranges from {} bytes",
            info.ranges.len(),
            data.len()
        ));
    }
    Ok(())
}

/// Seed inputs for the fuzz targets, built from what the tests use: valid
/// frames of several flows and sizes for `wire`, a `GET_INFO` buffer with a
/// two-range IOVA capability and a DMA-avail capability for `iommu_info`.
/// `examples/fuzz_seeds.rs` writes them into the corpora.
pub fn seeds(target: &str) -> Vec<Vec<u8>> {
    match target {
        "wire" => wire_seeds(),
        "iommu_info" => vec![info_seed()],
        _ => Vec::new(),
    }
}

fn wire_seeds() -> Vec<Vec<u8>> {
    use vfio_nic::gen::flow::{Flow, HDR_LEN};
    let mut out = Vec::new();
    for (flow, len) in [(0usize, 1usize), (3, 100), (7, 1448)] {
        let mut f = match Flow::new(flow) {
            Ok(f) => f,
            Err(_) => continue,
        };
        let mut hdr = [0u8; HDR_LEN];
        f.next_header(len, 1448, &mut hdr);
        let mut payload = vec![0u8; len];
        vfio_nic::gen::pattern::fill(flow as u32, 0, &mut payload);
        let mut fr = hdr.to_vec();
        fr.extend_from_slice(&payload);
        // The NIC fills in the checksums: so does the seed, via etherparse.
        let sums = etherparse::SlicedPacket::from_ethernet(&fr)
            .ok()
            .and_then(|p| match (p.net, p.transport) {
                (
                    Some(etherparse::NetSlice::Ipv4(ip)),
                    Some(etherparse::TransportSlice::Tcp(tcp)),
                ) => {
                    let iph = ip.header().to_header();
                    let t = tcp.to_header().calc_checksum_ipv4(&iph, &payload).ok()?;
                    Some((iph.calc_header_checksum(), t))
                }
                _ => None,
            });
        let Some((ipsum, tcpsum)) = sums else {
            continue;
        };
        fr[24..26].copy_from_slice(&ipsum.to_be_bytes());
        fr[50..52].copy_from_slice(&tcpsum.to_be_bytes());
        out.push(fr);
    }
    out
}

fn info_seed() -> Vec<u8> {
    // struct vfio_iommu_type1_info: argsz, flags (CAPS = 1 << 1),
    // iova_pgsizes, cap_offset; then the IOVA-range capability (id 1) with
    // two inclusive ranges, then DMA-avail (id 3).
    let mut b = Vec::new();
    let w32 = |b: &mut Vec<u8>, v: u32| b.extend_from_slice(&v.to_le_bytes());
    let w64 = |b: &mut Vec<u8>, v: u64| b.extend_from_slice(&v.to_le_bytes());
    w32(&mut b, 0);
    w32(&mut b, 1 << 1 | 1);
    w64(&mut b, (1 << 12) | (1 << 21));
    w32(&mut b, 24);
    w32(&mut b, 0);
    let avail_at = 24 + 16 + 32;
    b.extend_from_slice(&1u16.to_le_bytes());
    b.extend_from_slice(&1u16.to_le_bytes());
    w32(&mut b, avail_at);
    w32(&mut b, 2);
    w32(&mut b, 0);
    w64(&mut b, 0);
    w64(&mut b, 0xfedf_ffff);
    w64(&mut b, 0xfef0_0000);
    w64(&mut b, (1 << 39) - 1);
    b.extend_from_slice(&3u16.to_le_bytes());
    b.extend_from_slice(&1u16.to_le_bytes());
    w32(&mut b, 0);
    w32(&mut b, 65_535);
    w32(&mut b, 0);
    let n = b.len() as u32;
    b[0..4].copy_from_slice(&n.to_le_bytes());
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_are_what_the_parsers_accept() {
        let frames = seeds("wire");
        assert_eq!(frames.len(), 3);
        let mut w = vfio_nic::check::wire::WireCheck::default();
        for f in &frames {
            w.frame(f).unwrap();
            assert_eq!(wire_frame(f), Ok(()));
        }
        let info = vfio_nic::hw::vfio::parse_iommu_info(&seeds("iommu_info")[0]);
        assert_eq!(info.ranges, vec![0..0xfee0_0000, 0xfef0_0000..(1 << 39)]);
        assert_eq!(info.dma_avail, Some(65_535));
    }
}
