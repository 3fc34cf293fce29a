//! The ring side of a doorbell: what the device checks before it takes a
//! chain, the walk of the available ring, and each chain's descriptors.
//!
//! A doorbell that fails has taken nothing: the device first checks what
//! it can (the available ring readable, the used ring writable, the
//! available index at most a ring ahead of the device), and refuses the
//! doorbell on the first thing wrong. A fault that shows only once chains
//! were taken (and sent: a device cannot take a packet back) is what a
//! virtio device answers by setting `NEEDS_RESET` in its `device_status`
//! and stopping (virtio 1.x, 2.1.2): the model counts it
//! ([`NicStats::stops`](crate::model::softnic::NicStats::stops)), takes
//! nothing more until it is reset, and every chain it took without
//! returning it stays the driver's packet in flight, never reported.

use std::mem::{offset_of, size_of};
use std::sync::atomic::Ordering;

use pfrag::Iova;
use virtio_bindings::virtio_ring::{vring_desc, VRING_DESC_F_INDIRECT};
use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemory, Permissions};

use super::super::softnic::MAX_BUFS;
use super::Engine;
use crate::error::{Error, Result};

impl Engine {
    /// Serves a doorbell: takes chains until the available ring is empty
    /// (and, with notifications back on, stays so), once [`check`] finds
    /// nothing wrong. A failed check is its error, with nothing taken and
    /// nothing written. A fault after it stops the device: counted, and
    /// [`Error::DeviceStopped`] with the fault as its cause; the caller
    /// refuses every doorbell after it until a reset.
    pub(super) fn drain<M: GuestMemory>(&mut self, q: &mut Queue, mem: &M) -> Result<()> {
        check(q, mem)?;
        self.serve(q, mem).map_err(|e| {
            self.stats.stops += 1;
            self.stopped = true;
            self.stop(Some(e))
        })
    }

    /// The walk of the available ring. An available index the ring cannot
    /// hold, or an entry that cannot be read, is an error rather than a
    /// loop that never ends; after [`check`], either means the ring
    /// changed under the device during the doorbell, as does a used entry
    /// that cannot be written (one, counted in `faults`, as a status word
    /// the device could not write back).
    ///
    /// One empty pass is no sign of a broken ring: a doorbell may come
    /// after the pass before it took its chains (a device thread serves
    /// doorbells late), so a pass finds nothing new, and the driver may
    /// publish between that pass's read of the available index and
    /// `enable_notification`'s re-read. The pass after that one starts
    /// after an index read that showed more: if it takes nothing either,
    /// the entries it was shown cannot be read, and that is the error.
    fn serve<M: GuestMemory>(&mut self, q: &mut Queue, mem: &M) -> Result<()> {
        let (table, size) = (GuestAddress(q.desc_table()), q.size());
        let mut empty = 0u32;
        loop {
            q.disable_notification(mem).map_err(Error::Virtqueue)?;
            let mut taken = 0u32;
            while let Some(chain) = q.iter(mem).map_err(Error::Virtqueue)?.next() {
                let head = chain.head_index();
                self.take(mem, chain, (table, size));
                taken += 1;
                if head >= size {
                    // No chain has that id: counted as malformed (`take`
                    // found no descriptor), with no used entry to return.
                    continue;
                }
                if let Err(e) = q.add_used(mem, head, 0) {
                    self.stats.faults += 1;
                    return Err(Error::Virtqueue(e));
                }
            }
            if !q.enable_notification(mem).map_err(Error::Virtqueue)? {
                return Ok(());
            }
            empty = if taken == 0 { empty + 1 } else { 0 };
            if empty == 2 {
                return Err(Error::AvailUnreadable {
                    next_avail: q.next_avail(),
                });
            }
        }
    }

    /// Sends one chain of a descriptor table at `ring.0` of `ring.1`
    /// descriptors (counted as malformed if a buffer is device-written, a
    /// descriptor names an indirect table, which the device does not
    /// offer, or the chain is longer than a packet may be).
    ///
    /// A chain cut short, whose last descriptor read names a next one, is
    /// dropped, never sent as a shorter packet: as a fault if that next
    /// descriptor lies in the table (it could not be read), as malformed
    /// otherwise (it lies outside, or the chain loops).
    fn take<M: GuestMemory>(
        &mut self,
        mem: &M,
        mut chain: DescriptorChain<&M>,
        ring: (GuestAddress, u16),
    ) {
        self.bufs.clear();
        let size = ring.1;
        let mut ok = true;
        let (mut n, mut cut) = (0usize, None);
        let mut at = chain.head_index();
        loop {
            // `virtio-queue` would follow an indirect descriptor into its
            // table: it is looked at before the chain reads it.
            if at < size && indirect(mem, ring, at) {
                self.stats.descs += 1;
                (ok, cut) = (false, None);
                break;
            }
            let Some(d) = chain.next() else { break };
            self.stats.descs += 1;
            n += 1;
            cut = d.has_next().then(|| d.next());
            ok &= !d.is_write_only() && self.bufs.len() < MAX_BUFS;
            if self.bufs.len() < MAX_BUFS {
                self.bufs.push((Iova(d.addr().0), d.len() as usize));
            }
            match cut {
                Some(next) => at = next,
                None => break,
            }
        }
        if let Some(next) = cut.filter(|_| ok) {
            self.stats.packets += 1;
            if next < size && n < usize::from(size) {
                // One descriptor could not be read; the chain stops there.
                self.stats.count_read_fault();
            } else {
                self.stats.bad_desc += 1;
            }
        } else if ok {
            self.process(mem);
        } else {
            self.stats.packets += 1;
            self.stats.bad_desc += 1;
        }
    }
}

/// What a doorbell checks before it takes a chain: the available ring
/// (`flags`, `idx`, the entries, `used_event`) readable, the used ring
/// (`flags`, `idx`, the entries, `avail_event`) writable, and the available
/// index at most the ring's size past the device's next entry
/// ([`Error::RingUnreachable`], [`Error::AvailIndex`]). Nothing is
/// written. While the caller's view holds off unmaps, a ring found
/// reachable here stays so for the doorbell.
fn check<M: GuestMemory>(q: &Queue, mem: &M) -> Result<()> {
    let n = u64::from(q.size());
    let parts = [
        (
            "available ring",
            q.avail_ring(),
            6 + 2 * n,
            Permissions::Read,
        ),
        ("used ring", q.used_ring(), 6 + 8 * n, Permissions::Write),
    ];
    for (part, at, len, access) in parts {
        if !mem.check_range(GuestAddress(at), len as usize, access) {
            return Err(Error::RingUnreachable {
                part,
                access: match access {
                    Permissions::Write => "writable",
                    _ => "readable",
                },
                iova: at,
                len,
            });
        }
    }
    let avail = q
        .avail_idx(mem, Ordering::Acquire)
        .map_err(Error::Virtqueue)?;
    let next_avail = q.next_avail();
    if avail.0.wrapping_sub(next_avail) > q.size() {
        return Err(Error::AvailIndex {
            avail: avail.0,
            next_avail,
            size: q.size(),
        });
    }
    Ok(())
}

/// Whether descriptor `i` of the table at `ring.0` (of `ring.1`
/// descriptors, `i` among them) names an indirect table. One that cannot
/// be read does not: the chain's own read of it faults.
fn indirect<M: GuestMemory>(mem: &M, ring: (GuestAddress, u16), i: u16) -> bool {
    let flags = offset_of!(vring_desc, flags) as u64;
    let at = (u64::from(i) * size_of::<vring_desc>() as u64)
        .checked_add(flags)
        .and_then(|off| ring.0.checked_add(off));
    at.and_then(|a| mem.read_obj::<u16>(a).ok())
        .is_some_and(|f| u16::from_le(f) & VRING_DESC_F_INDIRECT as u16 != 0)
}
