//! Packing bytes gathered from several parts into 64-bit words, stored
//! straight into memory the device only reads, with relaxed atomic stores,
//! each word once: how a bounce slot takes a small packet's prefix,
//! headers and payload without first copying them into one buffer.
//!
//! A word that spans two parts is put together in a register from the last
//! bytes of one part and the first of the next, each read with one 8-byte
//! load where the part has 8 bytes; every other word is one load and one
//! store. Gathering the parts into a buffer first and storing its words
//! cost more (a word read back across two of the buffer's copies could not
//! be forwarded from them), and so did 32-bit words: a 64-byte frame is 16
//! stores of them, which bound the copy's speed.

use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes per word.
const W: usize = 8;

/// The little-endian value of 8 bytes.
#[inline(always)]
fn le(b: &[u8]) -> u64 {
    u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
}

/// Stores the word whose little-endian value is `v`: its bytes land in
/// memory in that order on any host.
#[inline(always)]
fn put(w: Option<&AtomicU64>, v: u64) {
    if let Some(w) = w {
        w.store(u64::from_ne_bytes(v.to_le_bytes()), Ordering::Relaxed);
    }
}

/// Bytes carried over to the next part: the first `n` bytes of a word, in
/// the low bytes of `v` (little-endian), the others zero.
#[derive(Clone, Copy, Default)]
struct Carry {
    v: u64,
    n: usize,
}

impl Carry {
    /// Adds the byte `b`; a full word is stored into the next of `ws`.
    #[inline]
    fn push<'w>(&mut self, b: u8, ws: &mut impl Iterator<Item = &'w AtomicU64>) {
        self.v |= u64::from(b) << (8 * self.n);
        self.n += 1;
        if self.n == W {
            put(ws.next(), self.v);
            *self = Carry::default();
        }
    }
}

/// Stores the bytes of `parts`, one after another, into `ws` from its first
/// word on, each word with one relaxed 64-bit atomic store; the bytes of the
/// last word past the parts' end are stored as zero. Bytes past the end of
/// `ws` are not stored: the caller gives at least the parts' length in
/// words (rounded up).
///
/// ```text
/// parts: [0 1 2 3 4 5] [6 7 8 9 a b c d e f 10 11]
/// words: [0 1 2 3 4 5 6 7] [8 9 a b c d e f] [10 11 0 0 0 0 0 0]
/// ```
#[inline]
pub(crate) fn store_parts<'a>(ws: &[AtomicU64], parts: impl Iterator<Item = &'a [u8]>) {
    let mut ws = ws.iter();
    let mut carry = Carry::default();
    for p in parts {
        if p.len() < W {
            // Too short for a whole-word load: byte by byte.
            for &b in p {
                carry.push(b, &mut ws);
            }
            continue;
        }
        // Finish the carried word with the part's first bytes.
        let mut rest = p;
        if carry.n > 0 {
            put(ws.next(), carry.v | le(p) << (8 * carry.n));
            rest = &p[W - carry.n..];
        }
        let mut chunks = rest.chunks_exact(W);
        for (c, w) in (&mut chunks).zip(ws.by_ref()) {
            put(Some(w), le(c));
        }
        // The part's last bytes, read as its last 8 and shifted down.
        let r = chunks.remainder().len();
        carry = match r {
            0 => Carry::default(),
            _ => Carry {
                v: le(&p[p.len() - W..]) >> (8 * (W - r)),
                n: r,
            },
        };
    }
    if carry.n > 0 {
        put(ws.next(), carry.v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bytes(ws: &[AtomicU64]) -> Vec<u8> {
        ws.iter()
            .flat_map(|w| w.load(Ordering::Relaxed).to_ne_bytes())
            .collect()
    }

    #[test]
    fn a_word_spanning_parts_takes_bytes_of_each() {
        let ws: Vec<AtomicU64> = (0..4).map(|_| AtomicU64::new(u64::MAX)).collect();
        let a: Vec<u8> = (0..10).collect();
        let b: Vec<u8> = (10..28).collect();
        store_parts(&ws, [&a[..], &b[..]].into_iter());
        let mut want: Vec<u8> = (0..28).collect();
        want.extend([0; 4]);
        assert_eq!(bytes(&ws), want);
    }

    #[test]
    fn nothing_is_stored_past_the_words_given() {
        let ws: Vec<AtomicU64> = (0..2).map(|_| AtomicU64::new(7)).collect();
        store_parts(&ws[..1], [&[1u8, 2, 3, 4, 5, 6, 7, 8, 9][..]].into_iter());
        let mut want = vec![1u8, 2, 3, 4, 5, 6, 7, 8];
        want.extend(7u64.to_ne_bytes());
        assert_eq!(bytes(&ws), want);
    }

    fn config() -> ProptestConfig {
        let mut c = ProptestConfig::with_cases(if cfg!(miri) { 8 } else { 256 });
        if cfg!(miri) {
            c.failure_persistence = None;
        }
        c
    }

    proptest! {
        #![proptest_config(config())]

        /// Any parts, empty and short ones too, land as their
        /// concatenation, zero-padded to a whole word, and no further.
        #[test]
        fn parts_land_as_their_concatenation(
            parts in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..20), 0..6),
        ) {
            let all: Vec<u8> = parts.concat();
            let n = all.len().div_ceil(W);
            let ws: Vec<AtomicU64> = (0..n + 1).map(|_| AtomicU64::new(u64::MAX)).collect();
            store_parts(&ws[..n], parts.iter().map(|p| &p[..]));
            let got = bytes(&ws);
            prop_assert_eq!(&got[..all.len()], &all[..]);
            prop_assert!(got[all.len()..W * n].iter().all(|&b| b == 0));
            prop_assert_eq!(&got[W * n..], &[0xffu8; W][..]);
        }
    }
}
