//! The direct read: a payload predicted to match a template has its value bytes read
//! from the stream straight into their place (in the caller's `out=` buffer, or in the
//! room a new array's vector reserved: `output::Output::slot_f32`), and only the
//! template's few constant bytes around them into a buffer of ours, leaving one copy (the
//! kernel's, or TLS's out of its records) where the whole-payload read made two.
//!
//! The prediction is the template the previous payload of the gradient fitted, so the
//! first chunk, and any chunk whose header declares another length, is read whole. Once
//! read, the payload is checked where it lies: its constant bytes against the template,
//! its CRC resumed from the template's prefix CRC through the values in place, then the
//! same rules as any chunk (`rules::take_placed`). A payload that turns out not to fit
//! is put back together (the bytes around, the values copied back from the buffer) and
//! fed whole, so it ends exactly as it would have: the Arrow path's result or error. What
//! the buffer holds after a failed receive is in docs/guides/buffers.md ("Reusing buffers").
//!
//! Uses `template`, `receiver`, `rules` (`Placed`) and `stream` (the clock, progress);
//! used by `stream::receive_gradient`.

use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt};

use crate::error::Result;
use crate::receiver::FrameReceiver;
use crate::rules::Placed;
use crate::stream::{within, Clock, Progress};
use crate::template::Template;

/// How the awaited payload was read.
pub(crate) enum Read {
    /// Not at all: no template is predicted for it, or its values have no place to go
    /// yet; read it whole.
    Whole,
    /// Read in place and taken by the receiver: true once the gradient is complete.
    Placed(bool),
    /// Read in place but not the template's: put back together in the unit, to be fed.
    Assembled,
    /// The stream ended after this many of its bytes.
    Ended(usize),
}

/// One receive's direct reads: the template predicted for the next payload, and the
/// buffers of the bytes around its values.
#[derive(Default)]
pub(crate) struct Direct {
    predicted: Option<Arc<Template>>,
    head: Vec<u8>,
    tail: Vec<u8>,
}

impl Direct {
    /// A payload of the gradient was fed whole: predict that the next ones fit the
    /// template it fits, if the receiver can place values at all (the lookup and the
    /// compare are only paid where they can pay back).
    pub(crate) fn learn(&mut self, receiver: &FrameReceiver, payload: &[u8]) {
        if !receiver.places_values() {
            return;
        }
        let known = self
            .predicted
            .as_ref()
            .is_some_and(|t| t.len() == payload.len());
        if !known {
            self.predicted = receiver
                .templates()
                .for_payload(payload.len())
                .into_iter()
                .find(|t| t.fits(payload));
        }
    }

    /// Read the payload `receiver` awaits, its values into their place when it is
    /// predicted to match a template and the receiver gives them a place. A payload that
    /// does not match after all is left in `unit` (`Read::Assembled`).
    pub(crate) async fn read_payload<R: AsyncRead + Unpin>(
        &mut self,
        receiver: &mut FrameReceiver,
        reader: &mut R,
        unit: &mut Vec<u8>,
        clock: &mut Clock,
        progress: &Progress,
    ) -> Result<Read> {
        let want = receiver.want();
        let Some(template) = self.predicted.clone().filter(|t| t.len() == want) else {
            return Ok(Read::Whole);
        };
        let cut = template.cut();
        let at = (receiver.received(), receiver.total());
        let Some(slot) = receiver.slot(cut.values) else {
            return Ok(Read::Whole);
        };
        let (head, tail) = (&mut self.head, &mut self.tail);
        head.resize(cut.head, 0);
        tail.resize(cut.tail, 0);
        let mut got = 0;
        if !fill(reader, head, None, &mut got, clock, at, progress).await? {
            return Ok(Read::Ended(got));
        }
        // The CRC runs over the values as each read lands them, while they are in cache.
        let mut crc = template.crc_of_head(head);
        for part in [&mut *slot, &mut tail[..]] {
            if !fill(reader, part, crc.as_mut(), &mut got, clock, at, progress).await? {
                return Ok(Read::Ended(got));
            }
        }
        let (Some(seal), Some(crc)) = (template.fits_around(head, tail), crc) else {
            // Predict afresh from this payload once it is fed (`learn`).
            self.predicted = None;
            unit.clear();
            unit.extend_from_slice(head);
            unit.extend_from_slice(slot);
            unit.extend_from_slice(tail);
            return Ok(Read::Assembled);
        };
        let placed = Placed {
            checksum: crc.finalize(),
            values: cut.values,
            seal: seal.map(str::to_owned),
        };
        receiver.feed_placed(placed).map(Read::Placed)
    }
}

/// Fill `part` from `reader`, into `crc` as it comes when given, counting into `got` what
/// came; false when the stream ended first. Each read is bounded by the clock, as
/// `stream::read_unit`'s are.
async fn fill<R: AsyncRead + Unpin>(
    reader: &mut R,
    part: &mut [u8],
    mut crc: Option<&mut crc32fast::Hasher>,
    got: &mut usize,
    clock: &mut Clock,
    at: (usize, Option<u32>),
    progress: &Progress,
) -> Result<bool> {
    let mut filled = 0;
    while filled < part.len() {
        let n = within(clock, at, reader.read(&mut part[filled..])).await?;
        if n == 0 {
            return Ok(false);
        }
        clock.start();
        progress.add(n, 0);
        if let Some(crc) = crc.as_mut() {
            crc.update(&part[filled..filled + n]);
        }
        filled += n;
        *got += n;
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use tokio::io::ReadBuf;

    use super::*;
    use crate::codec::Layout;
    use crate::error::GradientStreamError;
    use crate::frame::{FrameHeader, HEADER_LEN};
    use crate::output::OutSlice;
    use crate::receiver::Ended;
    use crate::session::SessionConfig;
    use crate::stream::receive_gradient;

    const CHUNK: usize = 64;

    /// A stream of `data` that hands out at most `sizes[turn]` bytes a read, in turn.
    struct Dribble {
        data: Vec<u8>,
        at: usize,
        sizes: &'static [usize],
        turn: usize,
    }

    impl Dribble {
        fn new(data: Vec<u8>, sizes: &'static [usize]) -> Self {
            Dribble {
                data,
                at: 0,
                sizes,
                turn: 0,
            }
        }
    }

    /// The runtime each test's receive runs on (one thread, timers for the clock).
    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
    }

    impl AsyncRead for Dribble {
        fn poll_read(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<std::io::Result<()>> {
            let this = self.get_mut();
            let size = this.sizes[this.turn % this.sizes.len()];
            this.turn += 1;
            let n = size.min(buf.remaining()).min(this.data.len() - this.at);
            buf.put_slice(&this.data[this.at..this.at + n]);
            this.at += n;
            Poll::Ready(Ok(()))
        }
    }

    /// Read sizes: a byte at a time, odd sizes across the cuts, and all that is asked.
    const READS: [&[usize]; 4] = [&[1], &[7, 3, 1000, 5], &[4099], &[usize::MAX]];

    fn session(layout: Layout, sealed: bool) -> SessionConfig {
        let mut s = SessionConfig::new("direct", CHUNK);
        s.layout = layout;
        s.seal = sealed;
        s
    }

    fn sessions() -> Vec<SessionConfig> {
        let mut all = Vec::new();
        for layout in [Layout::Seed, Layout::Compact] {
            for sealed in [false, true] {
                all.push(session(layout, sealed));
            }
        }
        all
    }

    fn values(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| f32::from_bits((i as u32).wrapping_mul(2_654_435_761)))
            .collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Receive `wire` through the stream receiver into an `out=` of `room` values (NaNs
    /// before), read `sizes` at a time: the result and what `out` holds.
    fn receive_into(
        s: &SessionConfig,
        wire: &[u8],
        room: usize,
        sizes: &'static [usize],
    ) -> (Result<()>, Vec<f32>) {
        let mut out = vec![f32::NAN; room];
        let mut reader = Dribble::new(wire.to_vec(), sizes);
        let got = runtime().block_on(async {
            // SAFETY: the receiver and its Output are dropped within this block.
            let receiver = s.receiver_into(unsafe { OutSlice::of(&mut out) });
            match receive_gradient(receiver, &mut reader, None, &Progress::default()).await {
                Ok(Ended::Gradient(_)) => Ok(()),
                Ok(Ended::BeforeFirstByte(receiver)) => receiver.finish().map(drop),
                Err(e) => Err(e),
            }
        });
        (got, out)
    }

    /// What the whole-payload read gives for `wire` into an `out=` of `room` values.
    fn reference(s: &SessionConfig, wire: &[u8], room: usize) -> (Result<()>, Vec<f32>) {
        let mut out = vec![f32::NAN; room];
        let got = s.decode_frames_into(wire, &mut out);
        (got, out)
    }

    /// The same outcome; on success, the same values bit for bit.
    fn assert_same(s: &SessionConfig, wire: &[u8], room: usize, what: &str) {
        let (want, want_out) = reference(s, wire, room);
        for sizes in READS {
            let (got, out) = receive_into(s, wire, room, sizes);
            assert_eq!(got, want, "{what}, reads {sizes:?}");
            if got.is_ok() {
                assert_eq!(bits(&out), bits(&want_out), "{what}, reads {sizes:?}");
            }
        }
    }

    fn header_at(wire: &[u8], at: usize) -> FrameHeader {
        let head: &[u8; HEADER_LEN] = wire[at..at + HEADER_LEN].try_into().unwrap();
        FrameHeader::from_bytes(head)
    }

    /// Where the `index`th frame starts in `wire`, and its payload's length.
    fn frame_at(wire: &[u8], index: usize) -> (usize, usize) {
        let mut at = 0;
        for _ in 0..index {
            at += HEADER_LEN + header_at(wire, at).payload_len as usize;
        }
        (at, header_at(wire, at).payload_len as usize)
    }

    /// Set the header CRC of the frame at `at` to its payload's (a corruption the CRC
    /// does not catch, so that the payload's reader decides).
    fn reseal_crc(wire: &mut [u8], at: usize, len: usize) {
        let mut header = header_at(wire, at);
        header.checksum = crc32fast::hash(&wire[at + HEADER_LEN..at + HEADER_LEN + len]);
        wire[at..at + HEADER_LEN].copy_from_slice(&header.to_bytes());
    }

    #[test]
    fn receives_what_the_whole_read_receives_at_any_size_and_read_size() {
        for s in sessions() {
            for n in [
                0,
                1,
                CHUNK - 1,
                CHUNK,
                CHUNK + 1,
                3 * CHUNK,
                3 * CHUNK + 1,
                5 * CHUNK - 7,
            ] {
                let g = values(n);
                let wire = s.encode_frames(&g).unwrap();
                let (got, out) = receive_into(&s, &wire, n, &[1]);
                assert_eq!(got, Ok(()), "{:?} n={n}", s.layout);
                assert_eq!(bits(&out), bits(&g));
                for room in [n, n.saturating_sub(1), n + 1] {
                    assert_same(
                        &s,
                        &wire,
                        room,
                        &format!("{:?} n={n} room={room}", s.layout),
                    );
                }
            }
        }
    }

    #[test]
    fn a_corrupt_byte_anywhere_ends_as_the_whole_read_ends() {
        for s in sessions() {
            let g = values(4 * CHUNK);
            let wire = s.encode_frames(&g).unwrap();
            let (start, _) = frame_at(&wire, 1);
            let (end, len) = frame_at(&wire, 2);
            let end = end + HEADER_LEN + len;
            for i in (start..end).step_by(3) {
                for reseal in [false, true] {
                    let mut bad = wire.clone();
                    bad[i] ^= 0x40;
                    let (at, len) = if i < frame_at(&wire, 2).0 {
                        frame_at(&wire, 1)
                    } else {
                        frame_at(&wire, 2)
                    };
                    if reseal && i >= at + HEADER_LEN {
                        reseal_crc(&mut bad, at, len);
                    }
                    let what = format!("{:?} sealed={} byte {i} reseal={reseal}", s.layout, s.seal);
                    let (want, want_out) = reference(&s, &bad, g.len());
                    let (got, out) = receive_into(&s, &bad, g.len(), READS[1]);
                    assert_eq!(got, want, "{what}");
                    if got.is_ok() {
                        assert_eq!(bits(&out), bits(&want_out), "{what}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_failed_crc_raises_and_leaves_the_chunks_before_in_out() {
        for s in sessions() {
            let g = values(4 * CHUNK);
            let mut wire = s.encode_frames(&g).unwrap();
            let (at, len) = frame_at(&wire, 2);
            // A value byte: the last value of chunk 2 sits 4 bytes before its suffix.
            let cut = s
                .templates
                .for_payload(len)
                .into_iter()
                .find(|t| t.fits(&wire[at + HEADER_LEN..at + HEADER_LEN + len]))
                .expect("our payloads fit a template")
                .cut();
            let byte = at + HEADER_LEN + cut.head + 4 * cut.values - 1;
            wire[byte] ^= 0x40;
            let (got, out) = receive_into(&s, &wire, g.len(), READS[0]);
            match got {
                Err(GradientStreamError::ChecksumMismatch { chunk_index: 2, .. }) => {}
                other => panic!("{other:?}"),
            }
            assert_eq!(got, reference(&s, &wire, g.len()).0);
            // docs/guides/buffers.md: after a failed receive `out` holds the chunks
            // taken before it, and may hold the failed chunk's bytes as they came (here
            // they do: it was read in place), never a result the call returned.
            assert_eq!(bits(&out[..2 * CHUNK]), bits(&g[..2 * CHUNK]));
            let mut flipped = g[3 * CHUNK - 1].to_bits().to_ne_bytes();
            flipped[3] ^= 0x40;
            assert_eq!(out[3 * CHUNK - 1].to_bits(), u32::from_ne_bytes(flipped));
        }
    }

    #[test]
    fn a_peer_that_stops_anywhere_ends_as_the_whole_read_ends() {
        for s in sessions() {
            let g = values(3 * CHUNK + 5);
            let wire = s.encode_frames(&g).unwrap();
            for cut in frame_at(&wire, 1).0..wire.len() {
                let (want, _) = reference(&s, &wire[..cut], g.len());
                let (got, _) = receive_into(&s, &wire[..cut], g.len(), READS[1]);
                assert_eq!(got, want, "{:?} cut {cut}", s.layout);
            }
        }
    }

    #[test]
    fn frames_out_of_order_and_repeated_end_as_the_whole_read_ends() {
        for s in sessions() {
            let g = values(4 * CHUNK);
            let wire = s.encode_frames(&g).unwrap();
            let frames: Vec<&[u8]> = (0..4)
                .map(|i| {
                    let (at, len) = frame_at(&wire, i);
                    &wire[at..at + HEADER_LEN + len]
                })
                .collect();
            for order in [[0, 2, 1, 3], [3, 2, 1, 0], [0, 1, 1, 3], [1, 0, 3, 2]] {
                let shuffled: Vec<u8> = order.iter().flat_map(|&i| frames[i].to_vec()).collect();
                assert_same(&s, &shuffled, g.len(), &format!("order {order:?}"));
            }
        }
    }

    /// How each of `wire`'s 4 payloads reaches `receiver`, read by `Direct`.
    fn reads_of(receiver: &mut FrameReceiver, wire: Vec<u8>) -> Vec<String> {
        let mut reader = Dribble::new(wire, READS[1]);
        runtime().block_on(async {
            let (mut direct, mut unit) = (Direct::default(), Vec::new());
            let mut clock = Clock::idle(None);
            let progress = Progress::default();
            let mut reads = Vec::new();
            for _ in 0..4 {
                crate::stream::read_unit(
                    &mut reader,
                    &mut unit,
                    HEADER_LEN,
                    &mut clock,
                    (0, None),
                    None,
                )
                .await
                .unwrap();
                assert!(!receiver.feed(&unit).unwrap());
                let read = direct
                    .read_payload(receiver, &mut reader, &mut unit, &mut clock, &progress)
                    .await
                    .unwrap();
                reads.push(match read {
                    Read::Whole => {
                        let want = receiver.want();
                        crate::stream::read_unit(
                            &mut reader,
                            &mut unit,
                            want,
                            &mut clock,
                            (0, None),
                            None,
                        )
                        .await
                        .unwrap();
                        let done = receiver.feed(&unit).unwrap();
                        direct.learn(receiver, &unit);
                        format!("whole {done}")
                    }
                    Read::Placed(done) => format!("placed {done}"),
                    Read::Assembled => "assembled".into(),
                    Read::Ended(got) => format!("ended {got}"),
                });
            }
            reads
        })
    }

    #[test]
    fn values_are_read_in_place_from_the_second_chunk_of_a_length_on() {
        let s = session(Layout::Compact, false);
        let g = values(3 * CHUNK + 1);
        let wire = s.encode_frames(&g).unwrap();
        // The first chunk teaches the template; the last, a value long, is read whole.
        let expected = ["whole false", "placed false", "placed false", "whole true"];
        let mut out = vec![0f32; g.len()];
        {
            // SAFETY: the receiver and its Output are dropped within this block.
            let mut receiver = s.receiver_into(unsafe { OutSlice::of(&mut out) });
            assert_eq!(reads_of(&mut receiver, wire.clone()), expected, "into out=");
        }
        assert_eq!(bits(&out), bits(&g));
        // Into a new array: its vector's room, reserved at the first chunk.
        let mut receiver = s.receiver();
        assert_eq!(reads_of(&mut receiver, wire), expected, "into a new array");
        assert_eq!(bits(&receiver.finish().unwrap().into_vec()), bits(&g));
    }

    /// Receive `wire` into a new array, read `sizes` at a time.
    fn receive_new(s: &SessionConfig, wire: &[u8], sizes: &'static [usize]) -> Result<Vec<u32>> {
        let mut reader = Dribble::new(wire.to_vec(), sizes);
        runtime().block_on(async {
            match receive_gradient(s.receiver(), &mut reader, None, &Progress::default()).await? {
                Ended::Gradient(output) => Ok(bits(&output.into_vec())),
                Ended::BeforeFirstByte(receiver) => receiver.finish().map(|o| bits(&o.into_vec())),
            }
        })
    }

    #[test]
    fn a_new_array_receives_what_decode_frames_gives_whatever_the_bytes() {
        for s in sessions() {
            let g = values(4 * CHUNK + 3);
            let wire = s.encode_frames(&g).unwrap();
            let whole = |wire: &[u8]| s.decode_frames(wire).map(|v| bits(&v));
            for sizes in READS {
                assert_eq!(receive_new(&s, &wire, sizes), Ok(bits(&g)), "{sizes:?}");
            }
            // A corrupt byte in the frames read in place (its CRC resealed or not), and a
            // stream cut anywhere in them.
            let (start, _) = frame_at(&wire, 1);
            let (end, len) = frame_at(&wire, 3);
            for i in (start..end + HEADER_LEN + len).step_by(5) {
                let mut bad = wire.clone();
                bad[i] ^= 0x40;
                let what = format!("{:?} sealed={} byte {i}", s.layout, s.seal);
                assert_eq!(receive_new(&s, &bad, READS[1]), whole(&bad), "{what}");
                let (at, len) = frame_at(
                    &wire,
                    (1..4).rev().find(|&k| frame_at(&wire, k).0 <= i).unwrap(),
                );
                if i >= at + HEADER_LEN {
                    reseal_crc(&mut bad, at, len);
                    assert_eq!(
                        receive_new(&s, &bad, READS[1]),
                        whole(&bad),
                        "{what} resealed"
                    );
                }
                assert_eq!(
                    receive_new(&s, &wire[..i], READS[3]),
                    whole(&wire[..i]),
                    "cut {i}"
                );
            }
        }
    }
}
