//! The Internet checksum (RFC 1071), accumulated over pieces of any length.

/// A ones'-complement sum in progress. Pieces may have odd lengths: a piece
/// that starts at an odd position is added byte-swapped (RFC 1071, 2(B)).
#[derive(Clone, Copy, Debug, Default)]
pub struct Csum {
    sum: u64,
    odd: bool,
}

fn fold(mut s: u64) -> u16 {
    while s >> 16 != 0 {
        s = (s & 0xffff) + (s >> 16);
    }
    s as u16
}

/// The sum of `data` as big-endian 16-bit words (an odd last byte is padded).
fn raw_sum(data: &[u8]) -> u64 {
    let mut s = 0u64;
    let mut words = data.chunks_exact(8);
    for w in &mut words {
        let v = u64::from_be_bytes(w.try_into().expect("8 bytes"));
        s += (v >> 32) + (v & 0xffff_ffff);
    }
    let rest = words.remainder();
    let mut pairs = rest.chunks_exact(2);
    for p in &mut pairs {
        s += u64::from(u16::from_be_bytes([p[0], p[1]]));
    }
    if let [b] = pairs.remainder() {
        s += u64::from(*b) << 8;
    }
    s
}

impl Csum {
    /// An empty sum.
    pub fn new() -> Csum {
        Csum::default()
    }
    /// Adds the next bytes.
    pub fn add(&mut self, data: &[u8]) {
        let s = fold(raw_sum(data));
        self.sum += u64::from(if self.odd { s.swap_bytes() } else { s });
        self.odd ^= data.len() % 2 == 1;
    }
    /// Adds a 16-bit word at an even position.
    pub fn add_u16(&mut self, v: u16) {
        debug_assert!(!self.odd);
        self.sum += u64::from(v);
    }
    /// The folded sum (not complemented).
    pub fn sum(&self) -> u16 {
        fold(self.sum)
    }
    /// The checksum to put in a header: the complement of the sum.
    pub fn finish(&self) -> u16 {
        !self.sum()
    }
}

/// Writes the header checksum of the IPv4 header `ip` (its bytes 10..12)
/// over the rest of it. A slice shorter than IPv4's 20-byte header is left
/// as it is (`false`).
pub fn fill_ipv4_header(ip: &mut [u8]) -> bool {
    if ip.len() < 20 {
        return false;
    }
    ip[10..12].fill(0);
    let mut c = Csum::new();
    c.add(ip);
    ip[10..12].copy_from_slice(&c.finish().to_be_bytes());
    true
}

/// The folded (not complemented) ones'-complement sum of the
/// pseudo-header of a TCP or UDP packet of `l4len` bytes behind the IP
/// header `ip` (IPv4 or IPv6 by its version; the protocol is IPv4's, or
/// IPv6's next header, as there are no extension headers): source and
/// destination addresses, protocol and length. It is what a device that
/// completes partial checksums (virtio-net's `NEEDS_CSUM`, a Linux
/// `CHECKSUM_PARTIAL` packet) expects in the L4 checksum field; for a
/// packet to be segmented, `l4len` is the whole packet's, L4 header and
/// all payload. The length is added as a 32-bit word (IPv6's form; for
/// IPv4, which has 16 bits, the same sum). `None` for a slice that is no
/// IPv4 or IPv6 header (too short, or another version).
pub fn pseudo_header_sum(ip: &[u8], l4len: usize) -> Option<u16> {
    let (addrs, proto) = match ip.first().map(|b| b >> 4) {
        Some(4) => (ip.get(12..20)?, *ip.get(9)?),
        Some(6) => (ip.get(8..40)?, *ip.get(6)?),
        _ => return None,
    };
    let mut c = Csum::new();
    c.add(addrs);
    c.add_u16(u16::from(proto));
    let len = l4len as u32;
    c.add_u16((len >> 16) as u16);
    c.add_u16(len as u16);
    Some(c.sum())
}

/// A partial checksum `field` (a pseudo-header sum over an L4 length of
/// `whole` bytes) moved to a length of `part` bytes: what segmentation
/// (Linux's `tcp_gso_segment`) writes in each segment before completing
/// it, adding the segment's length and taking away the whole one.
pub fn reseat_len(field: u16, whole: usize, part: usize) -> u16 {
    let mut c = Csum::new();
    c.add_u16(field);
    for v in [!(whole as u32), part as u32] {
        c.add_u16((v >> 16) as u16);
        c.add_u16(v as u16);
    }
    c.sum()
}

/// Completes a partial checksum in place: the L4 packet `l4` (header and
/// payload) whose checksum field at `at` holds a pseudo-header sum gets
/// the complement of the sum of all its bytes, field included, as a
/// device completing `NEEDS_CSUM` writes it. A UDP checksum (`udp`)
/// computed as zero is sent as all ones (zero means none). A field that
/// does not lie inside `l4` leaves it as it is (`false`).
pub fn complete(l4: &mut [u8], at: usize, udp: bool) -> bool {
    if at.checked_add(2).is_none_or(|end| end > l4.len()) {
        return false;
    }
    let mut c = Csum::new();
    c.add(l4);
    let mut sum = c.finish();
    if udp && sum == 0 {
        sum = 0xffff;
    }
    l4[at..at + 2].copy_from_slice(&sum.to_be_bytes());
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn naive(data: &[u8]) -> u16 {
        let mut s = 0u32;
        for (i, b) in data.iter().enumerate() {
            s += if i % 2 == 0 {
                u32::from(*b) << 8
            } else {
                u32::from(*b)
            };
        }
        while s >> 16 != 0 {
            s = (s & 0xffff) + (s >> 16);
        }
        !(s as u16)
    }

    #[test]
    fn rfc1071_example() {
        let mut c = Csum::new();
        c.add(&[0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7]);
        assert_eq!(c.sum(), 0xddf2);
    }

    fn tcp4(payload: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        etherparse::PacketBuilder::ipv4([10, 0, 0, 1], [10, 9, 8, 7], 64)
            .tcp(1000, 2000, 77, 65535)
            .write(&mut v, payload)
            .unwrap();
        v
    }

    #[test]
    fn a_pseudo_header_sum_completed_gives_the_checksum() {
        for payload in [&b"odd"[..], &[0xffu8; 1000][..]] {
            let mut v = tcp4(payload);
            let want = u16::from_be_bytes([v[36], v[37]]);
            let l4len = v.len() - 20;
            let field = pseudo_header_sum(&v[..20], l4len).unwrap();
            v[36..38].copy_from_slice(&field.to_be_bytes());
            complete(&mut v[20..], 16, false);
            assert_eq!(u16::from_be_bytes([v[36], v[37]]), want);
        }
        // IPv6: the 32-bit length and the next header.
        let mut v = Vec::new();
        etherparse::PacketBuilder::ipv6([1; 16], [2; 16], 64)
            .udp(53, 53)
            .write(&mut v, b"v6")
            .unwrap();
        let want = u16::from_be_bytes([v[46], v[47]]);
        let field = pseudo_header_sum(&v[..40], v.len() - 40).unwrap();
        v[46..48].copy_from_slice(&field.to_be_bytes());
        complete(&mut v[40..], 6, true);
        assert_eq!(u16::from_be_bytes([v[46], v[47]]), want);
    }

    #[test]
    fn short_or_foreign_headers_are_refused_not_a_panic() {
        assert_eq!(pseudo_header_sum(&[], 10), None);
        assert_eq!(pseudo_header_sum(&[0x45; 19], 10), None);
        assert_eq!(pseudo_header_sum(&[0x60; 39], 10), None);
        assert_eq!(pseudo_header_sum(&[0x50; 40], 10), None);
        let mut short = [0u8; 19];
        assert!(!fill_ipv4_header(&mut short));
        assert_eq!(short, [0u8; 19]);
        let mut l4 = [1u8; 8];
        assert!(!complete(&mut l4, 7, false));
        assert!(!complete(&mut l4, usize::MAX, false));
        assert_eq!(l4, [1u8; 8]);
        assert!(complete(&mut l4, 6, true));
    }

    #[test]
    fn reseating_the_length_is_the_sum_over_the_new_length() {
        let ip = &tcp4(&[])[..20];
        let whole = pseudo_header_sum(ip, 20 + 60_000).unwrap();
        assert_eq!(
            reseat_len(whole, 20 + 60_000, 20 + 1448),
            pseudo_header_sum(ip, 20 + 1448).unwrap()
        );
        assert_eq!(reseat_len(whole, 80_000, 80_000), whole);
    }

    proptest! {
        #![proptest_config(crate::proptest_config())]

        #[test]
        fn pieces_sum_like_the_whole(data in proptest::collection::vec(any::<u8>(), 0..300),
                                     cuts in proptest::collection::vec(0usize..300, 0..6)) {
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(data.len())).collect();
            cuts.sort_unstable();
            let mut c = Csum::new();
            let mut at = 0;
            for cut in cuts.into_iter().chain([data.len()]) {
                c.add(&data[at..cut]);
                at = cut;
            }
            prop_assert_eq!(c.finish(), naive(&data));
        }
    }
}
