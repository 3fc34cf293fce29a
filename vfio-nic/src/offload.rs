//! What a NIC does to a packet on its way out (checksum insertion, TCP
//! segmentation), and the NIC-independent check that a packet's headers
//! allow it: Ethernet, IPv4 or IPv6, TCP or UDP. Headers are parsed with
//! `etherparse`; a header the offload cannot use is a typed error, found
//! before anything is posted. A format's own limits (what its device can
//! carry) are the format's ([`crate::format::Format`]).

use std::fmt;

use etherparse::{
    EtherType, Ethernet2Header, IpNumber, Ipv4Header, Ipv6Header, TcpHeader, UdpHeader,
};

pub use crate::error::HeaderFault;
use crate::error::{Error, Result};

/// What the device does to a packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offload {
    /// Nothing: the frame goes out exactly as given (one frame, checksums
    /// as the caller wrote them; no context descriptor).
    None,
    /// Insert the TCP or UDP checksum (and, for IPv4, the header checksum).
    Checksum,
    /// TCP segmentation: cut the payload into `mss`-byte segments, each with
    /// its own IP length (IPv4: and id and header checksum), TCP sequence
    /// and checksum.
    Tso {
        /// Payload bytes per segment.
        mss: u16,
    },
}

impl Offload {
    /// What it is called in errors and reports.
    pub fn name(self) -> &'static str {
        match self {
            Offload::None => "a frame without offload",
            Offload::Checksum => "checksum offload",
            Offload::Tso { .. } => "TSO",
        }
    }
}

/// The IP version of an offloaded packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ip {
    /// IPv4: a header checksum, an id per segment.
    V4,
    /// IPv6 (a fixed 40-byte header, no extension headers).
    V6,
}

/// The transport protocol of an offloaded packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum L4 {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
}

/// Where the layers of an offloaded packet's headers are: what the context
/// descriptor tells the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Ethernet header bytes.
    pub maclen: u8,
    /// The IP version.
    pub ip: Ip,
    /// IP header bytes (40 for IPv6).
    pub iplen: u16,
    /// TCP or UDP header bytes.
    pub l4len: u8,
    /// The transport.
    pub l4: L4,
}

impl Layout {
    /// All header bytes.
    pub fn len(&self) -> usize {
        usize::from(self.maclen) + usize::from(self.iplen) + usize::from(self.l4len)
    }
    /// Never true: a layout has headers.
    pub fn is_empty(&self) -> bool {
        false
    }
}

fn bad(offload: Offload, why: HeaderFault) -> Error {
    Error::BadHeaders {
        offload: offload.name(),
        why,
    }
}

/// Checks `headers` (Ethernet + IPv4 + TCP or UDP, nothing else) for
/// `offload` of a packet with `payload` bytes after them, and returns where
/// the layers are (`None` for [`Offload::None`], which needs nothing).
/// `max_payload` is the format's limit
/// ([`Format::MAX_PAYLOAD`](crate::format::Format::MAX_PAYLOAD)): the
/// payload of a TSO packet, the whole frame of any other.
#[inline]
pub fn check(
    headers: &[u8],
    payload: usize,
    offload: Offload,
    max_payload: usize,
) -> Result<Option<Layout>> {
    if headers.is_empty() {
        return Err(bad(offload, HeaderFault::Empty));
    }
    let total = headers.len() + payload;
    let max = match offload {
        Offload::Tso { .. } => max_payload.saturating_add(headers.len()),
        _ => max_payload,
    };
    if total > max {
        return Err(Error::PayloadTooLarge {
            len: payload,
            max: max.saturating_sub(headers.len()),
        });
    }
    if offload == Offload::None {
        return Ok(None);
    }
    parse_layout(headers, payload, offload)
}

/// [`check`] of an offload's headers, after the size checks: the parse
/// (out of line, so that a packet without an offload skips it cheaply).
#[inline(never)]
fn parse_layout(headers: &[u8], payload: usize, offload: Offload) -> Result<Option<Layout>> {
    if offload == (Offload::Tso { mss: 0 }) {
        return Err(bad(offload, HeaderFault::ZeroMss));
    }
    let parse = |e: &dyn fmt::Display| bad(offload, HeaderFault::Parse(e.to_string()));
    let (eth, rest) = Ethernet2Header::from_slice(headers).map_err(|e| parse(&e))?;
    // The IP header: its version, length, the protocol after it, and the
    // IP packet's length it states (for checksum offload of one frame).
    let (ip, iplen, proto, stated, rest) = match eth.ether_type {
        EtherType::IPV4 => {
            let (h, rest) = Ipv4Header::from_slice(rest).map_err(|e| parse(&e))?;
            let stated = usize::from(h.total_len);
            (Ip::V4, h.header_len(), h.protocol, stated, rest)
        }
        EtherType::IPV6 => {
            let (h, rest) = Ipv6Header::from_slice(rest).map_err(|e| parse(&e))?;
            let stated = Ipv6Header::LEN + usize::from(h.payload_length);
            (Ip::V6, Ipv6Header::LEN, h.next_header, stated, rest)
        }
        t => return Err(bad(offload, HeaderFault::NotIp(t.0))),
    };
    let (l4, l4len, rest) = match proto {
        IpNumber::TCP => {
            let (t, rest) = TcpHeader::from_slice(rest).map_err(|e| parse(&e))?;
            (L4::Tcp, t.header_len(), rest)
        }
        IpNumber::UDP if !matches!(offload, Offload::Tso { .. }) => {
            let (u, rest) = UdpHeader::from_slice(rest).map_err(|e| parse(&e))?;
            (L4::Udp, u.header_len(), rest)
        }
        IpNumber::UDP => return Err(bad(offload, HeaderFault::TsoNeedsTcp)),
        p => return Err(bad(offload, HeaderFault::NotTcpOrUdp(p.0))),
    };
    if !rest.is_empty() {
        return Err(bad(
            offload,
            HeaderFault::Length {
                given: headers.len(),
                parsed: headers.len() - rest.len(),
            },
        ));
    }
    let layout = Layout {
        maclen: Ethernet2Header::LEN as u8,
        ip,
        iplen: iplen as u16,
        l4len: l4len as u8,
        l4,
    };
    let ip_packet = headers.len() + payload - Ethernet2Header::LEN;
    if offload == Offload::Checksum && stated != ip_packet {
        return Err(bad(
            offload,
            HeaderFault::IpLength {
                header: stated,
                packet: ip_packet,
            },
        ));
    }
    Ok(Some(layout))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::desc::MAX_PAYLEN;
    use etherparse::PacketBuilder;

    fn tcp_headers(payload: usize) -> Vec<u8> {
        let mut v = Vec::new();
        PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
            .ipv4([10, 0, 0, 1], [10, 0, 0, 2], 64)
            .tcp(1000, 2000, 7, 65535)
            .write(&mut v, &vec![0u8; payload])
            .unwrap();
        v.truncate(54);
        v
    }

    #[test]
    fn tcp_headers_give_their_layout() {
        let h = tcp_headers(100);
        let l = check(&h, 100, Offload::Checksum, MAX_PAYLEN)
            .unwrap()
            .unwrap();
        assert_eq!((l.maclen, l.iplen, l.l4len, l.l4), (14, 20, 20, L4::Tcp));
        assert_eq!(l.len(), 54);
        assert!(check(&h, 9000, Offload::Tso { mss: 1448 }, MAX_PAYLEN).is_ok());
        assert_eq!(check(&h, 5, Offload::None, MAX_PAYLEN).unwrap(), None);
    }

    #[test]
    fn headers_the_offload_cannot_use_are_typed_errors() {
        let h = tcp_headers(100);
        let why = |r: Result<Option<Layout>>| match r {
            Err(Error::BadHeaders { why, .. }) => why,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            why(check(&h, 99, Offload::Checksum, MAX_PAYLEN)),
            HeaderFault::IpLength {
                header: 140,
                packet: 139
            }
        );
        assert!(matches!(
            why(check(&h[..50], 100, Offload::Checksum, MAX_PAYLEN)),
            HeaderFault::Parse(_)
        ));
        let mut longer = h.clone();
        longer.push(0);
        assert!(matches!(
            why(check(&longer, 100, Offload::Tso { mss: 1448 }, MAX_PAYLEN)),
            HeaderFault::Length {
                given: 55,
                parsed: 54
            }
        ));
        let mut arp = h.clone();
        arp[12..14].copy_from_slice(&[0x08, 0x06]);
        assert_eq!(
            why(check(&arp, 100, Offload::Checksum, MAX_PAYLEN)),
            HeaderFault::NotIp(0x0806)
        );
        assert_eq!(
            why(check(&h, 100, Offload::Tso { mss: 0 }, MAX_PAYLEN)),
            HeaderFault::ZeroMss
        );
    }

    #[test]
    fn udp_takes_checksums_but_not_tso() {
        let mut v = Vec::new();
        PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
            .ipv4([10, 0, 0, 1], [10, 0, 0, 2], 64)
            .udp(53, 53)
            .write(&mut v, &[0u8; 10])
            .unwrap();
        v.truncate(42);
        let l = check(&v, 10, Offload::Checksum, MAX_PAYLEN)
            .unwrap()
            .unwrap();
        assert_eq!((l.l4len, l.l4), (8, L4::Udp));
        assert!(matches!(
            check(&v, 10, Offload::Tso { mss: 1000 }, MAX_PAYLEN),
            Err(Error::BadHeaders {
                why: HeaderFault::TsoNeedsTcp,
                ..
            })
        ));
    }

    #[test]
    fn empty_headers_are_bad_headers_for_every_offload() {
        for o in [Offload::None, Offload::Checksum, Offload::Tso { mss: 1448 }] {
            match check(&[], 100, o, MAX_PAYLEN) {
                Err(Error::BadHeaders {
                    why: HeaderFault::Empty,
                    ..
                }) => {}
                other => panic!("{o:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn past_paylen_is_refused() {
        let h = tcp_headers(0);
        assert!(matches!(
            check(&h, MAX_PAYLEN + 1, Offload::Tso { mss: 1448 }, MAX_PAYLEN),
            Err(Error::PayloadTooLarge {
                max: MAX_PAYLEN,
                ..
            })
        ));
    }
}
