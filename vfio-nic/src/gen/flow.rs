//! TCP/IPv4 flows: header templates built with `etherparse`, per-flow
//! sequence state, and the mapping from ports back to flows that lets a
//! receiver find a payload's pattern.

use etherparse::{EtherType, Ethernet2Header, IpNumber, Ipv4Header, TcpHeader};

use crate::error::{Error, Result};
use crate::offload::{Ip, Layout, L4};

/// TCP source port of flow 0; flow `f` sends from `BASE_PORT + f`.
pub const BASE_PORT: u16 = 10_000;
/// Most flows a queue can carry (one source port each).
pub const MAX_FLOWS: usize = (u16::MAX - BASE_PORT) as usize + 1;
/// Ethernet header bytes.
pub const MACLEN: usize = 14;
/// IPv4 header bytes (no options).
pub const IPLEN: usize = 20;
/// TCP header bytes (no options).
pub const L4LEN: usize = 20;
/// Header bytes of every packet.
pub const HDR_LEN: usize = MACLEN + IPLEN + L4LEN;
/// Where the layers of every flow's headers are (Ethernet, IPv4 and TCP
/// without options), as [`offload::layout`](crate::offload::layout)
/// finds them.
pub const LAYOUT: Layout = Layout {
    maclen: MACLEN as u8,
    ip: Ip::V4,
    iplen: IPLEN as u16,
    l4len: L4LEN as u8,
    l4: L4::Tcp,
};
/// TCP destination port.
pub const DST_PORT: u16 = 5001;

const IP_TOTAL_LEN: usize = MACLEN + 2;
const IP_ID: usize = MACLEN + 4;
const TCP_SEQ: usize = MACLEN + IPLEN + 4;

/// Initial sequence number of flow `flow`.
pub fn isn(flow: u32) -> u32 {
    flow.wrapping_mul(0x0101_0101).wrapping_add(0x1000)
}

/// The flow a TCP source port belongs to.
pub fn flow_of_port(port: u16) -> Option<u32> {
    port.checked_sub(BASE_PORT).map(u32::from)
}

/// One flow's header template and send state.
#[derive(Clone, Debug)]
pub struct Flow {
    id: u32,
    /// Ethernet + IPv4 + TCP, checksums zero (the NIC inserts them).
    template: [u8; HDR_LEN],
    /// Stream offset of the next payload byte.
    next: u32,
    /// IP id of the next packet.
    ip_id: u16,
}

impl Flow {
    /// Flow `id`'s template.
    pub fn new(id: usize) -> Result<Flow> {
        if id >= MAX_FLOWS {
            return Err(Error::BadFlow {
                flow: id,
                flows: MAX_FLOWS,
            });
        }
        let id32 = id as u32;
        let eth = Ethernet2Header {
            source: [0x02, 0, 0, 0, 0, 0x01],
            destination: [0x02, 0, 0, 0, 0, 0x02],
            ether_type: EtherType::IPV4,
        };
        let dst = [10, 0, (id >> 8) as u8, id as u8];
        let ip =
            Ipv4Header::new(L4LEN as u16, 64, IpNumber::TCP, [10, 1, 0, 1], dst).map_err(|_| {
                Error::BadConfig {
                    what: "ipv4 payload",
                    value: L4LEN as u64,
                }
            })?;
        let mut tcp = TcpHeader::new(BASE_PORT + id as u16, DST_PORT, isn(id32), 65_535);
        tcp.ack = true;
        tcp.psh = true;
        let mut v = Vec::with_capacity(HDR_LEN);
        // Writing into a Vec cannot fail.
        let _ = eth.write(&mut v);
        let _ = ip.write(&mut v);
        let _ = tcp.write(&mut v);
        let mut template = [0u8; HDR_LEN];
        template.copy_from_slice(&v);
        // The NIC computes both checksums.
        template[MACLEN + 10..MACLEN + 12].fill(0);
        template[MACLEN + IPLEN + 16..MACLEN + IPLEN + 18].fill(0);
        Ok(Flow {
            id: id32,
            template,
            next: 0,
            ip_id: 0,
        })
    }

    /// The flow's index.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Stream offset of the next payload byte.
    pub fn next_offset(&self) -> u32 {
        self.next
    }

    /// Writes the header of the next packet (carrying `payload` bytes)
    /// without advancing the flow: call [`advance`](Self::advance) once the
    /// packet was posted. Returns the stream offset of the packet's first
    /// payload byte. The IPv4 total length saturates at 65,535 (a TSO
    /// packet's device writes each segment's own).
    pub fn header(&self, payload: usize, out: &mut [u8; HDR_LEN]) -> u32 {
        *out = self.template;
        let total = payload.saturating_add(IPLEN + L4LEN).min(u16::MAX as usize) as u16;
        out[IP_TOTAL_LEN..IP_TOTAL_LEN + 2].copy_from_slice(&total.to_be_bytes());
        out[IP_ID..IP_ID + 2].copy_from_slice(&self.ip_id.to_be_bytes());
        let seq = isn(self.id).wrapping_add(self.next);
        out[TCP_SEQ..TCP_SEQ + 4].copy_from_slice(&seq.to_be_bytes());
        self.next
    }

    /// Moves the flow past a posted packet of `payload` bytes, `mss` per
    /// segment.
    pub fn advance(&mut self, payload: usize, mss: usize) {
        self.next = self.next.wrapping_add(payload as u32);
        let segs = payload.div_ceil(mss.max(1)).max(1);
        self.ip_id = self.ip_id.wrapping_add(segs as u16);
    }

    /// [`header`](Self::header) then [`advance`](Self::advance).
    pub fn next_header(&mut self, payload: usize, mss: usize, out: &mut [u8; HDR_LEN]) -> u32 {
        let off = self.header(payload, out);
        self.advance(payload, mss);
        off
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_parses_and_carries_the_sequence() {
        let mut f = Flow::new(7).unwrap();
        let mut h = [0u8; HDR_LEN];
        assert_eq!(f.next_header(1000, 1448, &mut h), 0);
        assert_eq!(f.next_header(500, 1448, &mut h), 1000);
        // The header alone (its IPv4 total length counts the payload).
        let (ip, rest) = Ipv4Header::from_slice(&h[MACLEN..]).unwrap();
        assert_eq!(usize::from(ip.total_len), IPLEN + L4LEN + 500);
        let (tcp, _) = TcpHeader::from_slice(rest).unwrap();
        let tso = crate::offload::Offload::Tso { mss: 1448 };
        assert_eq!(crate::offload::layout(&h, tso).unwrap(), LAYOUT);
        assert_eq!(tcp.source_port, BASE_PORT + 7);
        assert_eq!(tcp.sequence_number, isn(7).wrapping_add(1000));
        assert_eq!(flow_of_port(tcp.source_port), Some(7));
    }

    #[test]
    fn too_many_flows_is_an_error() {
        assert!(matches!(Flow::new(MAX_FLOWS), Err(Error::BadFlow { .. })));
    }
}
