//! Transfers tried with the bytes at hand, before any tokio task: the bindings' fast path
//! for small gradients (docs/performance.md). `receive_at_hand` runs a `FrameReceiver`
//! over bytes a socket already holds (peeked, not yet consumed) and says whether they hold
//! a whole gradient, and how many of them the gradient took; `send_rest` finishes on tokio
//! a send whose first bytes went out at once. Both follow the receiver's and the sender's
//! rules exactly: the same decoder, the same limits, the same errors and progress counts.
//!
//! Uses `receiver`, `output`, `error` and (feature `tokio`) `stream`; used by the bindings.

use crate::error::Result;
use crate::output::Output;
use crate::receiver::FrameReceiver;
#[cfg(feature = "tokio")]
use crate::stream::Progress;

/// What a transfer counted on its way, to add to the caller's `Progress` once the bytes
/// are really taken (a receive that is not taken here is counted by the path that takes
/// it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counted {
    pub bytes: usize,
    pub chunks: u64,
    /// `total_chunks`, once a header said it.
    pub total: Option<u32>,
}

#[cfg(feature = "tokio")]
impl Counted {
    pub fn add_to(&self, progress: &Progress) {
        if let Some(total) = self.total {
            progress.add_total(total);
        }
        progress.add(self.bytes, self.chunks);
    }
}

/// What the bytes at hand gave.
#[derive(Debug)]
pub enum AtHand {
    /// The receive ended within them: its first `counted.bytes` are what a stream
    /// receiver would have read (the unit it refused included), and `got` the gradient
    /// or the decoding rules' refusal.
    Taken {
        counted: Counted,
        got: Result<Output>,
    },
    /// The gradient goes on past the bytes at hand (or none are at hand).
    Short,
}

/// Feed `receiver` the whole units (headers, payloads) at the start of `bytes`, as the
/// stream receiver feeds what it reads, until the gradient is complete, refused, or the
/// bytes run short.
pub fn receive_at_hand(mut receiver: FrameReceiver, bytes: &[u8]) -> AtHand {
    let mut counted = Counted::default();
    loop {
        let want = receiver.want();
        let Some(unit) = bytes.get(counted.bytes..counted.bytes + want) else {
            return AtHand::Short;
        };
        counted.bytes += want;
        let (before, known) = (receiver.received(), receiver.total().is_some());
        let done = match receiver.feed(unit) {
            Ok(done) => done,
            Err(error) => {
                return AtHand::Taken {
                    counted,
                    got: Err(error),
                }
            }
        };
        if let (false, Some(total)) = (known, receiver.total()) {
            counted.total = Some(total);
        }
        counted.chunks += (receiver.received() - before) as u64;
        if done {
            let got = receiver.finish();
            return AtHand::Taken { counted, got };
        }
    }
}

/// Finish sending `frames` (one gradient's, frame `k` ending at byte `ends[k]`) of which
/// the first `sent` bytes are already written and counted: the rest under `waits` (the
/// deadline running from now), counted in `progress` as the stream sender counts; the
/// number of chunks.
#[cfg(feature = "tokio")]
pub async fn send_rest<W: tokio::io::AsyncWrite + Unpin>(
    writer: &mut W,
    frames: &[u8],
    ends: &[usize],
    sent: usize,
    waits: crate::stream::Waits,
    progress: &Progress,
) -> Result<usize> {
    use tokio::io::AsyncWriteExt;

    let clock = crate::stream::Clock::running(waits);
    let total = u32::try_from(ends.len()).ok();
    let done = |at: usize| ends.iter().take_while(|&&end| end <= at).count();
    let mut at = sent;
    while let Some(rest) = frames.get(at..).filter(|rest| !rest.is_empty()) {
        let chunks = done(at);
        let n = crate::stream::within(&clock, (chunks, total), writer.write(rest)).await?;
        if n == 0 {
            return Err(std::io::Error::from(std::io::ErrorKind::WriteZero).into());
        }
        at += n;
        progress.add(n, (done(at) - chunks) as u64);
    }
    crate::stream::within(&clock, (ends.len(), total), writer.flush()).await?;
    Ok(ends.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::HEADER_LEN;
    use crate::session::SessionConfig;

    fn gradient(n: usize) -> Vec<f32> {
        (0..n).map(|i| (i as f32 * 0.37).cos()).collect()
    }

    #[test]
    fn a_whole_gradient_is_taken_and_nothing_after_it() {
        let s = SessionConfig::new("t", 7);
        for n in [0, 1, 7, 8, 30] {
            let wire = s.encode_frames(&gradient(n)).unwrap();
            let mut both = wire.clone();
            both.extend(s.encode_frames(&gradient(3)).unwrap());
            match receive_at_hand(s.receiver(), &both) {
                AtHand::Taken {
                    counted,
                    got: Ok(values),
                } => {
                    assert_eq!(values.into_vec(), gradient(n));
                    let total = n.div_ceil(7).max(1) as u32;
                    assert_eq!(counted.total, Some(total));
                    assert_eq!(counted.chunks, u64::from(total));
                    assert_eq!(counted.bytes, wire.len());
                }
                other => panic!("{n} values: {other:?}"),
            }
        }
    }

    #[test]
    fn every_cut_short_of_the_end_is_short() {
        let s = SessionConfig::new("t", 4);
        let wire = s.encode_frames(&gradient(10)).unwrap();
        for cut in 0..wire.len() {
            let got = receive_at_hand(s.receiver(), &wire[..cut]);
            assert!(matches!(got, AtHand::Short), "cut {cut}: {got:?}");
        }
    }

    #[test]
    fn a_refusal_says_what_a_stream_receiver_would_have_read() {
        let mut s = SessionConfig::new("t", 4);
        s.limits.max_payload_len = 100;
        let big = SessionConfig::new("t", 4)
            .encode_frames(&gradient(4))
            .unwrap();
        match receive_at_hand(s.receiver(), &big[..HEADER_LEN]) {
            AtHand::Taken {
                counted,
                got: Err(error),
            } => {
                assert_eq!(counted.bytes, HEADER_LEN);
                assert!(error.to_string().contains("max_payload_len"), "{error}");
                assert_eq!(counted.chunks, 0);
            }
            other => panic!("{other:?}"),
        }
        // A damaged payload: refused after its header and payload, as read.
        let s = SessionConfig::new("t", 4);
        let mut wire = s.encode_frames(&gradient(4)).unwrap();
        let last = wire.len() - 1;
        wire[last] ^= 1;
        match receive_at_hand(s.receiver(), &wire) {
            AtHand::Taken {
                counted,
                got: Err(_),
            } => assert_eq!(counted.bytes, wire.len()),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn send_rest_writes_what_is_left_and_counts_frames() {
        use tokio::io::AsyncReadExt;
        let s = SessionConfig::new("t", 3);
        let g = gradient(10);
        let plan = s.plan_frames(&g[..]).unwrap();
        let wire = s.encode_frames(&g).unwrap();
        let mut ends = Vec::new();
        let mut end = 0;
        for (_, _, len) in plan.chunks() {
            end += HEADER_LEN + len as usize;
            ends.push(end);
        }
        for sent in [0, 1, ends[0], ends[0] + 5, wire.len() - 1] {
            let (mut a, mut b) = tokio::io::duplex(1 << 16);
            let progress = Progress::default();
            let n = send_rest(&mut a, &wire, &ends, sent, None.into(), &progress)
                .await
                .unwrap();
            drop(a);
            let mut got = Vec::new();
            b.read_to_end(&mut got).await.unwrap();
            assert_eq!((n, &got[..]), (4, &wire[sent..]));
            let chunks = progress.chunks.load(std::sync::atomic::Ordering::Relaxed);
            let before = ends.iter().filter(|&&e| e <= sent).count() as u64;
            assert_eq!(chunks, 4 - before, "sent {sent}");
        }
    }
}
