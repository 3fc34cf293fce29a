//! A packet's first buffer: the format's prefix and the headers (patched
//! where the engine fills in what the device does not: the IPv4 header
//! checksum, the pseudo-header sum), in the bounce slot
//! of the header's descriptor, or in a mapped frag of their own.

use pfrag::bounce;
use pfrag::dma::DmaMapper;
use pfrag::frag::FragCache;
use pfrag::Iova;

use super::{Fmt, Hdr, Queue, Stats, MAX_PREFIX};
use crate::csum;
use crate::device::TxDevice;
use crate::error::{Error, HeaderFault, Result};
use crate::format::{Format, Packet};
use crate::offload::{Ip, Layout, Offload, L4};

/// Where TCP (16) and UDP (6) keep their checksum in their header.
pub(crate) fn l4_csum_offset(l4: L4) -> usize {
    match l4 {
        L4::Tcp => 16,
        L4::Udp => 6,
    }
}

/// The order of the chunks a header frag comes from (one page): where a
/// packet's front goes when it does not fit a bounce slot, whole in one
/// chunk.
pub(super) const FRAG_ORDER: u32 = 0;

/// The most header bytes a queue over format `F` places: the format's
/// prefix and the headers go in one buffer, never split, which is a bounce
/// slot or else a header frag of at most one chunk of [`FRAG_ORDER`], and
/// no longer than the format's largest buffer.
pub(super) fn max_headers<F: Format>() -> usize {
    let frag = (pfrag::PAGE_SIZE as usize) << FRAG_ORDER;
    frag.min(F::MAX_BUF).saturating_sub(F::PREFIX)
}

/// Refuses, before anything is posted, headers of `hlen` bytes longer than
/// a queue over `F` places ([`max_headers`]).
pub(super) fn check_placeable<F: Format>(hlen: usize, offload: Offload) -> Result<()> {
    let max = max_headers::<F>();
    if hlen > max {
        return Err(Error::BadHeaders {
            offload: offload.name(),
            why: HeaderFault::TooLong { len: hlen, max },
        });
    }
    Ok(())
}

/// The longest headers of an offloaded packet (Ethernet, IPv4 or IPv6 with
/// options, TCP with options) that the engine patches in a copy.
const MAX_PATCHED: usize = 256;

/// Scratch for a packet's front: the format's prefix and patched headers.
pub(super) type Scratch = [u8; MAX_PREFIX + MAX_PATCHED];

/// A [`Scratch`] for a format that writes a prefix or patches headers,
/// allocated once per queue and reused by every packet (`front` clears
/// the prefix before the format writes it, and copies headers whole
/// before patching them; `with_front` always puts it back); `None` for a
/// format that does neither (both formats here patch offloaded packets'
/// headers: the 82576 and virtio-net take the pseudo-header sum).
pub(super) fn scratch<F: Format>() -> Option<Box<Scratch>> {
    (F::PREFIX > 0 || patches::<F>()).then(|| Box::new([0; MAX_PREFIX + MAX_PATCHED]))
}

/// Whether the format has the engine patch some offloaded packets'
/// headers: the IPv4 header checksum, or the pseudo-header sum.
fn patches<F: Format>() -> bool {
    !F::INSERTS_IPV4_CSUM || F::PSEUDO_HEADER_SUM
}

/// What the engine fills in of an offloaded packet's headers: the IPv4
/// header checksum (for [`Format::INSERTS_IPV4_CSUM`] false), the
/// pseudo-header sum in the L4 checksum field (for
/// [`Format::PSEUDO_HEADER_SUM`]), and where the layers are; `None` when
/// there is nothing to fill in (no offload, or a format that needs none).
fn patch<F: Format>(pkt: &Packet) -> Option<(Layout, bool, bool)> {
    let l = pkt.layout.filter(|_| pkt.offload != Offload::None)?;
    let ipv4 = l.ip == Ip::V4 && !F::INSERTS_IPV4_CSUM;
    (ipv4 || F::PSEUDO_HEADER_SUM).then_some((l, ipv4, F::PSEUDO_HEADER_SUM))
}

/// Refuses, before anything is posted, headers of `hlen` bytes too long
/// for the engine to patch when the format needs a patch for an offload
/// (headers that parse as Ethernet, IP and TCP or UDP are at most 134
/// bytes: this is the engine's own bound, checked rather than assumed).
pub(super) fn check_patchable<F: Format>(hlen: usize, offload: Offload) -> Result<()> {
    if offload != Offload::None && patches::<F>() && hlen > MAX_PATCHED {
        return Err(Error::BadHeaders {
            offload: offload.name(),
            why: HeaderFault::TooLongToPatch {
                len: hlen,
                max: MAX_PATCHED,
            },
        });
    }
    Ok(())
}

impl<M: DmaMapper, D: TxDevice> Queue<M, D> {
    /// What `pkt`'s first buffer starts with: the format's prefix, then
    /// the headers, in a patched copy (in `scratch`) where the engine
    /// fills in what the device does not (see [`patch`]). Headers too
    /// long to patch were refused by [`check_patchable`].
    pub(super) fn front<'a>(
        &self,
        headers: &'a [u8],
        pkt: &Packet,
        scratch: &'a mut Option<Box<Scratch>>,
    ) -> [&'a [u8]; 2] {
        // A format with neither prefix nor patch has no scratch: the
        // headers go as they are.
        let Some(scratch) = scratch.as_mut() else {
            return [&[], headers];
        };
        let (pre, rest) = scratch.split_at_mut(MAX_PREFIX);
        let pre = &mut pre[..Fmt::<D>::PREFIX];
        if !pre.is_empty() {
            // The format writes into zeros, whatever the last packet left.
            pre.fill(0);
            self.fmt.write_prefix(pre, pkt);
        }
        let patch = patch::<Fmt<D>>(pkt);
        match (patch, rest.get_mut(..headers.len())) {
            (Some((l, ipv4, pseudo)), Some(h)) => {
                h.copy_from_slice(headers);
                let (m, iplen) = (usize::from(l.maclen), usize::from(l.iplen));
                if ipv4 {
                    csum::fill_ipv4_header(&mut h[m..m + iplen]);
                }
                if pseudo {
                    // The L4 length: its header and all payload (for TSO,
                    // the whole packet's, which the device moves per
                    // segment; or none, where the device adds each
                    // segment's).
                    let tso = matches!(pkt.offload, Offload::Tso { .. });
                    let l4len = if tso && !Fmt::<D>::TSO_PSEUDO_LENGTH {
                        0
                    } else {
                        pkt.hlen + pkt.len - m - iplen
                    };
                    // The layout was parsed from these headers: an IPv4 or
                    // IPv6 header of `iplen` bytes, the L4 header after it.
                    if let Some(sum) = csum::pseudo_header_sum(&h[m..m + iplen], l4len) {
                        let at = m + iplen + l4_csum_offset(l.l4);
                        h[at..at + 2].copy_from_slice(&sum.to_be_bytes());
                    }
                }
                [pre, h]
            }
            _ => [pre, headers],
        }
    }

    pub(super) fn drop_header(&mut self, h: Hdr<M>) {
        release_header(h, &mut self.bounce, &mut self.hdr_cache, &mut self.stats);
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
        self.with_front(hdr, pkt, |q, front| q.place_front(idx, front))
    }

    /// Runs `f` on `pkt`'s front (the format's prefix, then the headers,
    /// patched if the format needs it), put together in the queue's
    /// scratch, which is taken for the call and put back after it.
    pub(super) fn with_front<R>(
        &mut self,
        headers: &[u8],
        pkt: &Packet,
        f: impl FnOnce(&mut Self, [&[u8]; 2]) -> R,
    ) -> R {
        // A new one only if an unwinding `f` lost it.
        let mut scratch = self.scratch.take().or_else(scratch::<Fmt<D>>);
        let front = self.front(headers, pkt, &mut scratch);
        let r = f(self, front);
        self.scratch = scratch;
        r
    }

    /// [`place_header`](Self::place_header) of the packet's front (the
    /// format's prefix and its headers), at most [`max_headers`] bytes of
    /// headers ([`check_placeable`] refused longer ones): the header frag
    /// of a front that fits no bounce slot fits one chunk.
    ///
    /// A header frag is counted (`mapped_headers`, and `header_fallbacks`
    /// where the queue has bounce slots) only once its packet is posted,
    /// by `advance`: a failed send counts nothing.
    fn place_front(&mut self, idx: u16, front: [&[u8]; 2]) -> Result<(Iova, Hdr<M>)> {
        if let Some(b) = self.bounce.as_mut() {
            // Without a prefix (the 82576), one copy of the headers.
            let filled = match front {
                [[], h] => b.fill(usize::from(idx), h),
                parts => b.fill_parts(usize::from(idx), parts.into_iter()),
            };
            match filled {
                Ok(iova) => return Ok((iova, Hdr::Slot(usize::from(idx)))),
                // Too long for a slot: a frag of its own (a fallback).
                Err(pfrag::Error::HeaderTooLarge { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        let [prefix, hdr] = front;
        let mut f = self.hdr_cache.refill(prefix.len() + hdr.len(), true)?;
        let (p, h) = f.as_mut_slice().split_at_mut(prefix.len());
        p.copy_from_slice(prefix);
        h.copy_from_slice(hdr);
        Ok((f.iova(), Hdr::Frag(f)))
    }
}

/// Gives back a packet's header: its bounce slot, or its frag (an unmap
/// that fails is counted). The queue's fields it needs come apart, so
/// that a reap can give a header back while it still holds the packet
/// ([`Popped`](super::inflight::Popped)).
#[inline(always)]
pub(super) fn release_header<M: DmaMapper>(
    h: Hdr<M>,
    bounce: &mut Option<bounce::Ring<M>>,
    hdr_cache: &mut FragCache<M>,
    stats: &mut Stats,
) {
    match h {
        Hdr::Slot(i) => {
            if let Some(b) = bounce.as_mut() {
                // The slot the queue filled for this packet: in range.
                let r = b.release(i);
                debug_assert!(r.is_ok(), "{r:?}");
            }
        }
        Hdr::Frag(f) => {
            if hdr_cache.complete(f).is_err() {
                stats.unmap_errors += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::igb::Advanced;
    use crate::format::virtio::Split;

    #[test]
    fn headers_too_long_to_patch_are_refused_for_a_format_that_patches() {
        let long = MAX_PATCHED + 1;
        let e = check_patchable::<Split>(long, Offload::Checksum).unwrap_err();
        assert!(
            matches!(
                e,
                Error::BadHeaders {
                    why: HeaderFault::TooLongToPatch { len, max: MAX_PATCHED },
                    ..
                } if len == long
            ),
            "{e}"
        );
        assert!(check_patchable::<Split>(long, Offload::Tso { mss: 1448 }).is_err());
        // The 82576 takes the pseudo-header sum too (it fills in the IPv4
        // header checksum); nothing to patch without an offload.
        assert!(check_patchable::<Advanced>(long, Offload::Checksum).is_err());
        assert!(check_patchable::<Split>(long, Offload::None).is_ok());
        assert!(check_patchable::<Advanced>(long, Offload::None).is_ok());
        assert!(check_patchable::<Split>(MAX_PATCHED, Offload::Checksum).is_ok());
    }
}
