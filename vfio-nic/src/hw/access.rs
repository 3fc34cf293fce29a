//! What the two VFIO mappers, type1's
//! ([`VfioMapper`](super::vfio::VfioMapper)) and iommufd's
//! ([`IommufdMapper`](super::iommufd::IommufdMapper)), share: the access a
//! mapping gets, and the counters they keep.

use std::sync::atomic::{AtomicU64, Ordering};

use pfrag::dma::{Dir, MapStats, Mapping, Unmapped};
use pfrag::Iova;
use pfrag::OsAdvice;

use crate::hw::ioctl::Access;

/// How a VFIO mapper ([`VfioMapper`](super::vfio::VfioMapper),
/// [`IommufdMapper`](super::iommufd::IommufdMapper)) sets a mapping's
/// access. Default
/// [`MapAccess::Narrow`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MapAccess {
    /// As the mapping's direction asks, and no more: `TO_DEVICE` read-only,
    /// `FROM_DEVICE` write-only, both only for `BIDIRECTIONAL` (descriptor
    /// rings). A device write into TX memory is then an IOMMU fault.
    #[default]
    Narrow,
    /// Every range readable and writable, whatever its direction, as
    /// `vfio-ioctls`' own map does. Only for showing what [`Narrow`]
    /// protects (the guest suite's control run).
    ///
    /// [`Narrow`]: MapAccess::Narrow
    ReadWrite,
}

impl MapAccess {
    /// The access a mapping of direction `dir` gets. The mappers refuse
    /// an empty `dir` before they ask.
    pub fn access(self, dir: Dir) -> Access {
        match self {
            MapAccess::ReadWrite => Access::ReadWrite,
            MapAccess::Narrow if dir == Dir::TO_DEVICE => Access::Read,
            MapAccess::Narrow if dir == Dir::FROM_DEVICE => Access::Write,
            MapAccess::Narrow => Access::ReadWrite,
        }
    }
}

/// Checks the range `iova..iova + len` a mapper is asked to map or unmap,
/// before any ioctl: a zero length is [`pfrag::Error::ZeroLength`], and a
/// range that does not end below `u64::MAX` is
/// [`pfrag::Error::OutOfRange`] (`what` = `len`, with the largest length
/// that fits at `iova`). Such a range wraps the 64-bit IOVA space, and
/// `u64::MAX` bytes at IOVA 0 is what `IOMMU_IOAS_UNMAP` takes as "unmap
/// the whole IOAS", every owner's mappings included.
pub(crate) fn check_range(what: &'static str, iova: Iova, len: u64) -> pfrag::Result<()> {
    if len == 0 {
        return Err(pfrag::Error::ZeroLength);
    }
    let max = (u64::MAX - 1).saturating_sub(iova.raw());
    if len > max {
        return Err(pfrag::Error::OutOfRange {
            what,
            value: len,
            min: 1,
            max,
        });
    }
    Ok(())
}

/// Checks a map request before any ioctl and says the access the ioctl
/// asks for under `policy`: the range as [`check_range`], and a
/// direction that allows the device something. A mapping with no
/// direction ([`Dir::empty`]) is a [`pfrag::Error::Map`] with `EINVAL`,
/// as `SoftIommu` refuses it, under either policy: no policy widens an
/// access its owner never allowed.
pub(crate) fn map_request(policy: MapAccess, m: &Mapping) -> pfrag::Result<Access> {
    check_range("mapping length", m.iova, m.len)?;
    if m.dir.is_empty() {
        return Err(pfrag::Error::Map {
            iova: m.iova,
            len: m.len,
            source: OsAdvice::io(
                libc::EINVAL,
                "a mapping with no direction allows the device nothing: it is not mapped",
            ),
        });
    }
    Ok(policy.access(m.dir))
}

/// An unmap ioctl that returned success but unmapped another number of
/// bytes than asked (the kernel writes the size it unmapped back into the
/// argument): some part of the range went, which one is unknown. The
/// source of the [`pfrag::Error::Unmap`] such an unmap returns, whose
/// `iova` and `len` are the request: the range is kept as after any failed
/// unmap (its IOVA pinned, its memory never freed). It carries no errno:
/// the ioctl did not fail.
#[derive(Debug, thiserror::Error)]
#[error(
    "{ioctl} succeeded but unmapped {unmapped:#x} of the {asked:#x} bytes asked: which part \
     went is unknown, so the whole range is kept"
)]
pub struct ShortUnmap {
    /// The ioctl (`VFIO_IOMMU_UNMAP_DMA` or `IOMMU_IOAS_UNMAP`).
    pub ioctl: &'static str,
    /// Bytes asked.
    pub asked: u64,
    /// Bytes the kernel says it unmapped.
    pub unmapped: u64,
}

/// What the answer of an unmap ioctl (`VFIO_IOMMU_UNMAP_DMA` or
/// `IOMMU_IOAS_UNMAP`, named by `ioctl`) for `iova..iova + asked` means:
/// `r` is the bytes the kernel unmapped, or its errno. The whole range
/// unmapped is [`Unmapped::Flushed`] (the kernel synced the IOTLB before
/// it returned); any other size is a [`ShortUnmap`], an errno a refusal.
/// Also says whether the kernel removed any of the range, for
/// [`Counters::unmap_call`].
pub(crate) fn unmap_outcome(
    ioctl: &'static str,
    iova: Iova,
    asked: u64,
    r: Result<u64, i32>,
) -> (bool, pfrag::Result<Unmapped>) {
    let failed = |source| pfrag::Error::Unmap {
        iova,
        len: asked,
        source,
    };
    match r {
        Ok(n) if n == asked => (true, Ok(Unmapped::Flushed)),
        Ok(unmapped) => {
            let short = ShortUnmap {
                ioctl,
                asked,
                unmapped,
            };
            let source = std::io::Error::other(short);
            (unmapped > 0, Err(failed(source)))
        }
        Err(n) => {
            let hint = format!("{ioctl} refused: the range must cover whole earlier mappings");
            (false, Err(failed(OsAdvice::io(n, hint))))
        }
    }
}

/// A VFIO mapper's counts: map and unmap ioctls, 4 KiB pages mapped, and
/// the unmaps the kernel carried out.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    map_calls: AtomicU64,
    unmap_calls: AtomicU64,
    pages: AtomicU64,
    unmapped: AtomicU64,
}

impl Counters {
    /// One map ioctl, which mapped `len` bytes if it succeeded.
    pub(crate) fn map_call(&self, mapped: Option<u64>) {
        self.map_calls.fetch_add(1, Ordering::Relaxed);
        if let Some(len) = mapped {
            self.pages
                .fetch_add(len.div_ceil(pfrag::PAGE_SIZE), Ordering::Relaxed);
        }
    }

    /// One unmap ioctl; `unmapped`: the kernel removed (some of) the range.
    pub(crate) fn unmap_call(&self, unmapped: bool) {
        self.unmap_calls.fetch_add(1, Ordering::Relaxed);
        if unmapped {
            self.unmapped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts one unmap ioctl of `iova..iova + asked`, whose answer was
    /// `r`, and says what that answer means ([`unmap_outcome`]).
    pub(crate) fn unmap(
        &self,
        ioctl: &'static str,
        iova: Iova,
        asked: u64,
        r: Result<u64, i32>,
    ) -> pfrag::Result<Unmapped> {
        let (removed, out) = unmap_outcome(ioctl, iova, asked, r);
        self.unmap_call(removed);
        out
    }

    /// The counts as pfrag's: `ptes_written` is 4 KiB pages mapped, and
    /// each unmap ioctl that removed (some of) a range counts one
    /// invalidation, since the kernel's IOMMU driver syncs the IOTLB for
    /// what it removed before the unmap returns (one it refused removed
    /// nothing and synced nothing).
    /// The IOTLB is out of sight: hits and misses stay 0.
    pub(crate) fn stats(&self) -> MapStats {
        MapStats {
            map_calls: self.map_calls.load(Ordering::Relaxed),
            unmap_calls: self.unmap_calls.load(Ordering::Relaxed),
            ptes_written: self.pages.load(Ordering::Relaxed),
            invalidations: self.unmapped.load(Ordering::Relaxed),
            ..MapStats::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zero_length_is_refused() {
        assert!(matches!(
            check_range("len", Iova(0x1000), 0),
            Err(pfrag::Error::ZeroLength)
        ));
        assert!(check_range("len", Iova(0x1000), 0x1000).is_ok());
        assert!(check_range("len", Iova(0), 0x1000).is_ok());
    }

    /// `IOMMU_IOAS_UNMAP` of `u64::MAX` bytes at IOVA 0 is the kernel's
    /// unmap of the whole IOAS, every owner's mappings: never a range.
    #[test]
    fn the_whole_iova_space_is_not_a_range() {
        let r = check_range("unmap length", Iova(0), u64::MAX);
        assert!(
            matches!(
                r,
                Err(pfrag::Error::OutOfRange {
                    value: u64::MAX,
                    min: 1,
                    ..
                })
            ),
            "{r:?}"
        );
    }

    /// A range whose end lies past the 64-bit IOVA space wraps: refused,
    /// with the largest length that would fit.
    #[test]
    fn a_range_past_the_end_of_the_iova_space_is_refused() {
        let top = Iova(u64::MAX - 0xfff);
        let r = check_range("len", top, 0x1000);
        assert!(
            matches!(
                r,
                Err(pfrag::Error::OutOfRange {
                    value: 0x1000,
                    max: 0xffe,
                    ..
                })
            ),
            "{r:?}"
        );
        assert!(check_range("len", Iova(1 << 63), 1 << 63).is_err());
        assert!(check_range("len", Iova(1 << 63), (1 << 62) + 0x1000).is_ok());
    }

    fn mapping(dir: Dir) -> Mapping {
        Mapping {
            iova: Iova(0x10_0000),
            addr: pfrag::VirtAddr(0x7f00_0000_0000),
            len: 0x2000,
            dir,
            huge: false,
        }
    }

    /// A mapping that asks for no access is refused before any ioctl, as
    /// `SoftIommu` refuses it, under either policy: it used to be mapped
    /// readable and writable under `Narrow`, the widest access for a
    /// range whose owner allowed the device none.
    #[test]
    fn a_mapping_with_no_direction_is_refused_not_widened() {
        for policy in [MapAccess::Narrow, MapAccess::ReadWrite] {
            let r = map_request(policy, &mapping(Dir::empty()));
            let Err(e @ pfrag::Error::Map { iova, len, .. }) = r else {
                panic!("{policy:?}: {r:?}");
            };
            assert_eq!((iova, len), (Iova(0x10_0000), 0x2000));
            assert_eq!(e.errno(), Some(libc::EINVAL));
        }
        let narrow = |dir| map_request(MapAccess::Narrow, &mapping(dir)).unwrap();
        assert_eq!(narrow(Dir::TO_DEVICE), Access::Read);
        assert_eq!(narrow(Dir::FROM_DEVICE), Access::Write);
        assert_eq!(narrow(Dir::BIDIRECTIONAL), Access::ReadWrite);
        let wide = map_request(MapAccess::ReadWrite, &mapping(Dir::TO_DEVICE));
        assert_eq!(wide.unwrap(), Access::ReadWrite);
    }

    const TYPE1: &str = "VFIO_IOMMU_UNMAP_DMA";
    const IOAS: &str = "IOMMU_IOAS_UNMAP";

    /// A `VFIO_IOMMU_UNMAP_DMA` (or `IOMMU_IOAS_UNMAP`) that succeeded but
    /// unmapped another size than asked removed some unknown part of the
    /// range: an error that keeps the range (the domain pins it) and
    /// carries both sizes, and an ioctl whose removal the kernel synced
    /// (one invalidation) if it removed anything. Type1 reported it as
    /// refused, with an `EINVAL` the kernel never returned, and counted no
    /// invalidation.
    #[test]
    fn a_short_type1_unmap_keeps_the_range_and_says_how_much_went() {
        let at = Iova(0x10_0000);
        for (ioctl, got) in [(TYPE1, 0x1000), (TYPE1, 0), (TYPE1, 0x4000), (IOAS, 0x1000)] {
            let (removed, r) = unmap_outcome(ioctl, at, 0x2000, Ok(got));
            assert_eq!(removed, got > 0, "{got:#x}");
            let Err(pfrag::Error::Unmap { iova, len, source }) = r else {
                panic!("{got:#x}: {r:?}");
            };
            assert_eq!((iova, len), (at, 0x2000));
            let short = source
                .get_ref()
                .and_then(|e| e.downcast_ref::<ShortUnmap>());
            let short = short.unwrap_or_else(|| panic!("{got:#x}: {source}"));
            assert_eq!(
                (short.ioctl, short.asked, short.unmapped),
                (ioctl, 0x2000, got)
            );
            assert_eq!(
                pfrag::error::errno_of(&source),
                None,
                "no errno: it succeeded"
            );
            assert!(!source.to_string().contains("refused"), "{source}");
        }
        assert!(matches!(
            unmap_outcome(TYPE1, at, 0x2000, Ok(0x2000)),
            (true, Ok(Unmapped::Flushed))
        ));
        let (removed, r) = unmap_outcome(TYPE1, at, 0x2000, Err(libc::EINVAL));
        assert!(!removed);
        assert_eq!(r.unwrap_err().errno(), Some(libc::EINVAL));
    }

    /// An unmap the kernel refused is an ioctl, not an invalidation.
    #[test]
    fn a_refused_unmap_counts_no_invalidation() {
        let c = Counters::default();
        c.map_call(Some(8192));
        c.map_call(None);
        c.unmap_call(true);
        c.unmap_call(false);
        let s = c.stats();
        assert_eq!((s.map_calls, s.ptes_written), (2, 2));
        assert_eq!((s.unmap_calls, s.invalidations), (2, 1));
    }
}
