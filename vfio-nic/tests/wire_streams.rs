//! The wire checker on sequences of a flow's frames that repeat or restart
//! it: a copy of a stream's first frame (a duplicate, or the first frame
//! arriving late) is never counted as delivered bytes or as a new stream; a
//! new stream is; and a new stream whose first frame was lost cannot be
//! told from late frames of the old one (the limit documented on
//! `check::wire`).

use proptest::prelude::*;
use vfio_nic::check::wire::{FrameError, WireCheck};
use vfio_nic::gen::flow::{isn, BASE_PORT, DST_PORT};
use vfio_nic::gen::pattern;

const FLOW: u32 = 3;

/// A valid frame of `FLOW` carrying `len` bytes at stream offset `off`.
fn frame(off: u32, len: usize) -> Vec<u8> {
    let mut payload = vec![0u8; len];
    pattern::fill(FLOW, off, &mut payload);
    let b = etherparse::PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
        .ipv4([10, 1, 0, 1], [10, 0, 0, 3], 64)
        .tcp(
            BASE_PORT + FLOW as u16,
            DST_PORT,
            isn(FLOW).wrapping_add(off),
            65_535,
        );
    let mut out = Vec::new();
    b.write(&mut out, &payload).unwrap();
    out
}

/// One stream's frames, of the payload lengths `lens`, in order.
fn stream(lens: &[usize]) -> Vec<Vec<u8>> {
    let mut off = 0u32;
    lens.iter()
        .map(|&len| {
            let f = frame(off, len);
            off += len as u32;
            f
        })
        .collect()
}

/// Runs `frames` through a fresh checker: the checker and, per frame,
/// whether it was refused. Every frame is counted once: good, bad or
/// unplaced.
fn run(frames: &[Vec<u8>]) -> (WireCheck, Vec<bool>) {
    let mut c = WireCheck::default();
    let refused = frames.iter().map(|f| c.frame(f).is_err()).collect();
    let r = c.report();
    assert_eq!(r.frames, frames.len() as u64);
    assert_eq!(r.frames, r.good_frames + r.bad_frames + r.unplaced_frames);
    (c, refused)
}

const LENS: [usize; 4] = [100, 200, 300, 400];

#[test]
fn a_duplicate_first_frame_is_not_counted_again() {
    let s = stream(&LENS);
    // The first frame again, in the middle of its stream.
    let seq = [&s[..3], &[s[0].clone(), s[3].clone()]].concat();
    let (c, refused) = run(&seq);
    let r = c.report();
    assert_eq!(refused, [false; 5], "{r:?}");
    assert_eq!((r.good_frames, r.bad_frames, r.streams), (4, 1, 1), "{r:?}");
    assert_eq!((r.payload_bytes, r.unplaced_frames), (1000, 0));
    assert_eq!(c.next_offset(FLOW), Some(1000));
    assert!(r.first_errors[0].starts_with("frame 4: "), "{r:?}");
}

#[test]
fn a_late_first_frame_is_not_a_new_stream() {
    let s = stream(&LENS);
    let seq = [s[1].clone(), s[0].clone(), s[2].clone(), s[3].clone()];
    let (c, refused) = run(&seq);
    let r = c.report();
    // The frame after the lost start is taken up as the flow's (one bad
    // frame); the start, late, is bad too, and moves nothing.
    assert_eq!(refused, [true, false, false, false], "{r:?}");
    assert_eq!((r.good_frames, r.bad_frames, r.streams), (2, 2, 1), "{r:?}");
    assert_eq!((r.payload_bytes, r.unplaced_frames), (700, 0));
    assert!(r.first_errors[1].starts_with("frame 2: "), "{r:?}");
}

#[test]
fn a_new_stream_is_counted_from_its_first_frame() {
    let a = stream(&LENS);
    let b = stream(&[100, 50, 60]);
    let (c, refused) = run(&[a, b].concat());
    let r = c.report();
    assert_eq!(refused, [false; 7], "{r:?}");
    assert_eq!((r.good_frames, r.bad_frames, r.streams), (7, 0, 2), "{r:?}");
    assert_eq!((r.payload_bytes, r.unplaced_frames), (1000 + 210, 0));
    assert_eq!(c.next_offset(FLOW), Some(210));
}

#[test]
fn a_first_frame_with_nothing_after_it_counts_no_bytes() {
    let s = stream(&LENS);
    // A copy of the first frame ends the capture: a duplicate, or a new
    // stream of one frame; nothing tells which.
    let (c, refused) = run(&[&s[..], &s[..1]].concat());
    let r = c.report();
    assert_eq!(refused, [false; 5], "{r:?}");
    assert_eq!((r.good_frames, r.bad_frames, r.streams), (4, 0, 1), "{r:?}");
    assert_eq!(
        (r.payload_bytes, r.unplaced_frames, r.unplaced_bytes),
        (1000, 1, 100)
    );
    assert_eq!(c.next_offset(FLOW), Some(1000));
    // Nor when the flow's next frame cannot tell either: after a stream of
    // one frame, its copy and a new stream go on at the same offset.
    let (c, _) = run(&[s[0].clone(), s[0].clone(), s[1].clone()]);
    let r = c.report();
    assert_eq!((r.good_frames, r.bad_frames, r.streams), (2, 0, 1), "{r:?}");
    assert_eq!((r.payload_bytes, r.unplaced_frames), (300, 1));
}

/// Identical copies of a first frame in a row are placed together by the
/// flow's next frame: when that continues the old stream, every one is a
/// copy. The first used to be left unplaced, followed by another start.
#[test]
fn copies_of_a_first_frame_in_a_row_settle_on_the_stream() {
    let s = stream(&LENS);
    for n in 2..4 {
        let copies = vec![s[0].clone(); n];
        let seq = [&s[..2], &copies[..], &s[2..]].concat();
        let (c, refused) = run(&seq);
        let r = c.report();
        assert_eq!(refused, vec![false; 4 + n], "{r:?}");
        let counts = (r.good_frames, r.bad_frames, r.streams);
        assert_eq!(counts, (4, n as u64, 1), "{r:?}");
        assert_eq!((r.payload_bytes, r.unplaced_frames), (1000, 0));
        // Each counted when the flow's next frame came, in order.
        for (i, e) in r.first_errors.iter().enumerate() {
            assert!(e.starts_with(&format!("frame {}: ", 3 + i)), "{r:?}");
        }
    }
}

/// Identical first frames in a row whose next frame continues them start
/// one new stream: one of them is its first frame, and the others are
/// copies of it or new streams of one frame each, which nothing tells
/// apart: unplaced.
#[test]
fn identical_starts_in_a_row_before_a_new_stream_start_one() {
    let s = stream(&LENS);
    let b = stream(&[100, 50]);
    let seq = [&s[..], &[b[0].clone()], &b[..]].concat();
    let (c, refused) = run(&seq);
    let r = c.report();
    assert_eq!(refused, [false; 7], "{r:?}");
    assert_eq!((r.good_frames, r.bad_frames, r.streams), (6, 0, 2), "{r:?}");
    assert_eq!((r.payload_bytes, r.unplaced_frames), (1150, 1));
    assert_eq!(c.next_offset(FLOW), Some(150));
}

/// A new stream's first frame whose next frame is lost, or late, still
/// starts the stream (so that the new stream's frames are not refused as
/// behind the old one's), but its bytes are not counted: a copy of the old
/// stream's first frame followed by a loss would read the same.
#[test]
fn a_start_followed_by_neither_stream_starts_one_but_counts_nothing() {
    let a = stream(&LENS);
    let b = stream(&[100, 50, 60, 70]);
    let seq = [&a[..], &[b[0].clone()], &b[2..]].concat();
    let (c, refused) = run(&seq);
    let r = c.report();
    assert_eq!(refused, [false, false, false, false, false, true, false]);
    assert_eq!((r.good_frames, r.bad_frames, r.streams), (5, 1, 2), "{r:?}");
    assert_eq!((r.payload_bytes, r.unplaced_frames), (1000 + 70, 1));
    assert_eq!(c.next_offset(FLOW), Some(280));
}

/// A damaged start is bad at once; the flow's next frame places it all
/// the same, and nothing is counted twice.
#[test]
fn a_damaged_start_is_bad_and_still_placed() {
    let a = stream(&LENS);
    let b = stream(&[100, 50]);
    let mut bad = b[0].clone();
    let last = bad.len() - 1;
    bad[last] ^= 1;
    // A new stream: the flow follows it.
    let (c, refused) = run(&[&a[..], &[bad.clone(), b[1].clone()]].concat());
    let r = c.report();
    assert_eq!(refused, [false, false, false, false, true, false]);
    assert_eq!((r.good_frames, r.bad_frames, r.streams), (5, 1, 2), "{r:?}");
    assert_eq!(c.next_offset(FLOW), Some(150));
    // A damaged copy in the old stream: the flow stays.
    let (c, refused) = run(&[&a[..3], &[bad], &a[3..]].concat());
    let r = c.report();
    assert_eq!(refused, [false, false, false, true, false]);
    assert_eq!((r.good_frames, r.bad_frames, r.streams), (4, 1, 1), "{r:?}");
    assert_eq!(c.next_offset(FLOW), Some(1000));
}

/// The limit of the frame format: a frame carries its flow and stream
/// offset, not which run of the flow sent it. A new stream whose first
/// frame was lost sends frames at offsets the old stream passed: each is
/// refused as behind its flow, its bytes not counted, and the stream is
/// not counted; from the old stream's end on its frames read as the old
/// stream's continuation (their bytes are the flow's at those offsets, and
/// count).
#[test]
fn a_new_stream_without_its_first_frame_cannot_be_placed() {
    let a = stream(&LENS);
    let b = stream(&[250, 250, 250, 250, 250, 250]);
    let (c, refused) = run(&[&a[..], &b[1..]].concat());
    let r = c.report();
    assert_eq!(
        refused,
        [false, false, false, false, true, true, true, false, false]
    );
    assert_eq!((r.good_frames, r.bad_frames, r.streams), (6, 3, 1), "{r:?}");
    assert_eq!((r.payload_bytes, r.unplaced_frames), (1000 + 500, 0));
    let mut c = WireCheck::default();
    a.iter().for_each(|f| c.frame(f).unwrap());
    assert!(matches!(
        c.frame(&b[1]),
        Err(FrameError::Gap {
            flow: FLOW,
            got: 250,
            want: 1000
        })
    ));
}

/// One stream's frames with copies of its first frame put in anywhere and,
/// if `late`, its first frame moved after the second.
fn with_copies(lens: &[usize], copies: &[usize], late: bool) -> Vec<Vec<u8>> {
    let mut seq = stream(lens);
    let first = seq[0].clone();
    if late {
        seq.swap(0, 1);
    }
    for &at in copies {
        let at = 1 + at % seq.len();
        seq.insert(at, first.clone());
    }
    seq
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: if cfg!(miri) { 4 } else { 256 },
        ..ProptestConfig::default()
    })]

    /// Copies of a stream's first frame, wherever they come, never count
    /// as bytes or as a stream, and never cost a frame of the stream.
    #[test]
    fn copies_of_the_first_frame_never_count(
        lens in proptest::collection::vec(1usize..1500, 2..8),
        copies in proptest::collection::vec(any::<usize>(), 0..4),
        late in any::<bool>(),
    ) {
        let seq = with_copies(&lens, &copies, late);
        let (c, _) = run(&seq);
        let r = c.report();
        let total: usize = lens.iter().sum();
        prop_assert_eq!(r.streams, 1, "{:?}", r);
        prop_assert_eq!(r.frames, seq.len() as u64);
        if late {
            // The second frame, first to come, is taken up (and refused);
            // the first, late, counts nothing.
            prop_assert_eq!(r.good_frames, lens.len() as u64 - 2, "{:?}", r);
            prop_assert_eq!(r.payload_bytes, (total - lens[0] - lens[1]) as u64);
        } else {
            prop_assert_eq!(r.good_frames, lens.len() as u64, "{:?}", r);
            prop_assert_eq!(r.payload_bytes, total as u64);
        }
        prop_assert_eq!(c.next_offset(FLOW), Some(total as u32));
    }
}
