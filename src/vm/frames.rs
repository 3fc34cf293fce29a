//! How many frames a guest sweep's rows put on the wire, from the numbers
//! its CSV holds: checked, since the CSV is read back from a guest's
//! console and its numbers can be anything.

/// A frame count past 64 bits.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameCountError {
    /// One row's frames.
    #[error(
        "row {row}: {reps} repetitions x ({packets} packets + {warmup} warm-up) x \
         {segments} segments (payload {payload} B, mss {mss} B) overflow 64 bits"
    )]
    Row {
        /// The row (0 is the first after the header).
        row: usize,
        /// Repetitions of the sweep.
        reps: u64,
        /// The row's measured packets.
        packets: u64,
        /// Its warm-up packets.
        warmup: u64,
        /// Its payload bytes per packet.
        payload: u64,
        /// The segment size.
        mss: u64,
        /// Segments per packet.
        segments: u64,
    },
    /// The rows' frames summed.
    #[error(
        "the frames of rows 0..={row} overflow 64 bits ({before} before row {row}, {frames} in it)"
    )]
    Sum {
        /// The row whose frames overflowed the sum.
        row: usize,
        /// The sum of the rows before it.
        before: u64,
        /// Its frames.
        frames: u64,
    },
}

/// What one sweep row sent, per repetition.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RowSent {
    /// Measured packets.
    pub packets: u64,
    /// Warm-up packets.
    pub warmup: u64,
    /// Payload bytes per packet.
    pub payload: u64,
    /// Payload bytes per TSO segment (the row's TCP MSS); 0 counts as 1.
    pub mss: u64,
}

/// Frames `rows` put on the wire over `reps` repetitions: each packet,
/// measured or warm-up, cut into `payload.div_ceil(mss)` segments, with
/// each row's own `mss`. [`FrameCountError`] if a row's count or the sum
/// overflows 64 bits.
pub fn expected_frames(rows: &[RowSent], reps: u64) -> Result<u64, FrameCountError> {
    let mut total = 0u64;
    for (row, r) in rows.iter().enumerate() {
        let mss = r.mss.max(1);
        let segments = r.payload.div_ceil(mss);
        let frames = r
            .packets
            .checked_add(r.warmup)
            .and_then(|n| n.checked_mul(reps))
            .and_then(|n| n.checked_mul(segments))
            .ok_or(FrameCountError::Row {
                row,
                reps,
                packets: r.packets,
                warmup: r.warmup,
                payload: r.payload,
                mss,
                segments,
            })?;
        total = total.checked_add(frames).ok_or(FrameCountError::Sum {
            row,
            before: total,
            frames,
        })?;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(packets: u64, warmup: u64, payload: u64) -> RowSent {
        RowSent {
            packets,
            warmup,
            payload,
            mss: 1448,
        }
    }

    #[test]
    fn frames_count_every_repetition_packet_and_segment() {
        let rows = [row(500, 50, 1448), row(500, 50, 1449), row(10, 0, 0)];
        // 550 packets x 1 segment, 550 x 2, none without payload; twice.
        assert_eq!(expected_frames(&rows, 2), Ok(2 * (550 + 1100)));
        assert_eq!(expected_frames(&[], 5), Ok(0));
    }

    #[test]
    fn each_row_is_cut_at_its_own_mss() {
        let jumbo = RowSent {
            mss: 8948,
            ..row(10, 0, 65160)
        };
        // 65,160 B: 45 segments of 1,448 B, 8 of 8,948 B.
        assert_eq!(
            expected_frames(&[row(10, 0, 65160), jumbo], 1),
            Ok(450 + 80)
        );
        let zero = RowSent {
            mss: 0,
            ..row(1, 0, 3)
        };
        assert_eq!(
            expected_frames(&[zero], 1),
            Ok(3),
            "an mss of 0 counts as 1"
        );
    }

    #[test]
    fn a_count_past_64_bits_is_an_error_with_its_numbers() {
        let big = row(u64::MAX / 2, 0, 3 * 1448);
        let e = expected_frames(&[row(1, 0, 1), big], 1).unwrap_err();
        assert_eq!(
            e,
            FrameCountError::Row {
                row: 1,
                reps: 1,
                packets: u64::MAX / 2,
                warmup: 0,
                payload: 3 * 1448,
                mss: 1448,
                segments: 3,
            }
        );
        assert!(e.to_string().contains("3 segments"), "{e}");
        let e = expected_frames(&[row(u64::MAX, 1, 1)], 1).unwrap_err();
        assert!(
            matches!(e, FrameCountError::Row { .. }),
            "packets + warm-up"
        );
        let e = expected_frames(&[row(1, 0, 1)], u64::MAX).unwrap();
        assert_eq!(e, u64::MAX, "exactly 64 bits is fine");
        let half = row(u64::MAX / 2 + 1, 0, 1);
        let e = expected_frames(&[half, half], 1).unwrap_err();
        assert_eq!(
            e,
            FrameCountError::Sum {
                row: 1,
                before: u64::MAX / 2 + 1,
                frames: u64::MAX / 2 + 1,
            }
        );
    }
}
