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
use crate::format::Format;

/// What the device does to a packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
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
    /// The header bytes the IP length field counts besides the payload:
    /// IPv4's total length counts its own header and the L4 header,
    /// IPv6's payload length the L4 header alone.
    pub fn ip_counted(&self) -> usize {
        let l4 = usize::from(self.l4len);
        match self.ip {
            Ip::V4 => usize::from(self.iplen) + l4,
            Ip::V6 => l4,
        }
    }
}

fn bad(offload: Offload, why: HeaderFault) -> Error {
    Error::BadHeaders {
        offload: offload.name(),
        why,
    }
}

/// The largest value of a 16-bit IP length field (IPv4's total length,
/// IPv6's payload length).
pub const MAX_IP_LENGTH: usize = u16::MAX as usize;

/// The most payload a packet with `headers` bytes of headers (laid out as
/// `layout`, if parsed) may carry under `offload` on format `F`: the
/// format's [`MAX_PAYLOAD`](Format::MAX_PAYLOAD), counting the payload
/// alone for TSO and the whole frame otherwise; and for TSO on a format
/// whose GSO packet is an IP packet
/// ([`TSO_IP_LENGTH`](Format::TSO_IP_LENGTH)), and for one frame (no
/// TSO) on any format, what the 16-bit IP length field leaves after the
/// headers it counts. Without a layout that last bound is not applied
/// (the headers are not known yet).
///
/// ```
/// use vfio_nic::format::{igb::Advanced, virtio::Split};
/// use vfio_nic::offload::{self, Ip, Layout, Offload, L4};
///
/// let l = Layout { maclen: 14, ip: Ip::V4, iplen: 20, l4len: 20, l4: L4::Tcp };
/// let tso = Offload::Tso { mss: 1448 };
/// assert_eq!(offload::max_payload::<Advanced>(54, Some(&l), tso), 262_143);
/// assert_eq!(offload::max_payload::<Split>(54, Some(&l), tso), 65_495);
/// let v6 = Layout { ip: Ip::V6, iplen: 40, ..l };
/// assert_eq!(offload::max_payload::<Split>(74, Some(&v6), tso), 65_515);
/// // Without TSO the whole frame counts, and one IPv4 frame's length
/// // field bounds it on the 82576 too.
/// assert_eq!(offload::max_payload::<Split>(54, Some(&l), Offload::Checksum), 65_481);
/// assert_eq!(offload::max_payload::<Advanced>(54, Some(&l), Offload::Checksum), 65_495);
/// ```
#[inline]
pub fn max_payload<F: Format>(headers: usize, layout: Option<&Layout>, offload: Offload) -> usize {
    match (offload, layout) {
        (Offload::Tso { .. }, Some(l)) if F::TSO_IP_LENGTH => {
            F::MAX_PAYLOAD.min(MAX_IP_LENGTH.saturating_sub(l.ip_counted()))
        }
        (Offload::Tso { .. }, _) => F::MAX_PAYLOAD,
        (_, Some(l)) => F::MAX_PAYLOAD
            .saturating_sub(headers)
            .min(MAX_IP_LENGTH.saturating_sub(l.ip_counted())),
        _ => F::MAX_PAYLOAD.saturating_sub(headers),
    }
}

/// Checks `headers` (Ethernet + IPv4 or IPv6 + TCP or UDP, nothing else)
/// for `offload` of a packet with `payload` bytes after them on format
/// `F`, and returns where the layers are (`None` for [`Offload::None`],
/// which needs nothing). A payload past [`max_payload`] for these headers
/// is [`Error::PayloadTooLarge`], naming that limit.
#[inline]
pub fn check<F: Format>(
    headers: &[u8],
    payload: usize,
    offload: Offload,
) -> Result<Option<Layout>> {
    if headers.is_empty() {
        return Err(bad(offload, HeaderFault::Empty));
    }
    // A packet bounded by its IP length (one frame, or TSO on a format
    // whose GSO packet is an IP packet) is checked once its headers are
    // parsed, so that the error names the limit for these headers (never
    // above the format's).
    let by_ip = offload == Offload::Checksum
        || (F::TSO_IP_LENGTH && matches!(offload, Offload::Tso { .. }));
    if !by_ip {
        too_large(payload, max_payload::<F>(headers.len(), None, offload))?;
    }
    if offload == Offload::None {
        return Ok(None);
    }
    let (layout, stated) = parse_layout(headers, offload)?;
    // One frame's IP length bounds it on every format; a TSO packet's on
    // a format whose GSO packet is an IP packet.
    if by_ip {
        too_large(
            payload,
            max_payload::<F>(headers.len(), Some(&layout), offload),
        )?;
    }
    if offload == Offload::Checksum {
        let ip_packet = headers.len() + payload - Ethernet2Header::LEN;
        if stated != ip_packet {
            return Err(bad(
                offload,
                HeaderFault::IpLength {
                    header: stated,
                    packet: ip_packet,
                },
            ));
        }
        check_udp_length(headers, &layout, payload)?;
    }
    Ok(Some(layout))
}

/// Refuses a UDP header (of checksum-offloaded `headers` laid out as
/// `layout`, before `payload` bytes) whose length is not the datagram's:
/// the device sums the bytes it is given, the receiver those the length
/// names.
fn check_udp_length(headers: &[u8], layout: &Layout, payload: usize) -> Result<()> {
    if layout.l4 != L4::Udp {
        return Ok(());
    }
    // The UDP header was parsed from these bytes: its length field lies
    // 4 bytes into it.
    let at = usize::from(layout.maclen) + usize::from(layout.iplen) + 4;
    let stated = u16::from_be_bytes([headers[at], headers[at + 1]]);
    let packet = usize::from(layout.l4len) + payload;
    if usize::from(stated) != packet {
        let header = usize::from(stated);
        let why = HeaderFault::UdpLength { header, packet };
        return Err(bad(Offload::Checksum, why));
    }
    Ok(())
}

/// [`Error::PayloadTooLarge`] if `payload` is past `max`.
#[inline]
fn too_large(payload: usize, max: usize) -> Result<()> {
    if payload > max {
        return Err(Error::PayloadTooLarge { len: payload, max });
    }
    Ok(())
}

/// Parses `headers` for `offload` (not [`Offload::None`]) without
/// looking at a payload: where the layers are, or the typed error
/// [`check`] gives for them. What a caller asks before it knows a
/// payload's length (a limit for these headers, say).
pub fn layout(headers: &[u8], offload: Offload) -> Result<Layout> {
    if headers.is_empty() {
        return Err(bad(offload, HeaderFault::Empty));
    }
    parse_layout(headers, offload).map(|(l, _)| l)
}

/// The layout of an offload's headers and the IP packet length they
/// state (out of line, so that a packet without an offload skips it
/// cheaply).
#[inline(never)]
fn parse_layout(headers: &[u8], offload: Offload) -> Result<(Layout, usize)> {
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
            if h.is_fragmenting_payload() {
                let (more, offset) = (h.more_fragments, h.fragment_offset.value());
                return Err(bad(offload, HeaderFault::IpFragment { more, offset }));
            }
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
    Ok((layout, stated))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::desc::MAX_PAYLEN;
    use crate::format::igb::Advanced;
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
        let l = check::<Advanced>(&h, 100, Offload::Checksum)
            .unwrap()
            .unwrap();
        assert_eq!((l.maclen, l.iplen, l.l4len, l.l4), (14, 20, 20, L4::Tcp));
        assert_eq!(l.len(), 54);
        assert!(check::<Advanced>(&h, 9000, Offload::Tso { mss: 1448 }).is_ok());
        assert_eq!(check::<Advanced>(&h, 5, Offload::None).unwrap(), None);
    }

    #[test]
    fn headers_the_offload_cannot_use_are_typed_errors() {
        let h = tcp_headers(100);
        let why = |r: Result<Option<Layout>>| match r {
            Err(Error::BadHeaders { why, .. }) => why,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            why(check::<Advanced>(&h, 99, Offload::Checksum)),
            HeaderFault::IpLength {
                header: 140,
                packet: 139
            }
        );
        assert!(matches!(
            why(check::<Advanced>(&h[..50], 100, Offload::Checksum)),
            HeaderFault::Parse(_)
        ));
        let mut longer = h.clone();
        longer.push(0);
        assert!(matches!(
            why(check::<Advanced>(&longer, 100, Offload::Tso { mss: 1448 })),
            HeaderFault::Length {
                given: 55,
                parsed: 54
            }
        ));
        let mut arp = h.clone();
        arp[12..14].copy_from_slice(&[0x08, 0x06]);
        assert_eq!(
            why(check::<Advanced>(&arp, 100, Offload::Checksum)),
            HeaderFault::NotIp(0x0806)
        );
        assert_eq!(
            why(check::<Advanced>(&h, 100, Offload::Tso { mss: 0 })),
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
        let l = check::<Advanced>(&v, 10, Offload::Checksum)
            .unwrap()
            .unwrap();
        assert_eq!((l.l4len, l.l4), (8, L4::Udp));
        assert!(matches!(
            check::<Advanced>(&v, 10, Offload::Tso { mss: 1000 }),
            Err(Error::BadHeaders {
                why: HeaderFault::TsoNeedsTcp,
                ..
            })
        ));
    }

    #[test]
    fn empty_headers_are_bad_headers_for_every_offload() {
        for o in [Offload::None, Offload::Checksum, Offload::Tso { mss: 1448 }] {
            match check::<Advanced>(&[], 100, o) {
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
            check::<Advanced>(&h, MAX_PAYLEN + 1, Offload::Tso { mss: 1448 }),
            Err(Error::PayloadTooLarge {
                max: MAX_PAYLEN,
                ..
            })
        ));
    }

    fn tcp6_headers() -> Vec<u8> {
        let mut v = Vec::new();
        PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
            .ipv6([1; 16], [2; 16], 64)
            .tcp(1000, 2000, 7, 65535)
            .write(&mut v, &[])
            .unwrap();
        v
    }

    /// A virtio-net GSO packet is one IP packet: its length field bounds
    /// the payload (IPv4 counts its header and TCP's, IPv6 TCP's alone);
    /// the 82576's PAYLEN counts the payload alone. Before, virtio-net
    /// took 65,535 bytes behind IPv4 and TCP headers: an IP packet of
    /// 65,575 bytes.
    #[test]
    fn a_virtio_gso_packet_fits_its_ip_length_field() {
        use crate::format::virtio::Split;
        let tso = Offload::Tso { mss: 1448 };
        let (v4, v6) = (tcp_headers(0), tcp6_headers());
        assert_eq!(v6.len(), 74);
        for (h, max) in [(&v4, 65_495), (&v6, 65_515)] {
            let l = check::<Split>(h, max, tso).unwrap().unwrap();
            assert_eq!(l.ip_counted() + max, MAX_IP_LENGTH);
            for len in [max + 1, 65_535] {
                assert!(
                    matches!(
                        check::<Split>(h, len, tso),
                        Err(Error::PayloadTooLarge { len: l, max: m }) if l == len && m == max
                    ),
                    "{len}"
                );
            }
            assert!(check::<Advanced>(h, 65_535, tso).is_ok());
        }
        // Past the format's own limit too: the error still names the
        // limit for these headers, the one a retry must meet.
        assert!(matches!(
            check::<Split>(&v4, usize::MAX, tso),
            Err(Error::PayloadTooLarge { max: 65_495, .. })
        ));
        assert_eq!(
            layout(&v4, tso).unwrap(),
            check::<Split>(&v4, 1, tso).unwrap().unwrap()
        );
        // IPv4 options (8 bytes) and TCP options (12) count in the total
        // length too.
        let mut v = Vec::new();
        let mut ip = Ipv4Header::new(0, 64, IpNumber::TCP, [10, 0, 0, 1], [10, 0, 0, 2]).unwrap();
        ip.options = [1u8; 8][..].try_into().unwrap();
        let mut tcp = TcpHeader::new(1000, 2000, 7, 65535);
        tcp.set_options_raw(&[1u8; 12]).unwrap();
        let eth = Ethernet2Header {
            source: [2, 0, 0, 0, 0, 1],
            destination: [2, 0, 0, 0, 0, 2],
            ether_type: EtherType::IPV4,
        };
        eth.write(&mut v).unwrap();
        ip.write(&mut v).unwrap();
        tcp.write(&mut v).unwrap();
        let l = check::<Split>(&v, 65_475, tso).unwrap().unwrap();
        assert_eq!((l.iplen, l.l4len, l.ip_counted()), (28, 32, 60));
        assert!(matches!(
            check::<Split>(&v, 65_476, tso),
            Err(Error::PayloadTooLarge { max: 65_475, .. })
        ));
    }
}
