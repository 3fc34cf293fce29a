//! The mappings a domain holds, as the caller made them: VFIO type1 (v2)
//! remembers each `VFIO_IOMMU_MAP_DMA` and refuses an unmap that would
//! split one. The software IOMMU keeps the same record, so the pool's
//! paths are checked against the rule the kernel enforces, and it can
//! report how many mappings are live (type1 caps them at
//! `dma_entry_limit`, 65,535 by default).

use std::collections::BTreeMap;

/// A range of IOVA: (start, length in bytes).
pub(crate) type Span = (u64, u64);

/// What is left of the recorded mapping `m` once the range `u` is
/// unmapped: the part before `u` and the part after it. The one rule for
/// cutting a mapping, used by every record of mappings (the software
/// IOMMU's, [`Identity`](super::Identity)'s and [`Watch`](super::Watch)'s):
///
/// - `u` covers `m` whole: nothing is left (`[None, None]`);
/// - `u` covers the front of `m`: the back is left (`[None, Some(back)]`);
/// - `u` covers the back of `m`: the front is left (`[Some(front), None]`);
/// - `u` lies inside `m`, touching neither end: `m` splits in two;
/// - `u` misses `m`: `m` is left whole.
///
/// Ranges end at `start + len`, saturating at the top of the IOVA space.
pub(crate) fn cut(m: Span, u: Span) -> [Option<Span>; 2] {
    let (ms, me) = (m.0, m.0.saturating_add(m.1));
    let (us, ue) = (u.0, u.0.saturating_add(u.1));
    let before = (us > ms).then(|| (ms, us.min(me) - ms));
    let after = (ue < me).then(|| {
        let s = ue.max(ms);
        (s, me - s)
    });
    [before, after]
}

/// Why an unmap was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The range splits a mapping (starts or ends inside one).
    Splits,
    /// No mapping lies in the range.
    Nothing,
}

impl Refused {
    /// The errno type1 returns for it.
    pub(crate) fn errno(self) -> i32 {
        match self {
            Refused::Splits => libc::EINVAL,
            Refused::Nothing => libc::ENOENT,
        }
    }
}

/// Live mappings by first IOVA: `start -> len`. Never overlapping. A
/// partial unmap (where allowed) cuts a mapping by the one rule, [`cut`].
#[derive(Debug, Default)]
pub(crate) struct Granules {
    map: BTreeMap<u64, u64>,
}

impl Granules {
    /// Records a mapping the page table accepted (so it overlaps none).
    pub(crate) fn insert(&mut self, start: u64, len: u64) {
        self.map.insert(start, len);
    }

    /// The live mappings, in IOVA order.
    #[cfg(test)]
    pub(crate) fn spans(&self) -> Vec<Span> {
        self.map.iter().map(|(&s, &l)| (s, l)).collect()
    }

    /// Live mappings.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Checks that `start..start+len` covers whole mappings only, and at
    /// least one, as type1 v2 does; changes nothing.
    pub(crate) fn check_unmap(&self, start: u64, len: u64) -> Result<(), Refused> {
        let end = start.saturating_add(len);
        // A mapping that begins before the range and reaches into it.
        if let Some((&s, &l)) = self.map.range(..start).next_back() {
            if s + l > start {
                return Err(Refused::Splits);
            }
        }
        let mut any = false;
        for (&s, &l) in self.map.range(start..end) {
            if s + l > end {
                return Err(Refused::Splits);
            }
            any = true;
        }
        if any {
            Ok(())
        } else {
            Err(Refused::Nothing)
        }
    }

    /// Forgets `start..start+len`: the mappings inside it go, and one it
    /// covers only in part is [`cut`] (its front, back, or both stay, as
    /// the pages that stay mapped).
    pub(crate) fn remove(&mut self, start: u64, len: u64) {
        let end = start.saturating_add(len);
        // The mapping that begins before the range, if it reaches into it,
        // and those that begin inside.
        let before = self
            .map
            .range(..start)
            .next_back()
            .filter(|(&s, &l)| s.saturating_add(l) > start);
        let hit: Vec<Span> = before
            .into_iter()
            .chain(self.map.range(start..end))
            .map(|(&s, &l)| (s, l))
            .collect();
        for m in hit {
            self.map.remove(&m.0);
            for (s, l) in cut(m, (start, len)).into_iter().flatten() {
                self.map.insert(s, l);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn three() -> Granules {
        let mut g = Granules::default();
        g.insert(0x1000, 0x3000);
        g.insert(0x4000, 0x1000);
        g.insert(0x8000, 0x2000);
        g
    }

    #[test]
    fn whole_mappings_may_go_together() {
        let mut g = three();
        assert_eq!(g.check_unmap(0x1000, 0x4000), Ok(()));
        // A range may also span holes, as long as it splits nothing.
        assert_eq!(g.check_unmap(0x0, 0x20000), Ok(()));
        g.remove(0x1000, 0x4000);
        assert_eq!(g.len(), 1);
    }

    #[test]
    fn a_range_that_splits_a_mapping_is_refused() {
        let g = three();
        assert_eq!(g.check_unmap(0x2000, 0x1000), Err(Refused::Splits));
        assert_eq!(g.check_unmap(0x1000, 0x1000), Err(Refused::Splits));
        assert_eq!(g.check_unmap(0x4000, 0x5000), Err(Refused::Splits));
        assert_eq!(g.check_unmap(0x5000, 0x2000), Err(Refused::Nothing));
        assert_eq!(g.len(), 3);
    }

    #[test]
    fn cut_leaves_the_parts_outside_the_unmapped_range() {
        let m = (0x1000, 0x3000);
        // Whole (and more than whole).
        assert_eq!(cut(m, (0x1000, 0x3000)), [None, None]);
        assert_eq!(cut(m, (0x0, 0x10000)), [None, None]);
        // Front: the back is left.
        assert_eq!(cut(m, (0x1000, 0x1000)), [None, Some((0x2000, 0x2000))]);
        // Back: the front is left.
        assert_eq!(cut(m, (0x3000, 0x1000)), [Some((0x1000, 0x2000)), None]);
        // Middle: split in two.
        assert_eq!(
            cut(m, (0x2000, 0x1000)),
            [Some((0x1000, 0x1000)), Some((0x3000, 0x1000))]
        );
        // Missed on either side: left whole.
        assert_eq!(cut(m, (0x4000, 0x1000)), [Some(m), None]);
        assert_eq!(cut(m, (0x0, 0x1000)), [None, Some(m)]);
        // A range running past the top of the IOVA space.
        assert_eq!(cut(m, (0x2000, u64::MAX)), [Some((0x1000, 0x1000)), None]);
    }

    #[test]
    fn remove_cuts_front_back_middle_and_whole() {
        let mut g = Granules::default();
        g.insert(0x1000, 0x4000);
        // Front.
        g.remove(0x1000, 0x1000);
        assert_eq!(g.spans(), [(0x2000, 0x3000)]);
        // Back.
        g.remove(0x4000, 0x1000);
        assert_eq!(g.spans(), [(0x2000, 0x2000)]);
        g.insert(0x4000, 0x3000);
        // Middle of the second: three mappings now.
        g.remove(0x5000, 0x1000);
        assert_eq!(
            g.spans(),
            [(0x2000, 0x2000), (0x4000, 0x1000), (0x6000, 0x1000)]
        );
        // One range across the back of one and the front of the next, and
        // the whole of the last.
        g.remove(0x3000, 0x2000);
        assert_eq!(g.spans(), [(0x2000, 0x1000), (0x6000, 0x1000)]);
        g.remove(0x6000, 0x1000);
        assert_eq!(g.spans(), [(0x2000, 0x1000)]);
        assert_eq!(g.len(), 1);
    }
}
