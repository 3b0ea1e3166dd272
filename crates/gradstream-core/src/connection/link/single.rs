//! A gradient over a connection of one stream that resumes (docs/spec/protocol.md,
//! "Resume"): the one-stream path itself (frames written from the caller's array, the
//! templates, one reassembly fed in order), kept across a failure of its stream. One
//! stream carries chunks in index order, so what the receiver holds is chunks 0 to k:
//! after a resume the sender goes on from chunk k. The ack's digest covers the headers
//! of the chunks taken, in index order (on one stream, the order received), whatever
//! the passes they came in.
//!
//! Uses `tap` (its kept headers), `resume`, `stream`; used by `link` and `send`.

use super::resume::{mendable, resumed_by_peer, Mended, MAX_RESUMES};
use super::*;
use crate::stream::{receive_some, send_gradient_from};

impl Link {
    /// Send `gradient` (sealed) on the link's one stream and wait for its ack; after a
    /// failure of the stream, or of the wait for the ack, the stream is replaced and the
    /// chunks from the first the receiver lacks are sent again. The chunk count, once
    /// the peer acknowledged the transfer.
    pub(super) async fn send_resumable_one(
        &mut self,
        config: &SessionConfig,
        gradient: Gradient<'_>,
        id: TransferId,
        clock: &Clock,
        progress: &Progress,
    ) -> Result<usize> {
        let total = config.chunk_count(gradient.len())?;
        progress.add_total(total);
        let at = self.peer.address.at();
        // Every header written, in index order: the first `from` are the receiver's.
        let mut headers: Vec<[u8; HEADER_LEN]> = Vec::new();
        let mut from = 0u32;
        let mut resumes = 0;
        loop {
            let (stream, resume) = (&mut self.stream, &mut self.resume);
            let mut tap =
                Tap::new(stream, Digest::new(&id.0)).keeping(std::mem::take(&mut headers));
            // The peer's resume first: what the old stream still takes is no longer read.
            let sent = tokio::select! {
                biased;
                () = Self::resume_arrival(resume) => Err(resumed_by_peer().into()),
                sent = send_gradient_from(config, gradient, &mut tap, (clock, progress), from) => sent,
            };
            // A frame whose header went and whose payload did not all go is not written.
            let cut = tap.inside_payload();
            headers = tap.kept();
            let broken = match sent {
                Ok(_) => match self
                    .ack_or_break(clock, (total as usize, Some(total)))
                    .await
                {
                    Ok(ack) => {
                        return self.confirmed(ack, &digest_of(&id, &headers), total).await;
                    }
                    Err(e) => e,
                },
                Err(e) => e,
            };
            let whole = headers.len() - usize::from(cut);
            let digest = (digest_of(&id, &headers), whole == total as usize);
            let stands = (from as usize, Some(total));
            let theirs = match self
                .mend_send(broken, &mut resumes, digest, total, clock, stands)
                .await?
            {
                Mended::Acknowledged => return Ok(total as usize),
                Mended::Resumed(theirs) => theirs,
            };
            let held = match theirs.held.as_slice() {
                [] => Some(0),
                [(0, end)] => Some(*end),
                _ => None,
            };
            match held.filter(|k| *k as usize <= whole) {
                Some(k) => {
                    let again = whole - k as usize;
                    let resent = &self.resumed.chunks_resent;
                    resent.fetch_add(again as u64, std::sync::atomic::Ordering::Relaxed);
                    headers.truncate(k as usize);
                    from = k;
                }
                None => {
                    let error = GradientStreamError::Protocol {
                        expected: format!(
                            "a resume message holding chunks 0 to k of the {whole} this side \
                             wrote on its one stream"
                        ),
                        seen: format!(
                            "one that holds {:?}",
                            &theirs.held[..theirs.held.len().min(4)]
                        ),
                        peer: at.clone(),
                    };
                    return self.fail(error).await;
                }
            }
        }
    }

    /// Receive one gradient through `receiver` on the link's one stream, which is
    /// replaced after a failure, the reassembly going on with the chunks it holds; what
    /// it ended with, the digest, and the first header.
    pub(super) async fn recv_resumable_one(
        &mut self,
        mut receiver: FrameReceiver,
        id: TransferId,
        waits: Waits,
        progress: &Progress,
    ) -> (Result<Ended>, [u8; 32], Option<[u8; HEADER_LEN]>) {
        let mut clock = Clock::idle(waits);
        let mut headers: Vec<[u8; HEADER_LEN]> = Vec::new();
        let mut first = None;
        let mut begun = false;
        let mut resumes = 0;
        let got = loop {
            let (stream, resume) = (&mut self.stream, &mut self.resume);
            let mut tap =
                Tap::new(stream, Digest::new(&id.0)).keeping(std::mem::take(&mut headers));
            // The peer's resume first: its old stream's end is no close then.
            let step = tokio::select! {
                biased;
                () = Self::resume_arrival(resume) => Err(resumed_by_peer().into()),
                step = receive_some(&mut receiver, &mut tap, &mut clock, progress) => step,
            };
            begun |= tap.seen_any();
            headers = tap.kept();
            first = first.or(tap.first_header());
            let broken = match step {
                Ok(None) => break receiver.finish().map(Ended::Gradient),
                Ok(Some(got)) => break receiver.end_of_stream(got),
                Err(e) => e,
            };
            // A wait out of time before a byte leaves the link as it was (open).
            let idle = !begun && matches!(broken, GradientStreamError::Timeout { .. });
            if idle || !(mendable(&broken) && self.resumable() && resumes < MAX_RESUMES) {
                break Err(broken);
            }
            resumes += 1;
            // A header whose payload did not all come is sent again, whole.
            receiver.forget_pending();
            let held = receiver.held();
            headers.truncate(receiver.received());
            let at = (receiver.received(), receiver.total());
            if let Err(e) = self.resumed_as_receiver(held, &clock, (at, begun)).await {
                break Err(e);
            }
        };
        (got, digest_of(&id, &headers), first)
    }
}
