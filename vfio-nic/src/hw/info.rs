//! What `VFIO_IOMMU_GET_INFO` says about a type1 container: the page
//! sizes, the usable IOVA ranges (the IOMMU's address width and the
//! reserved regions such as the MSI window shape them) and how many more
//! mappings it accepts.

use std::ops::Range;

use vfio_bindings::bindings::vfio::{
    vfio_info_cap_header, vfio_iommu_type1_info, vfio_iova_range, VFIO_IOMMU_INFO_CAPS,
    VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE, VFIO_IOMMU_TYPE1_INFO_DMA_AVAIL,
};
use vfio_ioctls::VfioContainer;

use crate::error::{Error, Result};
use crate::hw::ioctl;

/// What `VFIO_IOMMU_GET_INFO` reports about a container.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IommuInfo {
    /// Page sizes the IOMMU maps (bit n set: 2^n bytes).
    pub page_sizes: u64,
    /// Usable IOVA ranges, end exclusive (reserved regions such as the MSI
    /// window are holes between them).
    pub ranges: Vec<Range<u64>>,
    /// Mappings the container may still create (`dma_entry_limit` minus
    /// those in use), when the kernel reports it.
    pub dma_avail: Option<u32>,
}

/// Most bytes a `VFIO_IOMMU_GET_INFO` answer may take: room for 4096 IOVA
/// ranges (as many as `IOMMU_IOAS_IOVA_RANGES` is given) and the rest.
pub const MAX_INFO_BYTES: usize = 68 * 1024;

/// Most calls [`iommu_info`] makes, the kernel asking for a larger buffer
/// after each but the last.
pub const MAX_INFO_TRIES: u32 = 4;

/// Reads `VFIO_IOMMU_GET_INFO` of `container`, with its capability chain.
/// [`Error::IommuInfoSize`] if the kernel asks for more than
/// [`MAX_INFO_BYTES`], or still for more after [`MAX_INFO_TRIES`] calls.
pub fn iommu_info(container: &VfioContainer) -> Result<IommuInfo> {
    get_info(|buf| ioctl::iommu_get_info(container, buf))
}

/// [`iommu_info`] over `ioctl`, which fills in the buffer it is given
/// (whose first word holds its length, `argsz`) or returns the errno.
fn get_info(mut ioctl: impl FnMut(&mut [u64]) -> Result<(), i32>) -> Result<IommuInfo> {
    let hdr = std::mem::size_of::<vfio_iommu_type1_info>();
    // u64 words keep the buffer 8-byte aligned, as the kernel's structs are.
    let mut words = 512;
    let mut need = 0;
    for _ in 0..MAX_INFO_TRIES {
        let mut buf: Vec<u64> = vec![0; words];
        buf[0] = (words * 8) as u64;
        ioctl(&mut buf).map_err(|errno| Error::IommuInfo { errno: Some(errno) })?;
        let bytes: Vec<u8> = buf.iter().flat_map(|w| w.to_le_bytes()).collect();
        need = u32::from_le_bytes(bytes[0..4].try_into().expect("4 bytes")) as usize;
        if need <= bytes.len() {
            return Ok(parse_iommu_info(&bytes[..need.max(hdr)]));
        }
        if need > MAX_INFO_BYTES {
            break;
        }
        words = need.div_ceil(8);
    }
    Err(Error::IommuInfoSize {
        need,
        max: MAX_INFO_BYTES,
        tries: MAX_INFO_TRIES,
    })
}

/// Checks the usable IOVA ranges (end exclusive) the kernel reported, as
/// [`parse_iommu_info`] or `IOMMU_IOAS_IOVA_RANGES` give them: each
/// non-empty, each starting at or after the end of the one before.
/// [`Error::OddIovaRanges`] naming the first that is not: an allocator
/// given overlapping ranges would hand out one IOVA twice.
pub fn check_ranges(ranges: &[Range<u64>]) -> Result<()> {
    let mut prev_end = 0;
    for (index, r) in ranges.iter().enumerate() {
        if r.start >= r.end || r.start < prev_end {
            return Err(Error::OddIovaRanges {
                index,
                start: r.start,
                end: r.end,
                prev_end,
            });
        }
        prev_end = r.end;
    }
    Ok(())
}

/// Checks the page sizes the kernel reported (`iova_pgsizes`, bit n set:
/// 2^n bytes): type1 maps whole pages of the smallest, at IOVAs and
/// addresses aligned to it, so pfrag's 4 KiB maps need a smallest page
/// that divides 4 KiB. [`Error::BadConfig`] with the smallest page
/// otherwise (a 64 KiB IOMMU would refuse every map); none reported (0)
/// passes, the mapper then assumes 4 KiB.
pub fn check_page_sizes(page_sizes: u64) -> Result<()> {
    let smallest = page_sizes & page_sizes.wrapping_neg();
    if smallest > pfrag::PAGE_SIZE {
        return Err(Error::BadConfig {
            what: "smallest IOMMU page size (VFIO_IOMMU_GET_INFO), which must divide pfrag's 4 KiB",
            value: smallest,
        });
    }
    Ok(())
}

fn le32(b: &[u8], off: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(off..off + 4)?.try_into().ok()?))
}

fn le64(b: &[u8], off: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(off..off + 8)?.try_into().ok()?))
}

/// Parses the bytes `VFIO_IOMMU_GET_INFO` returned: a
/// `vfio_iommu_type1_info` with its capability chain (IOVA ranges,
/// DMA-avail count). Never panics, and bounded in time, on any input: a
/// looping or truncated chain ends the parse, and a range count larger
/// than the buffer holds reads only what is there.
pub fn parse_iommu_info(b: &[u8]) -> IommuInfo {
    let flags = le32(b, 4).unwrap_or(0);
    let mut info = IommuInfo {
        page_sizes: le64(b, 8).unwrap_or(0),
        ..IommuInfo::default()
    };
    if flags & VFIO_IOMMU_INFO_CAPS == 0 {
        return info;
    }
    let caph = std::mem::size_of::<vfio_info_cap_header>();
    let mut at = le32(b, 16).unwrap_or(0) as usize;
    let mut hops = 0;
    while at != 0 && at + caph <= b.len() && hops < 64 {
        hops += 1;
        let id = u32::from(u16::from_le_bytes([b[at], b[at + 1]]));
        let next = le32(b, at + 4).unwrap_or(0) as usize;
        if id == VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE && info.ranges.is_empty() {
            // The kernel reports one range capability; a repeated one is
            // malformed and ignored.
            let first = at + caph + 8;
            let step = std::mem::size_of::<vfio_iova_range>();
            let room = b.len().saturating_sub(first) / step;
            let n = (le32(b, at + caph).unwrap_or(0) as usize).min(room);
            for i in 0..n {
                let off = first + i * step;
                if let (Some(s), Some(e)) = (le64(b, off), le64(b, off + 8)) {
                    // The kernel's ranges are inclusive.
                    info.ranges.push(s..e.saturating_add(1));
                }
            }
        } else if id == VFIO_IOMMU_TYPE1_INFO_DMA_AVAIL {
            info.dma_avail = le32(b, at + caph);
        }
        if next <= at {
            break;
        }
        at = next;
    }
    info
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kernel that asks for `argsz + 8` whatever it is given: the driver
    /// gives up after [`MAX_INFO_TRIES`] calls with a typed error, never
    /// looping or growing the buffer without bound.
    #[test]
    fn a_kernel_that_keeps_asking_for_more_is_an_error_after_a_few_calls() {
        let mut calls = 0;
        let r = get_info(|buf| {
            calls += 1;
            buf[0] += 8;
            Ok(())
        });
        assert_eq!(calls, MAX_INFO_TRIES);
        match r {
            Err(Error::IommuInfoSize { need, max, tries }) => {
                assert_eq!(
                    (need, max, tries),
                    (4096 + 3 * 8 + 8, MAX_INFO_BYTES, MAX_INFO_TRIES)
                );
            }
            other => panic!("{other:?}"),
        }
    }

    /// A kernel that asks for 4 GiB: refused at once, nothing allocated.
    #[test]
    fn an_answer_larger_than_the_cap_is_refused_without_allocating_it() {
        let mut calls = 0;
        let r = get_info(|buf| {
            calls += 1;
            buf[0] = u64::from(u32::MAX);
            Ok(())
        });
        assert_eq!(calls, 1);
        assert!(matches!(
            r,
            Err(Error::IommuInfoSize { need, .. }) if need == u32::MAX as usize
        ));
    }

    /// An answer that fits after one larger buffer is parsed.
    #[test]
    fn a_larger_answer_is_read_with_the_buffer_the_kernel_asked_for() {
        let mut calls = 0;
        let info = get_info(|buf| {
            calls += 1;
            if buf.len() * 8 < 8192 {
                buf[0] = 8192;
            } else {
                buf[1] = 1 << 12; // iova_pgsizes
            }
            Ok(())
        })
        .unwrap();
        assert_eq!((calls, info.page_sizes), (2, 1 << 12));
    }

    fn push32(v: &mut Vec<u8>, x: u32) {
        v.extend_from_slice(&x.to_le_bytes());
    }
    fn push64(v: &mut Vec<u8>, x: u64) {
        v.extend_from_slice(&x.to_le_bytes());
    }

    /// A GET_INFO answer laid out as the kernel writes it: header, then an
    /// IOVA-range capability with two ranges, then a DMA-avail capability.
    #[test]
    fn parses_capability_chain() {
        let mut b = Vec::new();
        push32(&mut b, 0); // argsz, patched below
        push32(&mut b, VFIO_IOMMU_INFO_CAPS | 1);
        push64(&mut b, (1 << 12) | (1 << 21) | (1 << 30));
        push32(&mut b, 24); // cap_offset
        push32(&mut b, 0);
        // IOVA range cap at 24: header(8) + nr(4) + reserved(4) + 2*16.
        let dma_at = 24 + 16 + 32;
        b.extend_from_slice(&(VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE as u16).to_le_bytes());
        b.extend_from_slice(&1u16.to_le_bytes());
        push32(&mut b, dma_at as u32);
        push32(&mut b, 2);
        push32(&mut b, 0);
        push64(&mut b, 0);
        push64(&mut b, 0xfedf_ffff);
        push64(&mut b, 0xfef0_0000);
        push64(&mut b, (1 << 39) - 1);
        b.extend_from_slice(&(VFIO_IOMMU_TYPE1_INFO_DMA_AVAIL as u16).to_le_bytes());
        b.extend_from_slice(&1u16.to_le_bytes());
        push32(&mut b, 0);
        push32(&mut b, 65_530);
        push32(&mut b, 0);
        let n = b.len() as u32;
        b[0..4].copy_from_slice(&n.to_le_bytes());
        let info = parse_iommu_info(&b);
        assert_eq!(info.page_sizes, (1 << 12) | (1 << 21) | (1 << 30));
        assert_eq!(info.ranges, vec![0..0xfee0_0000, 0xfef0_0000..(1 << 39)]);
        assert_eq!(info.dma_avail, Some(65_530));
    }

    /// A GET_INFO answer whose IOVA-range capability holds `ranges`
    /// (inclusive, as the kernel writes them).
    fn info_with_ranges(ranges: &[(u64, u64)]) -> Vec<u8> {
        let mut b = Vec::new();
        push32(&mut b, 0);
        push32(&mut b, VFIO_IOMMU_INFO_CAPS);
        push64(&mut b, 1 << 12);
        push32(&mut b, 24);
        push32(&mut b, 0);
        b.extend_from_slice(&(VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE as u16).to_le_bytes());
        b.extend_from_slice(&1u16.to_le_bytes());
        push32(&mut b, 0);
        push32(&mut b, ranges.len() as u32);
        push32(&mut b, 0);
        for &(s, e) in ranges {
            push64(&mut b, s);
            push64(&mut b, e);
        }
        let n = b.len() as u32;
        b[0..4].copy_from_slice(&n.to_le_bytes());
        b
    }

    #[test]
    fn ascending_disjoint_ranges_pass() {
        let info = parse_iommu_info(&info_with_ranges(&[
            (0, 0xfedf_ffff),
            (0xfef0_0000, u64::MAX),
        ]));
        assert_eq!(info.ranges, vec![0..0xfee0_0000, 0xfef0_0000..u64::MAX]);
        check_ranges(&info.ranges).unwrap();
        check_ranges(&[]).unwrap();
    }

    /// Overlapping, repeated, unordered or reversed ranges are refused,
    /// naming the first odd one and the end of the one before.
    #[test]
    fn odd_ranges_are_an_error_naming_the_range() {
        // The kernel's ranges, and the index, start, end and end before
        // that the error names.
        type Case = (&'static [(u64, u64)], (usize, u64, u64, u64));
        let cases: [Case; 4] = [
            (
                &[(0x1000, 0xffff), (0x8000, 0x1_ffff)],
                (1, 0x8000, 0x2_0000, 0x1_0000),
            ),
            (
                &[(0x1000, 0xffff), (0x1000, 0xffff)],
                (1, 0x1000, 0x1_0000, 0x1_0000),
            ),
            (
                &[(0x10_0000, 0x1f_ffff), (0x1000, 0xffff)],
                (1, 0x1000, 0x1_0000, 0x20_0000),
            ),
            (&[(0x2000, 0xfff)], (0, 0x2000, 0x1000, 0)),
        ];
        for (raw, want) in cases {
            let info = parse_iommu_info(&info_with_ranges(raw));
            match check_ranges(&info.ranges) {
                Err(Error::OddIovaRanges {
                    index,
                    start,
                    end,
                    prev_end,
                }) => assert_eq!((index, start, end, prev_end), want, "{raw:x?}"),
                other => panic!("{raw:x?}: {other:?}"),
            }
        }
    }

    /// Type1 maps only whole pages of its smallest size, at IOVAs and
    /// addresses aligned to it; pfrag maps 4 KiB pages, so an IOMMU whose
    /// smallest page is larger (64 KiB) would refuse every 4 KiB map: it
    /// is refused when the mapper is made, naming that page, as an
    /// iommufd alignment that does not divide 4 KiB is.
    #[test]
    fn an_iommu_whose_smallest_page_passes_4k_is_refused() {
        for ok in [(1 << 12) | (1 << 21) | (1 << 30), 1 << 12, 1 << 11, 0] {
            check_page_sizes(ok).unwrap();
        }
        for (bits, smallest) in [((1 << 16) | (1 << 29), 1 << 16), (1 << 21, 1 << 21)] {
            match check_page_sizes(bits) {
                Err(Error::BadConfig { value, .. }) => assert_eq!(value, smallest, "{bits:#x}"),
                other => panic!("{bits:#x}: {other:?}"),
            }
        }
    }

    #[test]
    fn no_caps_flag_means_no_ranges() {
        let mut b = Vec::new();
        push32(&mut b, 24);
        push32(&mut b, 1);
        push64(&mut b, 1 << 12);
        push32(&mut b, 24);
        push32(&mut b, 0);
        let info = parse_iommu_info(&b);
        assert!(info.ranges.is_empty());
        assert_eq!(info.dma_avail, None);
    }

    #[test]
    fn looping_chain_stops() {
        let mut b = Vec::new();
        push32(&mut b, 40);
        push32(&mut b, VFIO_IOMMU_INFO_CAPS);
        push64(&mut b, 1 << 12);
        push32(&mut b, 24);
        push32(&mut b, 0);
        b.extend_from_slice(&(VFIO_IOMMU_TYPE1_INFO_DMA_AVAIL as u16).to_le_bytes());
        b.extend_from_slice(&1u16.to_le_bytes());
        push32(&mut b, 24); // points at itself
        push32(&mut b, 7);
        push32(&mut b, 0);
        let info = parse_iommu_info(&b);
        assert_eq!(info.dma_avail, Some(7));
    }
}
