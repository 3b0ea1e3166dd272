//! The direct read's tests: payloads read in place against whole reads, over every
//! way a stream can hand out its bytes.
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
