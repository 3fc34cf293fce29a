//! The raw memory module's own tests.

use super::*;

#[test]
fn region_is_aligned_and_writable() {
    let r = Region::new(3 * 4096 + 1, 64 << 10, false).unwrap();
    assert_eq!(r.addr().0 % (64 << 10), 0);
    assert_eq!(r.len(), 4 * 4096);
    // SAFETY: the range is inside the live region and nothing else uses it.
    unsafe {
        write(r.addr().offset(100), b"hello");
        let mut b = [0u8; 5];
        read(r.addr().offset(100), &mut b);
        assert_eq!(&b, b"hello");
    }
}

#[test]
fn word_copies_write_exactly_their_bytes_at_any_alignment() {
    let r = Region::new(4096, 4096, false).unwrap();
    let src: Vec<u8> = (1..=140).collect();
    // Every length to 40, and lengths around the four-word steps of
    // the whole-word path.
    let lens = (0..=40).chain([63, 64, 65, 127, 128, 129]);
    for len in lens {
        for at in 0..8 {
            let base = r.addr().offset(64);
            // SAFETY: 64..224 lies in the live region, which only this
            // test touches, through these word copies.
            unsafe { write_words(base, &[0xee; 160]) };
            // SAFETY: as above: at most 8 + 140 bytes past `base`.
            unsafe { write_words(base.offset(at), &src[..len]) };
            let mut back = [0u8; 160];
            // SAFETY: as above.
            unsafe { read_words(base, &mut back) };
            let mut want = [0xeeu8; 160];
            want[at..at + len].copy_from_slice(&src[..len]);
            assert_eq!(back, want, "at {at}, len {len}");
            let mut part = vec![0u8; len];
            // SAFETY: as above.
            unsafe { read_words(base.offset(at), &mut part) };
            assert_eq!(part, src[..len], "read back at {at}, len {len}");
        }
    }
}

#[test]
fn huge_request_reports_its_backing() {
    let r = Region::new(4096, 4096, true).unwrap();
    assert!(matches!(r.backing(), Backing::Huge | Backing::HugeFallback));
}

#[test]
fn release_zeroes_pages() {
    let r = Region::new(8192, 4096, false).unwrap();
    // SAFETY: the range is inside the live region; nothing maps it for DMA.
    unsafe {
        write(r.addr().offset(4096), &[7u8; 16]);
        r.release(4096, 4096).unwrap();
        assert_eq!(slice(r.addr().offset(4096), 16), &[0u8; 16]);
    }
}

#[test]
fn zero_length_region_is_an_error() {
    assert!(matches!(
        Region::new(0, 4096, false),
        Err(Error::ZeroLength)
    ));
}
