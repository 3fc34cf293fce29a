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
/// over the rest of it.
pub fn fill_ipv4_header(ip: &mut [u8]) {
    ip[10..12].fill(0);
    let mut c = Csum::new();
    c.add(ip);
    ip[10..12].copy_from_slice(&c.finish().to_be_bytes());
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
