//! The null device model: it walks the ring like the software NIC (but
//! reads up to 32 descriptors of one page with one DMA read, as a NIC
//! fetches them in bursts: the IOMMU counts one fault for a run that
//! faults), checks that every buffer of every packet translates through
//! the IOMMU (page by page, so IOTLB hits, misses and faults are counted
//! as for a real device), writes back descriptor-done, and reads no
//! payload at all. Runs on it measure the driver's own cost: pool,
//! mapping, descriptors, completions. It counts faults as the software NIC
//! does ([`NicStats::faults`], `faulted_packets`): one per descriptor it
//! could not read, one per packet whose buffers do not all translate
//! (that packet is dropped), one per status word it could not write back.
//! A chain longer than a packet may be is dropped as malformed
//! ([`NicStats::bad_desc`]), whatever its buffers' translations.

use pfrag::dma::{Dir, Fault, Translate};
use pfrag::{Iova, PAGE_SIZE};

use super::resync::Resync;
use super::ring::{read_descs, report, Ring, FETCH};
use super::Model;
use crate::desc::{self, Dcmd, Desc};
use crate::device::TxDevice;
use crate::error::Result;
use crate::model::softnic::{NicStats, MAX_BUFS};

/// The null device; see the module docs.
pub struct NullNic<T: Translate> {
    iommu: T,
    ring: Ring,
    /// Bytes and pages of the packet being gathered, and whether it faulted.
    cur: (u64, u64, bool),
    bufs: usize,
    /// Header bytes of offloaded packets, from the last context descriptor.
    hlen: u64,
    /// Whether the packet being gathered is offloaded (its first data
    /// descriptor asked for checksums or TSO).
    offloaded: Option<bool>,
    /// Skipping after descriptors that could not be read, up to the next
    /// packet's first descriptor.
    resync: Resync,
    stats: NicStats,
}

impl<T: Translate> std::fmt::Debug for NullNic<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NullNic")
            .field("ring", &self.ring)
            .field("stats", &self.stats)
            .finish()
    }
}

impl<T: Translate> NullNic<T> {
    /// A null device whose DMA goes through `iommu`.
    pub fn new(iommu: T) -> NullNic<T> {
        NullNic {
            iommu,
            ring: Ring::default(),
            cur: (0, 0, false),
            bufs: 0,
            hlen: 0,
            offloaded: None,
            resync: Resync::Off,
            stats: NicStats::default(),
        }
    }

    /// Forgets the packet being gathered (it will never be sent).
    fn forget_packet(&mut self) {
        self.cur = (0, 0, false);
        self.bufs = 0;
        self.offloaded = None;
    }

    /// Translates every page of a buffer for reading, touching nothing.
    fn translate(&self, iova: Iova, len: usize) -> Result<u64, Fault> {
        let (mut at, mut left, mut pages) = (iova, len as u64, 0);
        while left > 0 {
            let t = self.iommu.translate(at, Dir::TO_DEVICE)?;
            let step = t.len.min(PAGE_SIZE - (at.raw() & (PAGE_SIZE - 1)));
            pages += 1;
            left = left.saturating_sub(step);
            if left > 0 {
                at = at.checked_add(step).ok_or(Fault {
                    iova,
                    access: Dir::TO_DEVICE,
                })?;
            }
        }
        Ok(pages)
    }

    /// Acts on the descriptor at `at`, whose words are `words`.
    ///
    /// # Safety
    /// `at` is a descriptor a doorbell handed to the device (it may be
    /// written back).
    unsafe fn descriptor(&mut self, at: Iova, words: [u64; 2]) {
        match Desc::decode(words) {
            Desc::Context(c) => {
                self.resync.context(&mut self.stats);
                self.hlen = (c.maclen() + c.iplen() + c.l4len()) as u64;
            }
            Desc::Data(d) => {
                if !self.resync.skipping() || self.resync.resumes_at(d, &mut self.stats) {
                    self.data(d);
                }
                // SAFETY: the caller's promise.
                unsafe { report(&self.iommu, at, d, &mut self.stats) };
            }
            Desc::Other(_) => self.stats.bad_desc += 1,
        }
    }

    fn data(&mut self, d: desc::Data) {
        // This buffer's bytes and pages, or its fault.
        let buf = match self.translate(Iova(d.addr), usize::from(d.len())) {
            Ok(pages) => (u64::from(d.len()), pages, false),
            Err(_) => (0, 0, true),
        };
        let eop = d.cmd().contains(Dcmd::EOP);
        if self.bufs == 0 && eop {
            // A packet of one buffer is counted straight from it: the
            // state that gathers longer packets is not written (only
            // `bufs` is read, to tell that none was gathered).
            return self.count_packet(buf, offloaded(d));
        }
        self.bufs += 1;
        let offloaded = *self.offloaded.get_or_insert_with(|| offloaded(d));
        self.cur = (self.cur.0 + buf.0, self.cur.1 + buf.1, self.cur.2 | buf.2);
        let broken = self.bufs > MAX_BUFS;
        if eop || broken {
            let cur = std::mem::take(&mut self.cur);
            self.offloaded = None;
            self.bufs = 0;
            if broken {
                // A broken chain: dropped, its rest skipped.
                self.stats.packets += 1;
                self.stats.bad_desc += 1;
                self.resync.dropped(d);
            } else {
                self.count_packet(cur, offloaded);
            }
        }
    }

    /// Counts a whole packet of `bytes` over `pages` pages, lost if
    /// `faulted`; `offloaded`: its headers (`hlen`) are not payload.
    fn count_packet(&mut self, (bytes, pages, faulted): (u64, u64, bool), offloaded: bool) {
        self.stats.packets += 1;
        if faulted {
            self.stats.count_read_fault();
            return;
        }
        if bytes == 0 {
            // No bytes: no frame on the wire, a malformed packet.
            self.stats.bad_desc += 1;
            return;
        }
        // Payload: what follows the headers of an offloaded packet.
        let payload = if offloaded {
            bytes.saturating_sub(self.hlen)
        } else {
            bytes
        };
        self.stats.count_frame(bytes, payload, pages);
    }
}

/// Whether the packet that `first`, its first data descriptor, starts is
/// offloaded: it asks for checksums or TSO.
fn offloaded(first: desc::Data) -> bool {
    !first.popts().is_empty() || first.cmd().contains(Dcmd::TSE)
}

impl<T: Translate> TxDevice for NullNic<T> {
    type Format = crate::format::igb::Advanced;
    fn format(&self) -> Self::Format {
        crate::format::igb::Advanced
    }

    unsafe fn attach(&mut self, ring: Iova, len: u16) -> Result<()> {
        self.ring.attach(ring, len)?;
        self.forget_packet();
        self.resync = Resync::Off;
        Ok(())
    }

    fn detach(&mut self) -> Result<()> {
        self.ring.detach();
        self.forget_packet();
        self.resync = Resync::Off;
        Ok(())
    }

    fn head(&mut self) -> Option<u16> {
        self.ring.head()
    }

    unsafe fn kick(&mut self, tail: u16) -> Result<()> {
        self.ring.check(tail)?;
        let mut words = [[0u64; 2]; FETCH];
        while let Some((at, n)) = self.ring.next_run(tail) {
            let run = &mut words[..n];
            self.stats.descs += n as u64;
            // SAFETY: the run lies between the head and `tail`: our caller
            // handed these descriptors to the device.
            if unsafe { read_descs(&self.iommu, at, run) }.is_err() {
                // A run lies in one page (`next_run`): its every
                // descriptor is lost, as each would be alone, and so is
                // the packet being gathered; what follows is skipped up to
                // a packet's first descriptor (`Resync`).
                self.resync
                    .unreadable(n as u64, self.bufs > 0, &mut self.stats);
                self.forget_packet();
                continue;
            }
            for (i, w) in run.iter().enumerate() {
                let at = at.offset((i * desc::SIZE) as u64);
                // SAFETY: `at` was handed over, as above.
                unsafe { self.descriptor(at, *w) };
            }
        }
        Ok(())
    }
}

impl<T: Translate> Model for NullNic<T> {
    fn counters(&self) -> NicStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gen::Traffic;
    use crate::tx::{self};
    use pfrag::dma::{DmaMapper, Domain, SoftIommu, SoftIommuConfig};
    use pfrag::pool::{self, Policy, Pool};
    use std::sync::Arc;

    #[test]
    fn completes_every_packet_and_counts_its_pages_without_reading() {
        let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
        let domain = Arc::new(Domain::new(iommu.clone()));
        let cfg = pool::Config::new(pfrag::Order::new(4).unwrap(), Policy::Persistent);
        let pool = Pool::new(domain.clone(), cfg).unwrap();
        let nic = NullNic::new(iommu.clone());
        // SAFETY: the device is a model on the very IOMMU object `domain` maps through.
        let mut q = unsafe { tx::Queue::new(domain, pool, nic, tx::Config::default()) }.unwrap();
        let mut g = Traffic::new(2, 1448).unwrap();
        // Under Miri, fewer and smaller packets (Tree Borrows tracks every
        // byte the pattern fill touches); each still starts on a fresh page.
        let (n, payload) = if cfg!(miri) { (2, 8_192) } else { (20, 65_160) };
        for i in 0..n {
            g.send(&mut q, i % 2, payload).unwrap();
        }
        q.kick().unwrap();
        assert_eq!(q.reap().unwrap(), n);
        let st = q.device().counters();
        let n = n as u64;
        assert_eq!((st.packets, st.faults, st.bytes_verified), (n, 0, 0));
        assert_eq!(st.delivered_bytes, n * payload as u64);
        // The payload's pages (16 for 65,160 bytes) and the header's page
        // per packet.
        assert_eq!(st.pages, n * (payload.div_ceil(4096) as u64 + 1));
        assert!(iommu.stats().iotlb_misses > 0);
    }

    /// A region of `len` bytes whose first `map_len` bytes a software IOMMU
    /// maps at `1 << 20`. The caller declares the region before the model
    /// that reads it, so the memory outlives every read.
    fn mapped(len: usize, map_len: u64) -> (pfrag::mem::Region, Arc<SoftIommu>, Iova) {
        use pfrag::dma::Mapping;
        let mem = pfrag::mem::Region::new(len, 4096, false).unwrap();
        let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
        let base = Iova(1 << 20);
        let m = Mapping {
            iova: base,
            addr: mem.addr(),
            len: map_len,
            dir: Dir::BIDIRECTIONAL,
            huge: false,
        };
        // SAFETY: `mem` is live, and outlives the model that is the
        // mapping's only user (the caller's promise above).
        unsafe { iommu.map(&m) }.unwrap();
        (mem, iommu, base)
    }

    #[test]
    fn a_run_stops_at_its_page_and_faults_whole() {
        // A ring of 512 descriptors (two pages) whose second page is not
        // mapped. Declared first, the memory outlives the model's reads.
        let (_mem, iommu, base) = mapped(8192, 4096);
        let mut nic = NullNic::new(iommu.clone());
        // SAFETY: the ring lies at `base`; its descriptors are zeros.
        unsafe { nic.attach(base, 512) }.unwrap();
        // SAFETY: descriptors 0..248 are handed over (zeros: not data).
        unsafe { nic.kick(248) }.unwrap();
        let st = nic.counters();
        assert_eq!((st.descs, st.bad_desc, st.faults), (248, 248, 0));
        // From 248: a run of the 8 left in the mapped page, then one of 24
        // past it, which faults whole: one fault at the IOMMU.
        // SAFETY: as above.
        unsafe { nic.kick(280) }.unwrap();
        let st = nic.counters();
        assert_eq!((st.descs, st.bad_desc, st.faults), (280, 256, 24));
        assert_eq!(iommu.stats().faults, 1);
    }

    /// Writes descriptor `i` of the ring in `ring` (no doorbell runs
    /// meanwhile).
    fn put(ring: &mut pfrag::mem::Region, i: usize, d: Desc) {
        let [lo, hi] = d.encode();
        let mut b = [0u8; desc::SIZE];
        b[..8].copy_from_slice(&lo.to_le_bytes());
        b[8..].copy_from_slice(&hi.to_le_bytes());
        ring.write(i * desc::SIZE, &b).unwrap();
    }

    /// Packets of one buffer each, counted straight from it, among packets
    /// of two: nothing of one packet reaches the next.
    #[test]
    fn packets_of_one_buffer_count_alone() {
        use crate::desc::{Context, Data, Popts};
        // Two mapped pages: the ring at the front of the first, buffers
        // after it. Declared first, the memory outlives the model's reads.
        let (mut mem, iommu, base) = mapped(8192, 8192);
        let at = |off: u64| base.raw() + off;
        let end = Dcmd::EOP | Dcmd::RS;
        let one = |addr, len, cmd, popts| Desc::Data(Data::new(addr, len, cmd, 0, popts));
        let none = Popts::empty();
        let descs = [
            // Delivered: 100 bytes in one page.
            one(at(2048), 100, end, none),
            // Lost: its buffer is not mapped.
            one(0x7700_0000, 100, end, none),
            // Delivered: 100 bytes across the two pages.
            one(at(4096 - 50), 100, Dcmd::EOP, none),
            // Two buffers, 60 + 40 bytes.
            one(at(2048), 60, Dcmd::empty(), none),
            one(at(3000), 40, end, none),
            // Offloaded (checksums) with 54 header bytes: 100 of payload.
            Desc::Context(Context::tcp_ipv4(14, 20, 20, 0)),
            one(at(2048), 154, end, Popts::TXSM),
            // Not offloaded: the context's headers are payload.
            one(at(2048), 100, Dcmd::EOP, none),
            // Lost: its first buffer is not mapped, its second is.
            one(0x7700_0000, 60, Dcmd::empty(), none),
            one(at(2048), 40, end, none),
        ];
        for (i, d) in descs.into_iter().enumerate() {
            put(&mut mem, i, d);
        }
        let mut nic = NullNic::new(iommu.clone());
        // SAFETY: the ring lies at `base`; only the model reads it.
        unsafe { nic.attach(base, 16) }.unwrap();
        // Two doorbells, the second from the middle of the two-buffer
        // packet.
        // SAFETY: descriptors 0..4 are handed over.
        unsafe { nic.kick(4) }.unwrap();
        // SAFETY: and 4..10.
        unsafe { nic.kick(10) }.unwrap();
        let st = nic.counters();
        assert_eq!((st.descs, st.packets, st.frames), (10, 7, 5), "{st:?}");
        assert_eq!((st.faults, st.faulted_packets), (2, 2), "{st:?}");
        assert_eq!(st.delivered_bytes, 500, "{st:?}");
        assert_eq!(st.payload_bytes, 500, "{st:?}");
        // Frames of 100, 100, 100, 154 and 100 bytes, each with its FCS.
        assert_eq!(st.wire_bytes, 4 * 104 + 158, "{st:?}");
        assert_eq!((st.pages, st.write_backs), (1 + 2 + 2 + 1 + 1, 5), "{st:?}");
    }

    /// A translation for the overflow test: the software IOMMU for the
    /// ring, and every IOVA from 2^63 up translating to the front page of
    /// `mem` (which the model never reads: it reads no payload).
    struct TopHalf {
        inner: Arc<SoftIommu>,
        mem: pfrag::mem::Region,
    }

    // SAFETY: a translation from 2^63 up names bytes of the first page of
    // `mem` (`len` from the IOVA's page offset, so inside that page), which
    // stays allocated while `self` lives and which nothing unmaps; every
    // other translation, `hold` and every access are the inner mapper's,
    // whose accesses fault from 2^48 up, touching nothing.
    unsafe impl Translate for TopHalf {
        fn translate(&self, iova: Iova, access: Dir) -> Result<pfrag::dma::Translation, Fault> {
            if iova.raw() < 1 << 63 {
                return self.inner.translate(iova, access);
            }
            let off = iova.raw() & (PAGE_SIZE - 1);
            Ok(pfrag::dma::Translation {
                addr: self.mem.addr().offset(off as usize),
                len: PAGE_SIZE - off,
            })
        }
        unsafe fn hold(&self) -> pfrag::dma::Hold<'_> {
            // SAFETY: the caller's promise, passed on.
            unsafe { self.inner.hold() }
        }
        unsafe fn read(
            &self,
            iova: Iova,
            len: usize,
            f: &mut dyn FnMut(&[u8]),
        ) -> Result<(), Fault> {
            // SAFETY: the caller's promise, passed on.
            unsafe { self.inner.read(iova, len, f) }
        }
        unsafe fn write(&self, iova: Iova, src: &[u8]) -> Result<(), Fault> {
            // SAFETY: the caller's promise, passed on.
            unsafe { self.inner.write(iova, src) }
        }
        unsafe fn write_u32(&self, iova: Iova, v: u32) -> Result<(), Fault> {
            // SAFETY: the caller's promise, passed on.
            unsafe { self.inner.write_u32(iova, v) }
        }
    }

    /// A buffer that would run past the top of the 64-bit IOVA space
    /// faults (its first page translates, the next has no address); one
    /// that ends exactly at the top is delivered.
    #[test]
    fn a_buffer_past_the_top_of_the_iova_space_faults() {
        use crate::desc::{Data, Popts};
        // Declared first, the ring outlives the model's reads.
        let (mut ring, inner, base) = mapped(4096, 4096);
        let end = Dcmd::EOP | Dcmd::RS;
        let one = |addr, len| Desc::Data(Data::new(addr, len, end, 0, Popts::empty()));
        put(&mut ring, 0, one(u64::MAX - 15, 32));
        put(&mut ring, 1, one(u64::MAX - 4095, 4096));
        let mem = pfrag::mem::Region::new(4096, 4096, false).unwrap();
        let mut nic = NullNic::new(TopHalf { inner, mem });
        // SAFETY: the ring lies at `base`; only the model reads it.
        unsafe { nic.attach(base, 8) }.unwrap();
        // SAFETY: descriptors 0 and 1 are handed over.
        unsafe { nic.kick(2) }.unwrap();
        let st = nic.counters();
        assert_eq!((st.packets, st.frames), (2, 1), "{st:?}");
        assert_eq!((st.faults, st.faulted_packets), (1, 1), "{st:?}");
        assert_eq!((st.delivered_bytes, st.pages), (4096, 1), "{st:?}");
        // Nothing was asked past the top (an address wrapped to 0 would
        // have faulted in the software IOMMU).
        assert_eq!(nic.iommu.inner.stats().faults, 0);
    }
}
