//! Sending many packets in one call ([`Queue::send_burst`]), as DPDK's
//! `rte_eth_tx_burst` does: each packet all or nothing, and the first that
//! does not fit ends the burst.

use pfrag::dma::DmaMapper;

use super::inflight::Span;
use super::reap::Reports;
use super::send::Ctx;
use super::{Fmt, Hdr, Queue, MAX_PREFIX};
use crate::device::TxDevice;
use crate::error::Result;
use crate::format::{Format, Packet};
use crate::offload::Offload;

/// One packet of a burst: what [`Queue::send`] takes.
#[derive(Clone, Copy, Debug)]
pub struct TxPacket<'a> {
    /// Ethernet + IPv4/IPv6 + TCP/UDP headers for an offload; any frame
    /// start for [`Offload::None`].
    pub headers: &'a [u8],
    /// The payload after them, copied into the queue's memory.
    pub payload: &'a [u8],
    /// What the device does for the packet.
    pub offload: Offload,
    /// Handed back when the packet completes.
    pub token: u64,
}

impl<M: DmaMapper, D: TxDevice> Queue<M, D> {
    /// Sends `pkts` in order, each as [`send`](Self::send) does (all or
    /// nothing), and returns how many were posted: the first packet that
    /// cannot be posted ends the burst, and the ones after it are not
    /// tried, so the posted ones are always a prefix of `pkts`. Ring the
    /// doorbell ([`kick`](Self::kick)) to hand them to the device.
    ///
    /// A full ring or a memory limit ([`Error::is_backoff`](crate::Error::is_backoff))
    /// ends the burst quietly, with the count: reap, then send the rest. Any
    /// other error is returned if it stopped the first packet; after that
    /// it ends the burst with the count, and comes back when that packet
    /// leads the next burst.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use pfrag::dma::{Domain, SoftIommu, SoftIommuConfig};
    /// # use pfrag::pool::{self, Policy, Pool};
    /// # use pfrag::Order;
    /// # use vfio_nic::model::null::NullNic;
    /// use vfio_nic::offload::Offload;
    /// use vfio_nic::tx::{self, Queue, TxPacket};
    /// # let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default())?);
    /// # let domain = Arc::new(Domain::new(iommu.clone()));
    /// # let pool = Pool::new(domain.clone(), pool::Config::new(Order::new(2)?, Policy::Persistent))?;
    /// let cfg = tx::Config { ring: 16, ..tx::Config::default() };
    /// // SAFETY: the null device translates through the domain's IOMMU.
    /// let mut q = unsafe { Queue::new(domain, pool, NullNic::new(iommu), cfg) }?;
    /// let mut frame = vec![0u8; 60];
    /// frame[12..14].copy_from_slice(&[0x88, 0xb5]); // a local EtherType
    /// let pkts: Vec<TxPacket> = (0..20)
    ///     .map(|t| TxPacket { headers: &frame[..14], payload: &frame[14..], offload: Offload::None, token: t })
    ///     .collect();
    /// let mut sent = q.send_burst(&pkts)?;
    /// assert_eq!(sent, 15, "a ring of 16 holds 15 one-descriptor packets");
    /// q.kick()?;
    /// q.wait(std::time::Duration::from_secs(10))?;
    /// sent += q.send_burst(&pkts[sent..])?;
    /// assert_eq!(sent, 20);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn send_burst(&mut self, pkts: &[TxPacket<'_>]) -> Result<usize> {
        // Nothing the limit reads changes during the call.
        let limit = self.inline_limit();
        let mut n = 0;
        loop {
            n += self.send_inline_run(&pkts[n..], limit);
            let Some(p) = pkts.get(n) else {
                return Ok(n);
            };
            if let Err(e) = self.send(p.headers, p.payload, p.offload, p.token) {
                if n == 0 && !e.is_backoff() {
                    return Err(e);
                }
                return Ok(n);
            }
            n += 1;
        }
    }

    /// Posts the longest prefix of `pkts` that goes out inline without an
    /// offload, each packet exactly as [`send`](Self::send) posts it, with
    /// the checks that do not depend on the packet made once for the run
    /// (`limit`, from [`inline_limit`](Self::inline_limit)); returns how
    /// many it posted. It stops, posting nothing more, at the first packet
    /// it does not take or that fails, which `send` then posts or refuses
    /// with its error (a failure here, of a slot or a descriptor write,
    /// fails there the same way and changes nothing either time).
    fn send_inline_run(&mut self, pkts: &[TxPacket<'_>], limit: Option<usize>) -> usize {
        let Some(limit) = limit else {
            return 0;
        };
        let room = pkts.len().min(self.free_descs());
        let every = self.cfg.report_every;
        // The tail and the count of packets since the last report are kept
        // here for the run and stored once after it (in the queue, each
        // packet's update would wait on the last one's store). The rest is
        // worked out after it, so that the loop carries little.
        let (mut tail, mut since) = (self.tail, self.reports.since());
        let mut posted = 0;
        while let Some(p) = pkts[..room].get(posted) {
            let (hlen, len) = (p.headers.len(), p.payload.len());
            if !matches!(p.offload, Offload::None) || hlen == 0 || len == 0 || hlen + len > limit {
                break;
            }
            let report = Reports::due::<Fmt<D>>(since, every);
            if self.post_plain_inline(p, tail, report).is_err() {
                break;
            }
            since = Reports::count(since, report);
            tail = self.next(tail);
            posted += 1;
        }
        if posted == 0 {
            return 0;
        }
        let last = if tail == 0 {
            self.cfg.ring - 1
        } else {
            tail - 1
        };
        self.reports = Reports::at(since, last);
        self.tail = tail;
        self.used += posted;
        let bytes: usize = pkts[..posted].iter().map(|p| p.payload.len()).sum();
        self.stats.packets += posted as u64;
        self.stats.bytes += bytes as u64;
        self.stats.descs += posted as u64;
        self.stats.inline_packets += posted as u64;
        posted
    }

    /// The most bytes of headers and payload together that a packet
    /// without an offload may have for [`send_inline_run`](Self::send_inline_run)
    /// to take it, if it takes any: where every check `send` makes of
    /// such a packet passes (headers and payload not empty, the format's
    /// and the pool's payload limits, the MTU, placeable headers, the
    /// offload supported), and the packet fits a bounce slot and one
    /// buffer whole.
    fn inline_limit(&self) -> Option<usize> {
        let slot = self.bounce.as_ref()?.slot_size();
        if !self.fmt.supports(Offload::None, None) {
            return None;
        }
        let pre = Fmt::<D>::PREFIX;
        // With at least one header byte, a frame of at most this many
        // bytes has at most `pool_max` of payload.
        let pool_max = super::max_payload::<Fmt<D>>(self.cache.pool().config());
        let limit = [
            Fmt::<D>::MAX_PAYLOAD,
            usize::from(self.cfg.mtu) + super::send::ETH_HLEN,
            slot.saturating_sub(pre),
            Fmt::<D>::MAX_BUF.saturating_sub(pre),
            super::header::max_headers::<Fmt<D>>(),
            pool_max.saturating_add(1),
        ];
        limit.into_iter().min()
    }

    /// Posts one packet without an offload that fits a bounce slot, as
    /// [`send`](Self::send) would, in slot `idx` (the run's tail), minus
    /// what the run keeps for all its packets (the tail, the descriptors
    /// in use, the reports, the counters; `report`: whether this one asks
    /// for one): the caller checked it against
    /// [`inline_limit`](Self::inline_limit) and the free descriptors. On
    /// error nothing is posted.
    #[inline(always)]
    fn post_plain_inline(&mut self, p: &TxPacket<'_>, idx: u16, report: bool) -> Result<()> {
        let pkt = Packet {
            offload: Offload::None,
            hlen: p.headers.len(),
            len: p.payload.len(),
            layout: None,
        };
        let Some(b) = self.bounce.as_mut() else {
            unreachable!("inline_limit saw a bounce ring");
        };
        let iova = if Fmt::<D>::PREFIX == 0 {
            let parts = [p.headers, p.payload];
            b.fill_parts(usize::from(idx), parts.iter().copied())?
        } else {
            let mut pre = [0u8; MAX_PREFIX];
            let pre = &mut pre[..Fmt::<D>::PREFIX];
            self.fmt.write_prefix(pre, &pkt);
            let parts = [&*pre, p.headers, p.payload];
            b.fill_parts(usize::from(idx), parts.iter().copied())?
        };
        self.write_inline(idx, idx, iova, Ctx::NotNeeded, &pkt, report)?;
        let span = Span::new(idx, idx, 1, report);
        self.pending
            .push(span, Hdr::Slot(usize::from(idx)), None, p.token);
        Ok(())
    }
}
