//! A packet's first buffer: the format's prefix and the headers (patched
//! where the engine fills in what the device does not), in the bounce slot
//! of the header's descriptor, or in a mapped frag of their own.

use pfrag::dma::DmaMapper;
use pfrag::Iova;

use super::{Fmt, Hdr, Queue, MAX_PREFIX};
use crate::csum;
use crate::device::TxDevice;
use crate::error::Result;
use crate::format::{Format, Packet};
use crate::offload::{Ip, Offload};

/// The longest headers of an offloaded packet (Ethernet, IPv4 or IPv6 with
/// options, TCP with options) that the engine patches in a copy.
const MAX_PATCHED: usize = 256;

/// Scratch for a packet's front: the format's prefix and patched headers.
pub(super) type Scratch = [u8; MAX_PREFIX + MAX_PATCHED];

/// A zeroed [`Scratch`] for a format that writes a prefix or patches
/// headers; `None` (nothing to clear per packet) for one that does
/// neither, as the 82576's.
pub(super) fn scratch<F: Format>() -> Option<Scratch> {
    (F::PREFIX > 0 || !F::INSERTS_IPV4_CSUM).then_some([0; MAX_PREFIX + MAX_PATCHED])
}

impl<M: DmaMapper, D: TxDevice> Queue<M, D> {
    /// What `pkt`'s first buffer starts with: the format's prefix, then
    /// the headers, in a patched copy (in `scratch`) where the engine
    /// fills in what the device does not (the IPv4 header checksum of an
    /// offloaded packet, for [`Format::INSERTS_IPV4_CSUM`] false).
    pub(super) fn front<'a>(
        &self,
        headers: &'a [u8],
        pkt: &Packet,
        scratch: &'a mut Option<Scratch>,
    ) -> [&'a [u8]; 2] {
        // A format with neither prefix nor patch has no scratch: the
        // headers go as they are.
        let Some(scratch) = scratch.as_mut() else {
            return [&[], headers];
        };
        let (pre, rest) = scratch.split_at_mut(MAX_PREFIX);
        let pre = &mut pre[..Fmt::<D>::PREFIX];
        if !pre.is_empty() {
            self.fmt.write_prefix(pre, pkt);
        }
        let ipv4 = pkt
            .layout
            .filter(|l| l.ip == Ip::V4 && pkt.offload != Offload::None);
        match ipv4 {
            Some(l) if !Fmt::<D>::INSERTS_IPV4_CSUM && headers.len() <= MAX_PATCHED => {
                let h = &mut rest[..headers.len()];
                h.copy_from_slice(headers);
                csum::fill_ipv4_header(&mut h[usize::from(l.maclen)..][..usize::from(l.iplen)]);
                [pre, h]
            }
            _ => [pre, headers],
        }
    }

    pub(super) fn drop_header(&mut self, h: Hdr<M>) {
        match h {
            Hdr::Slot(i) => {
                if let Some(b) = self.bounce.as_mut() {
                    b.release(i);
                }
            }
            Hdr::Frag(f) => {
                if self.hdr_cache.complete(f).is_err() {
                    self.stats.unmap_errors += 1;
                }
            }
        }
    }

    /// Hands the device `pkt`'s first buffer: the format's prefix and the
    /// headers, in the bounce slot of descriptor `idx`, or in a mapped
    /// frag of their own if they do not fit one.
    pub(super) fn place_header(
        &mut self,
        idx: u16,
        hdr: &[u8],
        pkt: &Packet,
    ) -> Result<(Iova, Hdr<M>)> {
        let mut scratch = scratch::<Fmt<D>>();
        let front = self.front(hdr, pkt, &mut scratch);
        let mut fallback = false;
        if let Some(b) = self.bounce.as_mut() {
            // Without a prefix (the 82576), one copy of the headers.
            let filled = match front {
                [[], h] => b.fill(usize::from(idx), h),
                parts => b.fill_parts(usize::from(idx), parts.into_iter()),
            };
            match filled {
                Ok(iova) => return Ok((iova, Hdr::Slot(usize::from(idx)))),
                Err(pfrag::Error::HeaderTooLarge { .. }) => fallback = true,
                Err(e) => return Err(e.into()),
            }
        }
        let [prefix, hdr] = front;
        let mut f = self.hdr_cache.refill(prefix.len() + hdr.len(), true)?;
        let (p, h) = f.as_mut_slice().split_at_mut(prefix.len());
        p.copy_from_slice(prefix);
        h.copy_from_slice(hdr);
        // Counted only once the header has its frag: a failed send counts
        // nothing.
        self.stats.header_fallbacks += u64::from(fallback);
        self.stats.mapped_headers += 1;
        Ok((f.iova(), Hdr::Frag(f)))
    }
}
