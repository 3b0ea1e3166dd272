//! Tensor sets over a tokio byte stream, beside `crate::stream`'s `send_gradient` and
//! `receive_gradient` and with their timeout and progress semantics: every wait is bounded
//! by the timeout (time without a byte moving), and `Progress` counts the tensors' frames
//! and bytes only, not the manifest's (its total_chunks grows tensor by tensor).
//!
//! Uses `encode`, `receive` and `crate::stream`; used by the bindings.

use std::sync::atomic::Ordering;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use super::encode::{
    check_tensors, manifest_frame, set_transfer, tensor_gradient, tensor_meta, tensor_seal,
};
use super::manifest::Entry;
use super::receive::{TensorSet, TensorSetReceiver};
use super::{note, Doing};
use crate::dtype::WireDtype;
use crate::encoder::Gradient;
use crate::error::Result;
use crate::frame::HEADER_LEN;
use crate::seal::TransferId;
use crate::session::SessionConfig;
use crate::stream::{read_unit, send_gradient_on, within, write_frame, Clock, Progress, Waits};

/// Send a tensor set: every name and tensor checked before a byte goes, then the manifest
/// frame, then each tensor as `send_gradient` sends it in a keep_shape, keep_dtype session
/// with `wire_dtype` (each `Gradient` holds its values in its entry's dtype). Returns the
/// number of frames written, the manifest's included. A stall on the manifest is a
/// `Timeout` of 0 of 1 chunks; errors met on a tensor are noted
/// `while sending tensor "name" (k of n) of a tensor set`. Sealed with a fresh random id
/// when the session seals.
pub async fn send_tensors<W: AsyncWrite + Unpin>(
    config: &SessionConfig,
    wire_dtype: Option<WireDtype>,
    tensors: &[(Entry, Gradient<'_>)],
    writer: &mut W,
    waits: impl Into<Waits>,
    progress: &Progress,
) -> Result<usize> {
    let transfer = set_transfer(config)?;
    send_set(
        config, wire_dtype, tensors, transfer, writer, waits, progress,
    )
    .await
}

/// `send_tensors`, every frame sealed with `transfer` (a connection's id for the set):
/// the manifest at position `Manifest`, tensor k at `Tensor(k)`.
pub async fn send_tensors_sealed<W: AsyncWrite + Unpin>(
    config: &SessionConfig,
    wire_dtype: Option<WireDtype>,
    tensors: &[(Entry, Gradient<'_>)],
    transfer: TransferId,
    writer: &mut W,
    waits: impl Into<Waits>,
    progress: &Progress,
) -> Result<usize> {
    send_set(
        config,
        wire_dtype,
        tensors,
        Some(transfer),
        writer,
        waits,
        progress,
    )
    .await
}

async fn send_set<W: AsyncWrite + Unpin>(
    config: &SessionConfig,
    wire_dtype: Option<WireDtype>,
    tensors: &[(Entry, Gradient<'_>)],
    transfer: Option<TransferId>,
    writer: &mut W,
    waits: impl Into<Waits>,
    progress: &Progress,
) -> Result<usize> {
    check_tensors(tensors, Doing::Sending)?;
    let clock = Clock::running(waits);
    let entries: Vec<Entry> = tensors.iter().map(|(entry, _)| entry.clone()).collect();
    let frame = manifest_frame(config, &entries, transfer)?;
    let unseen = Progress::default();
    write_frame(
        writer,
        [&frame, &[], &[], &[]],
        &clock,
        (0, Some(1)),
        &unseen,
    )
    .await?;
    within(&clock, (0, Some(1)), writer.flush()).await?;
    let mut sent = 1;
    let n = tensors.len();
    for (k, (entry, values)) in tensors.iter().enumerate() {
        let meta = tensor_meta(entry, wire_dtype);
        let gradient =
            tensor_gradient(entry, values, wire_dtype, &meta).seal_with(tensor_seal(transfer, k));
        sent += send_gradient_on(config, gradient, writer, &clock, progress)
            .await
            .map_err(|e| e.noted(note(Doing::Sending, &entry.name, k + 1, n)))?;
    }
    Ok(sent)
}

/// Receive one tensor set (the docs/spec/decoding-rules.md receiver rules 1-4); empty when the
/// stream ended
/// before its first byte. Reads nothing past the set's last frame, so sets can follow
/// each other on one connection. Errors met on a tensor, timeouts and I/O included, are
/// noted `while receiving tensor "name" (k of n) of a tensor set`. Seals are held to the
/// session's `seal_check`.
pub async fn receive_tensors<R: AsyncRead + Unpin>(
    config: &SessionConfig,
    reader: &mut R,
    waits: impl Into<Waits>,
    progress: &Progress,
) -> Result<TensorSet> {
    receive_tensor_set(TensorSetReceiver::new(config), reader, waits, progress).await
}

/// `receive_tensors` through a receiver of the caller's: a connection's, made with
/// `TensorSetReceiver::new(config).expect_seal(SealCheck::Exact(id))`.
pub async fn receive_tensor_set<R: AsyncRead + Unpin>(
    mut receiver: TensorSetReceiver,
    reader: &mut R,
    waits: impl Into<Waits>,
    progress: &Progress,
) -> Result<TensorSet> {
    let mut clock = Clock::idle(waits);
    // Holds a header or a payload (at most max_payload_len, checked from the header).
    let mut unit = Vec::with_capacity(HEADER_LEN);
    loop {
        let want = receiver.want();
        let counted = receiver.in_tensors().then_some(progress);
        let read = read_unit(reader, &mut unit, want, &mut clock, receiver.at(), counted).await;
        if !read.map_err(|e| receiver.annotate(e))? {
            return receiver.end_of_stream(unit.len());
        }
        let (frames, announced) = (receiver.frames_received(), receiver.frames_announced());
        let done = receiver.feed(&unit)?;
        let new_total = receiver.frames_announced() - announced;
        progress
            .total_chunks
            .fetch_add(new_total, Ordering::Relaxed);
        progress.add(0, receiver.frames_received() - frames);
        if done {
            return receiver.finish();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::encode::encode_tensors;
    use super::super::manifest::manifest_json;
    use super::super::testing::{gradients, manifest_of, mixed, set_of, unnoted};
    use super::*;
    use crate::dtype::Dtype;
    use crate::error::GradientStreamError;
    use std::time::Duration;
    use tokio::io::duplex;

    fn load(p: &Progress) -> (u64, u64, u64) {
        let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        (get(&p.bytes), get(&p.chunks), get(&p.total_chunks))
    }

    #[tokio::test]
    async fn a_set_crosses_a_duplex_as_encode_tensors_writes_it() {
        let s = SessionConfig::new("d", 3);
        let set = mixed();
        let tensors = gradients(&set);
        let wire = encode_tensors(&s, Some(WireDtype::Float(Dtype::BF16)), &tensors).unwrap();
        let (mut a, mut b) = duplex(1 << 10);
        let (sent_progress, got_progress) = (Progress::default(), Progress::default());
        let (sent, got) = tokio::join!(
            send_tensors(
                &s,
                Some(WireDtype::Float(Dtype::BF16)),
                &tensors,
                &mut a,
                None,
                &sent_progress
            ),
            receive_tensors(&s, &mut b, None, &got_progress)
        );
        let got = got.unwrap();
        let expected = super::super::decode_tensors(&s, &wire).unwrap();
        assert_eq!(got.len(), set.len());
        for ((e1, v1), (e2, v2)) in got.iter().zip(&expected) {
            assert_eq!(
                (e1, v1.owned_bytes(), &v1.shape),
                (e2, v2.owned_bytes(), &v2.shape)
            );
        }
        // Frames and bytes of the tensors only, on both sides.
        let manifest_len = manifest_of(
            &s,
            &manifest_json(&set.iter().map(|(e, _)| e.clone()).collect::<Vec<_>>()),
        )
        .len();
        let frames = (sent.unwrap() - 1) as u64;
        let tensor_bytes = (wire.len() - manifest_len) as u64;
        assert_eq!(load(&sent_progress), (tensor_bytes, frames, frames));
        assert_eq!(load(&got_progress), (tensor_bytes, frames, frames));
    }

    #[tokio::test]
    async fn sets_follow_each_other_and_an_empty_stream_is_an_empty_set() {
        let s = SessionConfig::new("f", 4);
        let one = set_of(&[("x", Dtype::F16, vec![5], 1)]);
        let two = set_of(&[("y", Dtype::F64, vec![], 2), ("z", Dtype::F32, vec![0], 3)]);
        let mut both = encode_tensors(&s, None, &gradients(&one)).unwrap();
        both.extend(encode_tensors(&s, None, &gradients(&two)).unwrap());
        both.extend(encode_tensors(&s, None, &[]).unwrap());
        let (mut a, mut b) = duplex(1 << 16);
        a.write_all(&both).await.unwrap();
        drop(a);
        let p = Progress::default();
        let names = |set: TensorSet| set.into_iter().map(|(e, _)| e.name).collect::<Vec<_>>();
        assert_eq!(
            names(receive_tensors(&s, &mut b, None, &p).await.unwrap()),
            ["x"]
        );
        assert_eq!(
            names(receive_tensors(&s, &mut b, None, &p).await.unwrap()),
            ["y", "z"]
        );
        assert!(receive_tensors(&s, &mut b, None, &p)
            .await
            .unwrap()
            .is_empty());
        assert!(receive_tensors(&s, &mut b, None, &p)
            .await
            .unwrap()
            .is_empty());
    }

    #[tokio::test]
    async fn stalls_time_out_with_where_the_set_was() {
        let s = SessionConfig::new("t", 4);
        let limit = Some(Duration::from_millis(50));
        let manifest = manifest_of(&s, &manifest_json(&[Entry::new("w", Dtype::F32, vec![2])]));
        let timeout = |r: Result<TensorSet>| match r.map(drop).map_err(unnoted) {
            Err((
                GradientStreamError::Timeout {
                    received, total, ..
                },
                notes,
            )) => (received, total, notes),
            other => panic!("expected a timeout, got {other:?}"),
        };
        for (sent, want) in [
            (&manifest[..0], (0, None, vec![])),
            (&manifest[..30], (0, Some(1), vec![])),
            (
                &manifest[..],
                (
                    0,
                    None,
                    vec!["while receiving tensor \"w\" (1 of 1) of a tensor set".to_string()],
                ),
            ),
        ] {
            let (mut a, mut b) = duplex(1 << 16);
            a.write_all(sent).await.unwrap();
            let got = receive_tensors(&s, &mut b, limit, &Progress::default()).await;
            assert_eq!(timeout(got), want);
            drop(a);
        }
        // A sender whose peer never reads: the manifest, or a tensor, larger than the pipe.
        let names: Vec<String> = (0..100)
            .map(|i| format!("{i:03}{}", "x".repeat(100)))
            .collect();
        let raw = [0u8; 4];
        let many: Vec<(Entry, Gradient<'_>)> = names
            .iter()
            .map(|n| {
                (
                    Entry::new(n.as_str(), Dtype::F32, vec![1]),
                    Gradient::new(&raw, Dtype::F32),
                )
            })
            .collect();
        let (mut a, _b) = duplex(1 << 10);
        let err = send_tensors(&s, None, &many, &mut a, limit, &Progress::default()).await;
        assert_eq!(timeout(err.map(|_| Vec::new())), (0, Some(1), vec![]));
        let big = vec![0u8; 1 << 16];
        let one = [(
            Entry::new("big", Dtype::F32, vec![1 << 14]),
            Gradient::new(&big, Dtype::F32),
        )];
        let (mut a, _b) = duplex(1 << 14);
        let err = send_tensors(&s, None, &one, &mut a, limit, &Progress::default()).await;
        let (_, _, notes) = timeout(err.map(|_| Vec::new()));
        assert_eq!(
            notes,
            ["while sending tensor \"big\" (1 of 1) of a tensor set"]
        );
    }

    #[tokio::test]
    async fn a_peer_gone_is_an_io_error_and_names_are_checked_first() {
        let s = SessionConfig::new("g", 4);
        let raw = [0u8; 8];
        let tensors = [
            (
                Entry::new("a", Dtype::F32, vec![2]),
                Gradient::new(&raw, Dtype::F32),
            ),
            (
                Entry::new("a", Dtype::F32, vec![2]),
                Gradient::new(&raw, Dtype::F32),
            ),
        ];
        let (mut a, mut b) = duplex(1 << 16);
        let err = send_tensors(&s, None, &tensors, &mut a, None, &Progress::default()).await;
        assert!(err.unwrap_err().to_string().contains("appears twice"));
        drop(a);
        let mut rest = Vec::new();
        tokio::io::AsyncReadExt::read_to_end(&mut b, &mut rest)
            .await
            .unwrap();
        assert!(rest.is_empty(), "not a byte is sent");
        let (mut a, b) = duplex(1 << 10);
        drop(b);
        let err = send_tensors(&s, None, &tensors[..1], &mut a, None, &Progress::default()).await;
        assert!(matches!(err, Err(GradientStreamError::Io(_))), "{err:?}");
    }
}
