//! What a virtio-net device puts on the wire for a frame as the driver
//! posted it: a capture taken on the driver's side of the device (QEMU's
//! `filter-dump` on a tap backend with vnet headers) holds each frame
//! without its `virtio_net_hdr`, its L4 checksum field holding the
//! pseudo-header sum the device completes, and a TSO packet as one GSO
//! super-frame whose IP length covers all its payload. [`segment`] turns
//! one such frame into the frames the device sends: the checksum
//! completed for a frame that fits one segment, MSS segments for a
//! super-frame, each with the headers segmentation writes (Linux's
//! `tcp_gso_segment` and `inet_gso_segment`: IP lengths, IPv4 ids and
//! header checksums, TCP sequence numbers, FIN and PSH on the last
//! segment only, CWR on the first only), and each segment's checksum
//! derived from the super-frame's field. The fields a device relies on are
//! checked, not repaired: a driver that left the field without the
//! pseudo-header sum is caught ([`GsoError::PseudoSum`]).
//!
//! ```
//! use vfio_nic::check::gso::{segment, GsoError};
//! use vfio_nic::check::wire::WireCheck;
//! use vfio_nic::csum;
//! use vfio_nic::gen::{flow, pattern};
//!
//! // Flow 0's first 4000 bytes as one super-frame, as the engine posts it.
//! let mut h = [0u8; flow::HDR_LEN];
//! flow::Flow::new(0)?.header(4000, &mut h);
//! let mut fr = h.to_vec();
//! fr.resize(flow::HDR_LEN + 4000, 0);
//! pattern::fill(0, 0, &mut fr[flow::HDR_LEN..]);
//! let ip = flow::MACLEN..flow::MACLEN + flow::IPLEN;
//! csum::fill_ipv4_header(&mut fr[ip.clone()]);
//! let sum = csum::pseudo_header_sum(&fr[ip], flow::L4LEN + 4000).unwrap();
//! fr[flow::MACLEN + flow::IPLEN + 16..][..2].copy_from_slice(&sum.to_be_bytes());
//!
//! let frames = segment(&fr, 1448).unwrap();
//! assert_eq!(frames.len(), 3);
//! let mut wire = WireCheck::default();
//! for f in &frames {
//!     wire.frame(f).unwrap();
//! }
//! // Without the pseudo-header sum in the field, the frame is refused.
//! fr[flow::MACLEN + flow::IPLEN + 16..][..2].fill(0);
//! assert!(matches!(segment(&fr, 1448), Err(GsoError::PseudoSum { .. })));
//! # Ok::<(), vfio_nic::Error>(())
//! ```

use etherparse::{EtherType, Ethernet2Header, IpNumber, Ipv4Header, Ipv6Header, TcpHeader};

use crate::csum;

/// The shortest Ethernet frame (without FCS): shorter frames are padded
/// up to it, the IP length telling what is packet.
const MIN_FRAME: usize = 60;

/// Why a captured frame cannot be what a driver posts to a virtio-net
/// device for checksum offload or TSO.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GsoError {
    /// Not Ethernet + IPv4 or IPv6 + TCP or UDP, or cut inside the headers.
    #[error("frame does not parse as Ethernet/IP/TCP or UDP: {0}")]
    Parse(String),
    /// The IP header's length (IPv4's total length, IPv6's 40 + payload
    /// length) is not the frame's: a truncated frame, or a super-frame
    /// whose header does not cover its payload.
    #[error("the IP header says {ip} bytes, the frame holds {frame} after the Ethernet header")]
    Length {
        /// What the IP header says.
        ip: usize,
        /// What the frame holds.
        frame: usize,
    },
    /// A wrong IPv4 header checksum (virtio-net does not fill it in).
    #[error("IPv4 header checksum {got:#06x}, expected {want:#06x}")]
    IpChecksum {
        /// In the frame.
        got: u16,
        /// Computed.
        want: u16,
    },
    /// The L4 checksum field does not hold the pseudo-header sum over the
    /// frame's whole L4 length.
    #[error("L4 checksum field {got:#06x}, the pseudo-header sum is {want:#06x}")]
    PseudoSum {
        /// In the frame.
        got: u16,
        /// The pseudo-header sum.
        want: u16,
    },
    /// An MSS of 0.
    #[error("MSS 0")]
    ZeroMss,
}

/// Where a frame's layers are.
struct Layers {
    iplen: usize,
    l4len: usize,
    ipv4: bool,
    tcp: bool,
}

/// Parses `frame`'s headers and checks what the device relies on: the IP
/// length, the IPv4 header checksum, the pseudo-header sum in the field.
fn parse(frame: &[u8]) -> Result<Layers, GsoError> {
    let perr = |e: &dyn std::fmt::Display| GsoError::Parse(e.to_string());
    let (eth, rest) = Ethernet2Header::from_slice(frame).map_err(|e| perr(&e))?;
    let (ipv4, iplen, proto, stated) = match eth.ether_type {
        EtherType::IPV4 => {
            let (h, _) = Ipv4Header::from_slice(rest).map_err(|e| perr(&e))?;
            let want = h.calc_header_checksum();
            if h.header_checksum != want {
                return Err(GsoError::IpChecksum {
                    got: h.header_checksum,
                    want,
                });
            }
            (true, h.header_len(), h.protocol, usize::from(h.total_len))
        }
        EtherType::IPV6 => {
            let (h, _) = Ipv6Header::from_slice(rest).map_err(|e| perr(&e))?;
            let stated = Ipv6Header::LEN + usize::from(h.payload_length);
            (false, Ipv6Header::LEN, h.next_header, stated)
        }
        t => return Err(GsoError::Parse(format!("ether type {:#06x}", t.0))),
    };
    // A short frame may be padded to the minimum; else the IP length is
    // the frame's.
    let held = rest.len();
    let padded = frame.len() == MIN_FRAME && stated < held;
    if stated < iplen || (stated != held && !padded) {
        return Err(GsoError::Length {
            ip: stated,
            frame: held,
        });
    }
    let l4 = &rest[iplen..stated];
    let (tcp, l4len) = match proto {
        IpNumber::TCP => (
            true,
            TcpHeader::from_slice(l4)
                .map_err(|e| perr(&e))?
                .0
                .header_len(),
        ),
        IpNumber::UDP if l4.len() >= 8 => (false, 8),
        IpNumber::UDP => return Err(GsoError::Parse("UDP header cut short".into())),
        p => return Err(GsoError::Parse(format!("IP protocol {}", p.0))),
    };
    let at = if tcp { 16 } else { 6 };
    let got = u16::from_be_bytes([l4[at], l4[at + 1]]);
    let want = csum::pseudo_header_sum(&rest[..iplen], l4.len())
        .ok_or_else(|| GsoError::Parse("IP header cut short".into()))?;
    if got != want {
        return Err(GsoError::PseudoSum { got, want });
    }
    Ok(Layers {
        iplen,
        l4len,
        ipv4,
        tcp,
    })
}

/// The frames a virtio-net device puts on the wire for `frame`, a frame
/// as the driver posted it (see the module docs), with segments of at most
/// `mss` payload bytes: one frame, its L4 checksum completed, if its
/// payload fits one segment (or it is UDP, which is never segmented);
/// else the TCP segments of the super-frame. A frame whose IP length, IPv4
/// header checksum or L4 checksum field is not what a device relies on is
/// an error.
pub fn segment(frame: &[u8], mss: usize) -> Result<Vec<Vec<u8>>, GsoError> {
    if mss == 0 {
        return Err(GsoError::ZeroMss);
    }
    let l = parse(frame)?;
    let mac = Ethernet2Header::LEN;
    let ip = mac..mac + l.iplen;
    let l4 = ip.end;
    let hlen = l4 + l.l4len;
    let stated = if l.ipv4 {
        usize::from(u16::from_be_bytes([frame[mac + 2], frame[mac + 3]]))
    } else {
        Ipv6Header::LEN + usize::from(u16::from_be_bytes([frame[mac + 4], frame[mac + 5]]))
    };
    let payload = &frame[hlen..mac + stated];
    let whole = l.l4len + payload.len();
    let mss = if l.tcp { mss } else { payload.len().max(1) };
    let n = payload.len().div_ceil(mss).max(1);
    let id0 = u16::from_be_bytes([frame[mac + 4], frame[mac + 5]]);
    let seq0 = u32::from_be_bytes(frame[l4 + 4..l4 + 8].try_into().expect("4 bytes"));
    let at = l4 + if l.tcp { 16 } else { 6 };
    let field = u16::from_be_bytes([frame[at], frame[at + 1]]);
    let mut out = Vec::with_capacity(n);
    for k in 0..n {
        let part = &payload[(k * mss).min(payload.len())..((k + 1) * mss).min(payload.len())];
        let mut f = Vec::with_capacity(hlen + part.len());
        f.extend_from_slice(&frame[..hlen]);
        f.extend_from_slice(part);
        let seglen = l.l4len + part.len();
        if l.ipv4 {
            f[mac + 2..mac + 4].copy_from_slice(&((l.iplen + seglen) as u16).to_be_bytes());
            f[mac + 4..mac + 6].copy_from_slice(&id0.wrapping_add(k as u16).to_be_bytes());
            csum::fill_ipv4_header(&mut f[ip.clone()]);
        } else {
            f[mac + 4..mac + 6].copy_from_slice(&(seglen as u16).to_be_bytes());
        }
        if l.tcp {
            let seq = seq0.wrapping_add((k * mss) as u32);
            f[l4 + 4..l4 + 8].copy_from_slice(&seq.to_be_bytes());
            if k + 1 < n {
                f[l4 + 13] &= !0x09; // FIN and PSH only on the last segment
            }
            if k > 0 {
                f[l4 + 13] &= !0x80; // CWR only on the first
            }
        }
        if seglen != whole {
            let moved = csum::reseat_len(field, whole, seglen);
            f[at..at + 2].copy_from_slice(&moved.to_be_bytes());
        }
        csum::complete(&mut f[l4..], at - l4, !l.tcp);
        out.push(f);
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
