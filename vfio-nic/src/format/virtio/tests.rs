//! The split virtqueue's layout, negotiation and driver ring state.

use super::*;

/// A ring of 0 entries has no entries: its entry offsets are entry
/// 0's, where they used to divide by zero.
#[test]
fn a_ring_of_no_entries_does_not_panic() {
    let l = Layout::new(0);
    assert_eq!((l.avail, l.used, l.bytes), (0, 8, 14));
    for i in [0, 1, u16::MAX] {
        assert_eq!((l.avail_entry(i), l.used_entry(i)), (4, 12));
    }
}

/// Entry `i` is entry `i % size` for every index, the masked sizes
/// (powers of two) and the others alike.
#[test]
fn entries_wrap_at_the_ring_size() {
    let sizes = [1u16, 2, 3, 8, 256, 384, 1024, 32768, u16::MAX];
    let step = if cfg!(miri) { 4099 } else { 1 };
    for size in sizes {
        let l = Layout::new(size);
        for i in (0..=u16::MAX).step_by(step).chain([u16::MAX]) {
            let at = usize::from(i % size);
            assert_eq!(l.avail_entry(i), l.avail + 4 + 2 * at, "{i} of {size}");
            assert_eq!(l.used_entry(i), l.used + 4 + 8 * at, "{i} of {size}");
        }
    }
}

#[test]
fn the_layout_follows_the_spec_alignment() {
    // Descriptor table 16 * n, available ring 6 + 2n, used ring
    // 4-byte aligned, 6 + 8n.
    let l = Layout::new(8);
    assert_eq!((l.avail, l.used, l.bytes), (128, 152, 152 + 6 + 64));
    assert_eq!(l.avail_entry(9), 128 + 4 + 2);
    assert_eq!(l.used_entry(8), 152 + 4);
    assert_eq!(l.avail_event(), 152 + 4 + 64);
    let odd = Layout::new(3);
    assert_eq!(odd.used % 4, 0);
}

/// The memory of an 8-entry virtqueue, mapped on a software IOMMU.
fn ring8() -> pfrag::dma::Coherent<pfrag::dma::SoftIommu> {
    memory(Split::ring_bytes(8))
}

/// `bytes` of ring memory (a whole number of pages), mapped on a software
/// IOMMU.
fn memory(bytes: usize) -> pfrag::dma::Coherent<pfrag::dma::SoftIommu> {
    use pfrag::dma::{Coherent, Dir, Domain, SoftIommu, SoftIommuConfig};
    let domain = std::sync::Arc::new(Domain::new(
        SoftIommu::new(SoftIommuConfig::default()).unwrap(),
    ));
    Coherent::new(domain, bytes, Dir::BIDIRECTIONAL).unwrap()
}

#[test]
fn completions_out_of_order_free_each_packet_only_once_its_head_is_used() {
    let ring = ring8();
    let mem = RingMem::new(&ring, 8);
    let l = Layout::new(8);
    let mut f = Split::negotiate(features::USED).unwrap();
    for head in [0, 2, 4] {
        f.publish(&mem, head).unwrap();
    }
    f.flush(&mem).unwrap();
    assert_eq!(mem.read_u16(l.avail_idx()).unwrap(), 3);
    assert_eq!(mem.read_u16(l.avail_entry(1)).unwrap(), 2);
    // The device returns the second packet first, then the first.
    let used = |i: u16, id: u32| ring.write_u32(l.used_entry(i), id).unwrap();
    used(0, 2);
    used(1, 0);
    mem.write_u16(l.used_idx(), 2).unwrap();
    assert_eq!(f.done(&mem, 0, 1).unwrap(), Some(Status::Ok));
    assert_eq!(f.done(&mem, 2, 3).unwrap(), Some(Status::Ok));
    assert_eq!(f.done(&mem, 4, 4).unwrap(), None, "not used yet");
    used(2, 4);
    mem.write_u16(l.used_idx(), 3).unwrap();
    assert_eq!(f.done(&mem, 4, 4).unwrap(), Some(Status::Ok));
}

/// Publishes packets at `heads` and flushes them: a format with every
/// feature, over `mem`.
fn published(mem: &RingMem<'_, pfrag::dma::SoftIommu>, heads: &[u16]) -> Split {
    let mut f = Split::negotiate(features::USED).unwrap();
    for &h in heads {
        f.publish(mem, h).unwrap();
    }
    f.flush(mem).unwrap();
    f
}

/// Used entries `ids` from used entry `from` on, and the used index after
/// them, as a device writes them.
fn use_ids(ring: &pfrag::dma::Coherent<pfrag::dma::SoftIommu>, from: u16, ids: &[u32]) {
    let l = Layout::new(8);
    for (i, &id) in ids.iter().enumerate() {
        ring.write_u32(l.used_entry(from + i as u16), id).unwrap();
    }
    let idx = (from + ids.len() as u16).to_le_bytes();
    ring.write(l.used_idx(), &idx).unwrap();
}

/// A used entry whose id is out of the ring, names no head made available
/// (a slot inside another packet's chain), or names a head used already,
/// is an error with its numbers, every time it is read: nothing is freed
/// for it, and the entries after it are not taken. They used to be
/// ignored without a word, the walk going on past them.
#[test]
fn a_used_entry_that_names_no_packet_the_device_holds_is_an_error() {
    for (bad, why) in [
        (99, "out of range"),
        (1, "never made available"),
        (0, "used twice"),
    ] {
        let ring = ring8();
        let mem = RingMem::new(&ring, 8);
        // Packets at heads 0 (slots 0 and 1), 2 and 3.
        let mut f = published(&mem, &[0, 2, 3]);
        use_ids(&ring, 0, &[0, bad, 2]);
        assert_eq!(f.done(&mem, 0, 1).unwrap(), Some(Status::Ok), "{why}");
        for _ in 0..2 {
            match f.done(&mem, 2, 2) {
                Err(Error::UsedId {
                    entry: 1,
                    id,
                    size: 8,
                }) if id == bad => {}
                r => panic!("{why}: {r:?}"),
            }
        }
    }
}

/// A used index further ahead than the packets the device holds would
/// make the walk take the entries of the ring's last lap as new: their
/// ids name heads made available again since, whose buffers the device
/// may still read. It is an error, and nothing is taken; the driver used
/// to take the stale entries and free those packets.
#[test]
fn a_used_index_past_the_packets_made_available_is_an_error() {
    let ring = ring8();
    let mem = RingMem::new(&ring, 8);
    let l = Layout::new(8);
    let mut f = published(&mem, &[0, 1, 2, 3, 4, 5, 6, 7]);
    use_ids(&ring, 0, &[0, 1, 2, 3, 4, 5, 6, 7]);
    for head in 0..8 {
        assert_eq!(f.done(&mem, head, head).unwrap(), Some(Status::Ok));
    }
    // The second lap: heads 0 and 1 made available again; the device
    // claims 8 more entries, the first lap's still in the ring.
    for head in [0, 1] {
        f.publish(&mem, head).unwrap();
    }
    f.flush(&mem).unwrap();
    mem.write_u16(l.used_idx(), 16).unwrap();
    for _ in 0..2 {
        match f.done(&mem, 0, 0) {
            Err(Error::UsedIndex {
                idx: 16,
                used: 8,
                in_flight: 2,
            }) => {}
            r => panic!("{r:?}"),
        }
    }
    // The device's real entries: both packets done.
    use_ids(&ring, 8, &[1, 0]);
    assert_eq!(f.done(&mem, 0, 0).unwrap(), Some(Status::Ok));
    assert_eq!(f.done(&mem, 1, 1).unwrap(), Some(Status::Ok));
}

#[test]
fn a_doorbell_that_was_not_rung_is_asked_for_again() {
    let ring = ring8();
    let mem = RingMem::new(&ring, 8);
    let mut f = Split::negotiate(features::USED).unwrap();
    assert!(f.event_idx());
    // The device has seen nothing (avail_event 0).
    f.publish(&mem, 0).unwrap();
    assert!(
        f.flush(&mem).unwrap(),
        "the first packet asks for a doorbell"
    );
    f.publish(&mem, 1).unwrap();
    let mut kept = f.clone();
    // The doorbell was rung: the device is at work, and says when it
    // wants the next one (EVENT_IDX).
    assert!(!f.flush(&mem).unwrap());
    // It was not rung: the next flush asks again.
    kept.unflush();
    assert!(kept.flush(&mem).unwrap());
}

/// A flush that fails reading the device's word (here `avail_event`, past
/// the memory of a ring too small for its 200 entries) changes nothing:
/// the next flush asks for the doorbell of the same packets. It used to
/// count them as flushed, so that with `EVENT_IDX` the next flush found
/// nothing new to ring for, and no doorbell ever came for them.
#[test]
fn a_flush_that_fails_leaves_the_doorbell_to_ask_for() {
    let l = Layout::new(200);
    let (small, whole) = (memory(4096), memory(Split::ring_bytes(200)));
    assert!(l.avail_entry(0) < 4096 && l.avail_event() >= 4096);
    let mut f = Split::negotiate(features::USED).unwrap();
    f.publish(&RingMem::new(&small, 200), 0).unwrap();
    assert!(f.flush(&RingMem::new(&small, 200)).is_err());
    // The device has seen nothing (avail_event 0): the packet wants one.
    assert!(f.flush(&RingMem::new(&whole, 200)).unwrap());
}

#[test]
fn negotiation_keeps_what_tx_uses_and_needs_version_1_and_the_iommu() {
    let all = u64::MAX;
    assert_eq!(Split::negotiate(all).unwrap().features(), features::USED);
    let e = Split::negotiate(features::VERSION_1).unwrap_err();
    assert!(e.to_string().contains("VIRTIO_F_ACCESS_PLATFORM"), "{e}");
    // TSO without checksum offload is no TSO.
    let no_csum = Split::negotiate(all & !features::CSUM).unwrap();
    assert_eq!(
        no_csum.features() & (features::HOST_TSO4 | features::HOST_TSO6),
        0
    );
}

#[test]
fn offloads_follow_the_features() {
    let l4 = |ip| Headers {
        maclen: 14,
        ip,
        iplen: if ip == Ip::V4 { 20 } else { 40 },
        l4len: 20,
        l4: L4::Tcp,
    };
    let tso = Offload::Tso { mss: 1448 };
    let base = features::VERSION_1 | features::ACCESS_PLATFORM;
    let bare = Split::negotiate(base).unwrap();
    assert!(bare.supports(Offload::None, None));
    assert!(!bare.supports(Offload::Checksum, Some(&l4(Ip::V4))));
    let v4 = Split::negotiate(base | features::CSUM | features::HOST_TSO4).unwrap();
    assert!(v4.supports(tso, Some(&l4(Ip::V4))));
    assert!(!v4.supports(tso, Some(&l4(Ip::V6))));
}
