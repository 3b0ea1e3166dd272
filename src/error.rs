//! The one error type of the core. Variants and wording follow ipfrs-transport 0.2.0's
//! `GradientStreamError`; `Frame` is ours, for the hostile or malformed input the original
//! accepts silently. `src/py/errors.rs` maps each variant onto a Python class.

/// Everything that can go wrong encoding or decoding a gradient.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GradientStreamError {
    /// A payload is not an Arrow IPC file with a Float32 `value` column.
    #[error("Arrow IPC error{}: {detail}", on_chunk(*chunk_index))]
    ArrowIpc {
        detail: String,
        chunk_index: Option<u32>,
    },

    /// A chunk's CRC-32 differs from the one its header carries.
    #[error(
        "Checksum mismatch on chunk {chunk_index}: expected {expected:#010x}, got {actual:#010x}"
    )]
    ChecksumMismatch {
        chunk_index: u32,
        expected: u32,
        actual: u32,
    },

    /// Fewer chunks than `total_chunks` (or more, in the original's own check).
    #[error("Incomplete chunk stream: received {received} of {total} chunks")]
    IncompleteStream { received: usize, total: usize },

    /// Malformed framing: truncation, limits, headers that contradict each other.
    /// `offset` is the byte offset of the header concerned, when there is a byte stream.
    #[error("{detail}")]
    Frame {
        detail: String,
        chunk_index: Option<u32>,
        offset: Option<u64>,
    },

    /// The gradient's size is not that of the caller's output buffer (`out=`).
    /// `chunk_index` names the chunk that ran over; None when the gradient came up short.
    #[error("{}", size_message(*expected, *received, *chunk_index))]
    GradientSize {
        expected: usize,
        received: usize,
        chunk_index: Option<u32>,
    },

    /// The gradient's dtype is not that of the caller's output buffer (`out=`).
    #[error("the gradient is {received}; out= is {expected}")]
    GradientDtype {
        expected: &'static str,
        received: &'static str,
        chunk_index: Option<u32>,
    },

    /// The connection failed; `errno` is the OS error code when there is one.
    #[error("I/O error: {message}")]
    Io { errno: Option<i32>, message: String },

    /// No byte moved for `timeout` seconds.
    #[error("no progress for {timeout} s (after {received} chunks)")]
    Timeout {
        timeout: f64,
        received: usize,
        total: Option<u32>,
    },
}

impl From<std::io::Error> for GradientStreamError {
    fn from(e: std::io::Error) -> Self {
        Self::Io {
            errno: e.raw_os_error(),
            message: e.to_string(),
        }
    }
}

fn size_message(expected: usize, received: usize, chunk_index: Option<u32>) -> String {
    match chunk_index {
        None => {
            format!("the gradient holds {received} values; out= has room for exactly {expected}")
        }
        Some(i) => format!(
            "the gradient runs over the {expected} values out= has room for: {received} values \
             by chunk {i}"
        ),
    }
}

fn on_chunk(chunk_index: Option<u32>) -> String {
    chunk_index.map_or_else(String::new, |i| format!(" on chunk {i}"))
}

impl GradientStreamError {
    pub(crate) fn frame(detail: impl Into<String>, chunk_index: Option<u32>) -> Self {
        Self::Frame {
            detail: detail.into(),
            chunk_index,
            offset: None,
        }
    }

    pub(crate) fn arrow(detail: impl Into<String>) -> Self {
        Self::ArrowIpc {
            detail: detail.into(),
            chunk_index: None,
        }
    }

    /// Attach the byte offset of the frame header an error is about.
    pub(crate) fn at_offset(mut self, at: u64) -> Self {
        if let Self::Frame { offset, .. } = &mut self {
            *offset = Some(at);
        }
        self
    }

    /// Attach the chunk index to an Arrow error raised while decoding one chunk's payload.
    pub(crate) fn in_chunk(mut self, index: u32) -> Self {
        if let Self::ArrowIpc { chunk_index, .. } = &mut self {
            *chunk_index = Some(index);
        }
        self
    }
}

pub type Result<T> = std::result::Result<T, GradientStreamError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_keep_the_original_wording() {
        let e = GradientStreamError::ChecksumMismatch {
            chunk_index: 3,
            expected: 0x1a2b_3c4d,
            actual: 0,
        };
        assert_eq!(
            e.to_string(),
            "Checksum mismatch on chunk 3: expected 0x1a2b3c4d, got 0x00000000"
        );
        let e = GradientStreamError::IncompleteStream {
            received: 2,
            total: 5,
        };
        assert_eq!(
            e.to_string(),
            "Incomplete chunk stream: received 2 of 5 chunks"
        );
        assert_eq!(
            GradientStreamError::arrow("bad").in_chunk(4).to_string(),
            "Arrow IPC error on chunk 4: bad"
        );
        assert_eq!(
            GradientStreamError::arrow("bad").to_string(),
            "Arrow IPC error: bad"
        );
    }
}
