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

use crate::clock::{within, Clock, Progress};
use crate::error::Result;
use crate::receiver::FrameReceiver;
use crate::rules::Placed;
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
mod tests;
