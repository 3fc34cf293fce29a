//! The fuzz targets' properties on the stable toolchain: the same harnesses
//! (`pfrag_lab::harness`) fed by proptest instead of libFuzzer, so that
//! `cargo test` covers them too. The fuzz targets in `fuzz/` search the
//! same inputs with coverage guidance.

use pfrag_lab::harness;
use proptest::prelude::*;

fn cases(n: u32) -> ProptestConfig {
    ProptestConfig {
        cases: if cfg!(miri) { 4 } else { n },
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(cases(256))]

    #[test]
    fn softnic_never_touches_unmapped_or_read_only_memory(
        data in proptest::collection::vec(any::<u8>(), 0..2048)
    ) {
        prop_assert_eq!(harness::softnic_ring(&data), Ok(()));
    }

    #[test]
    fn virtio_model_never_panics_nor_writes_outside_the_used_ring(
        data in proptest::collection::vec(any::<u8>(), 0..2048)
    ) {
        prop_assert_eq!(harness::virtio_ring(&data), Ok(()));
    }

    #[test]
    fn wire_checker_never_panics_and_accepts_only_parsable_frames(
        data in proptest::collection::vec(any::<u8>(), 0..1600)
    ) {
        prop_assert_eq!(harness::wire_frame(&data), Ok(()));
    }

    #[test]
    fn iommu_info_parser_is_total_and_bounded(
        data in proptest::collection::vec(any::<u8>(), 0..512)
    ) {
        prop_assert_eq!(harness::iommu_info(&data), Ok(()));
    }
}

/// Frames that are valid TCP/IPv4 with a wrong checksum or a foreign port
/// reach deep into the checker; random bytes rarely do.
#[test]
fn wire_checker_on_real_frames_with_one_byte_flipped() {
    use vfio_nic::gen::flow::{Flow, HDR_LEN};
    let mut f = Flow::new(3).unwrap();
    let mut hdr = [0u8; HDR_LEN];
    f.next_header(100, 1448, &mut hdr);
    let mut frame = hdr.to_vec();
    let mut payload = vec![0u8; 100];
    vfio_nic::gen::pattern::fill(3, 0, &mut payload);
    frame.extend_from_slice(&payload);
    for i in 0..frame.len() {
        let mut g = frame.clone();
        g[i] ^= 0x5a;
        assert_eq!(harness::wire_frame(&g), Ok(()));
    }
}

/// A ring whose descriptors all point into mapped regions: the harness's
/// property holds on the paths where the NIC really reads and writes back.
#[test]
fn softnic_harness_on_inputs_that_hit_mapped_regions() {
    let mut rng = 0x1234_5678_u64;
    for _ in 0..200 {
        let mut data = vec![0u8; 1024];
        for b in data.iter_mut() {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            *b = rng as u8;
        }
        assert_eq!(harness::softnic_ring(&data), Ok(()));
    }
}
