//! Sending many packets in one call ([`Queue::send_burst`]), as DPDK's
//! `rte_eth_tx_burst` does: each packet all or nothing, and the first that
//! does not fit ends the burst.

use pfrag::dma::DmaMapper;

use super::Queue;
use crate::device::TxDevice;
use crate::error::Result;
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
        for (n, p) in pkts.iter().enumerate() {
            if let Err(e) = self.send(p.headers, p.payload, p.offload, p.token) {
                if n == 0 && !e.is_backoff() {
                    return Err(e);
                }
                return Ok(n);
            }
        }
        Ok(pkts.len())
    }
}
