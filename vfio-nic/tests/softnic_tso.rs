//! The software NIC's TSO on descriptors written by hand: a segment size
//! that makes a segment longer than its IP length field can say is a
//! request the model refuses (as malformed, nothing sent), as the
//! virtio-net model refuses a GSO packet past the IP length.

use std::sync::Arc;

use pfrag::dma::{Coherent, Dir, Domain, SoftIommu, SoftIommuConfig};
use vfio_nic::desc::{Context, Data, Dcmd, Desc, Popts};
use vfio_nic::device::TxDevice;
use vfio_nic::model::softnic::{self, NicStats, SoftNic};

mod common;

/// Sends one TSO packet over IPv4 (`v4`) or IPv6 and TCP of `paylen`
/// payload bytes cut at `mss`, and returns the model's counters and
/// frames.
fn tso(v4: bool, paylen: u16, mss: u16) -> (NicStats, Vec<Vec<u8>>) {
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu.clone()));
    let ring = Coherent::new(domain.clone(), 8 * 16, Dir::BIDIRECTIONAL).unwrap();
    let iplen: u16 = if v4 { 20 } else { 40 };
    let hlen = 14 + usize::from(iplen) + 20;
    let buf = Coherent::new(domain, 4096 + 65_536, Dir::TO_DEVICE).unwrap();
    let mut h = vec![0u8; hlen];
    h[12..14].copy_from_slice(if v4 { &[0x08, 0x00] } else { &[0x86, 0xdd] });
    h[14] = if v4 { 0x45 } else { 0x60 };
    h[14 + usize::from(iplen) + 12] = 0x50;
    buf.write(0, &h).unwrap();
    let ctx = Context::new(v4, 14, iplen, 20, mss, true);
    let popts = Popts::TXSM | if v4 { Popts::IXSM } else { Popts::empty() };
    let base = buf.iova().raw();
    let first = Data::new(base, hlen as u16, Dcmd::TSE, paylen.into(), popts);
    let end = Dcmd::EOP | Dcmd::RS;
    let rest = Data::new(base + 4096, paylen, end, 0, Popts::empty());
    common::put_descs(
        &ring,
        [Desc::Context(ctx), Desc::Data(first), Desc::Data(rest)],
    );
    let cfg = softnic::Config {
        capture: true,
        verify: false,
        ..softnic::Config::default()
    };
    let mut nic = SoftNic::new(iommu, cfg);
    // SAFETY: the ring is this test's, kept as long as the NIC.
    unsafe { nic.attach(ring.iova(), 8) }.unwrap();
    // SAFETY: the NIC's only mappings are `ring` and `buf`, reached by the
    // CPU only through `Coherent`'s accessors, not meanwhile.
    unsafe { nic.kick(3) }.unwrap();
    (nic.stats(), nic.take_frames())
}

/// The IP length a frame's header says: IPv4's total length, or IPv6's
/// payload length.
fn ip_len(f: &[u8], v4: bool) -> usize {
    let at = if v4 { 14 + 2 } else { 14 + 4 };
    usize::from(u16::from_be_bytes([f[at], f[at + 1]]))
}

#[test]
#[cfg_attr(miri, ignore = "copies 64 KiB segments byte by byte, too slow")]
fn a_segment_past_the_ip_length_is_refused() {
    for v4 in [true, false] {
        // 20 (IPv4) + 20 (TCP) + 65,495 fills IPv4's total length;
        // IPv6's payload length leaves out its own header: 20 + 65,515.
        let fits = if v4 { 65_495 } else { 65_515 };
        let (st, frames) = tso(v4, fits, fits);
        assert_eq!((st.frames, st.bad_desc), (1, 0), "{st:?}");
        let l4 = if v4 { 40 } else { 20 };
        assert_eq!(ip_len(&frames[0], v4), l4 + usize::from(fits));
        let (st, frames) = tso(v4, fits + 1, fits + 1);
        assert_eq!((st.packets, st.bad_desc, st.frames), (1, 1, 0), "{st:?}");
        assert_eq!(st.delivered_bytes, 0);
        assert!(frames.is_empty());
    }
}
