//! The deterministic payload of each flow: byte `o` of flow `f`'s TCP stream
//! is a function of `(f, o)`, so a receiver verifies every byte without a
//! copy of what was sent. Stream offsets are 32-bit, like TCP sequence
//! numbers, and wrap.

/// The 8 bytes of flow `flow` at the 8-aligned stream offset `off`.
#[inline]
pub fn word(flow: u32, off: u32) -> u64 {
    ((u64::from(flow) << 32) | u64::from(off & !7)).wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ 0x5bd1_e995_a5a5_0f0f
}

/// Byte `off` of flow `flow`.
#[inline]
pub fn byte(flow: u32, off: u32) -> u8 {
    word(flow, off).to_le_bytes()[(off & 7) as usize]
}

/// Writes flow `flow`'s bytes starting at stream offset `off` into `buf`.
pub fn fill(flow: u32, off: u32, buf: &mut [u8]) {
    let head = ((8 - (off & 7)) & 7) as usize;
    let head = head.min(buf.len());
    for (i, b) in buf[..head].iter_mut().enumerate() {
        *b = byte(flow, off.wrapping_add(i as u32));
    }
    let mut o = off.wrapping_add(head as u32);
    let mut words = buf[head..].chunks_exact_mut(8);
    for w in &mut words {
        w.copy_from_slice(&word(flow, o).to_le_bytes());
        o = o.wrapping_add(8);
    }
    for (i, b) in words.into_remainder().iter_mut().enumerate() {
        *b = byte(flow, o.wrapping_add(i as u32));
    }
}

/// Whether `buf` holds flow `flow`'s bytes from stream offset `off`.
pub fn verify(flow: u32, off: u32, buf: &[u8]) -> bool {
    let head = (((8 - (off & 7)) & 7) as usize).min(buf.len());
    let mut ok = buf[..head]
        .iter()
        .enumerate()
        .all(|(i, &b)| b == byte(flow, off.wrapping_add(i as u32)));
    let mut o = off.wrapping_add(head as u32);
    let mut words = buf[head..].chunks_exact(8);
    for w in &mut words {
        ok &= u64::from_le_bytes(w.try_into().expect("8 bytes")) == word(flow, o);
        o = o.wrapping_add(8);
    }
    ok && words
        .remainder()
        .iter()
        .enumerate()
        .all(|(i, &b)| b == byte(flow, o.wrapping_add(i as u32)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(crate::proptest_config())]

        #[test]
        fn fill_then_verify_at_any_offset(flow in 0u32..2000, off in any::<u32>(), len in 0usize..200) {
            let mut b = vec![0u8; len];
            fill(flow, off, &mut b);
            prop_assert!(verify(flow, off, &b));
            for (i, &x) in b.iter().enumerate() {
                prop_assert_eq!(x, byte(flow, off.wrapping_add(i as u32)));
            }
        }

        #[test]
        fn a_flipped_byte_or_a_shift_is_caught(flow in 0u32..2000, off in 0u32..1_000_000, len in 16usize..200, at in any::<usize>()) {
            let mut b = vec![0u8; len];
            fill(flow, off, &mut b);
            let i = at % len;
            b[i] ^= 0x40;
            prop_assert!(!verify(flow, off, &b));
            b[i] ^= 0x40;
            prop_assert!(!verify(flow, off + 1, &b));
            prop_assert!(!verify(flow + 1, off, &b));
        }
    }
}
