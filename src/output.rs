//! Where a received gradient's values go: a vector of our own, or memory the caller
//! lends (`out=` in Python, for training loops that receive into one buffer every step,
//! so no fresh pages are faulted in per gradient).

use std::ptr::NonNull;

/// Takes decoded values in order. The decoders write through this instead of into a
/// `Vec`, so that the same code fills either kind of output.
pub trait ValueSink {
    fn put(&mut self, values: &[f32]);
    /// Values given as their bytes in memory order, at any alignment.
    fn put_raw(&mut self, raw: &[u8]);
}

impl ValueSink for Vec<f32> {
    fn put(&mut self, values: &[f32]) {
        self.extend_from_slice(values);
    }

    fn put_raw(&mut self, raw: &[u8]) {
        let n = raw.len() / 4;
        self.reserve(n);
        let len = self.len();
        // SAFETY: `reserve` made room for `n` more values; the copy fills exactly them
        // (4 * n bytes, any bit pattern is an f32) before the length covers them.
        unsafe {
            std::ptr::copy_nonoverlapping(
                raw.as_ptr(),
                self.as_mut_ptr().add(len).cast::<u8>(),
                4 * n,
            );
            self.set_len(len + n);
        }
    }
}

/// A caller's `[f32]` being filled. It counts every value offered, also past its end
/// (those are dropped), so that an overrun is reported with the real count.
#[derive(Debug)]
pub struct OutSlice {
    ptr: NonNull<f32>,
    capacity: usize,
    offered: usize,
}

// SAFETY: the creator of an OutSlice promises exclusive access to the memory for its
// lifetime (see `new`); moving that access to another thread is then sound.
unsafe impl Send for OutSlice {}
// SAFETY: a shared reference only reads the two counts; writes need `&mut`.
unsafe impl Sync for OutSlice {}

impl OutSlice {
    /// # Safety
    /// `ptr` must point to `capacity` writable, aligned f32 values that nothing else reads
    /// or writes, and that stay allocated, until this OutSlice is dropped.
    pub unsafe fn new(ptr: NonNull<f32>, capacity: usize) -> Self {
        Self {
            ptr,
            capacity,
            offered: 0,
        }
    }

    /// # Safety
    /// The OutSlice (and any `Output` holding it) must be dropped before `out`'s borrow
    /// ends: it writes through a pointer the borrow checker does not follow.
    pub unsafe fn of(out: &mut [f32]) -> Self {
        let ptr = NonNull::new(out.as_mut_ptr()).unwrap_or(NonNull::dangling());
        // SAFETY: `out` is an exclusive borrow, outliving us by the caller's promise.
        unsafe { Self::new(ptr, out.len()) }
    }

    /// The whole buffer as a slice.
    ///
    /// # Safety
    /// As for `new`: the memory is this OutSlice's alone while the slice is used.
    pub unsafe fn as_mut_slice(&mut self) -> &mut [f32] {
        // SAFETY: by the contract of `new` and of this function.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.capacity) }
    }

    fn room(&self, n: usize) -> Option<*mut u8> {
        let end = self.offered.checked_add(n)?;
        // SAFETY (of the add): offered < end <= capacity keeps it inside the buffer.
        (end <= self.capacity).then(|| unsafe { self.ptr.as_ptr().add(self.offered).cast() })
    }
}

impl ValueSink for OutSlice {
    fn put(&mut self, values: &[f32]) {
        if let Some(at) = self.room(values.len()) {
            // SAFETY: `room` checked that the values fit; the memory is ours (see `new`).
            unsafe {
                std::ptr::copy_nonoverlapping(values.as_ptr().cast::<u8>(), at, 4 * values.len())
            };
        }
        self.offered += values.len();
    }

    fn put_raw(&mut self, raw: &[u8]) {
        let n = raw.len() / 4;
        if let Some(at) = self.room(n) {
            // SAFETY: as in `put`.
            unsafe { std::ptr::copy_nonoverlapping(raw.as_ptr(), at, 4 * n) };
        }
        self.offered += n;
    }
}

/// Where the values go: a vector of ours, or the caller's memory.
#[derive(Debug)]
enum Values {
    Owned(Vec<f32>),
    Lent(OutSlice),
}

/// The values of one gradient (ours, or in the caller's memory), and the shape the sender
/// kept, once the gradient is complete.
#[derive(Debug)]
pub struct Output {
    values: Values,
    /// Set by the reassembly when the payloads carried `gradient_shape`.
    pub shape: Option<Vec<usize>>,
}

impl Default for Output {
    fn default() -> Self {
        Self {
            values: Values::Owned(Vec::new()),
            shape: None,
        }
    }
}

impl Output {
    /// Values of our own, in `shape` when the sender kept one.
    pub fn owned(values: Vec<f32>, shape: Option<Vec<usize>>) -> Self {
        Self {
            values: Values::Owned(values),
            shape,
        }
    }

    /// Values written into the caller's buffer.
    pub fn lent(out: OutSlice) -> Self {
        Self {
            values: Values::Lent(out),
            shape: None,
        }
    }

    /// Values put so far (for a lent buffer, also those that did not fit).
    pub fn len(&self) -> usize {
        match &self.values {
            Values::Owned(v) => v.len(),
            Values::Lent(o) => o.offered,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The most values this output takes: the caller's buffer size.
    pub fn limit(&self) -> Option<usize> {
        match &self.values {
            Values::Owned(_) => None,
            Values::Lent(o) => Some(o.capacity),
        }
    }

    /// Forget the values put after the first `len` (a frame that failed).
    pub fn truncate(&mut self, len: usize) {
        match &mut self.values {
            Values::Owned(v) => v.truncate(len),
            Values::Lent(o) => o.offered = o.offered.min(len),
        }
    }

    pub fn reserve(&mut self, n: usize) {
        if let Values::Owned(v) = &mut self.values {
            v.reserve(n);
        }
    }

    /// The owned values (empty for a lent buffer, whose values are where the caller lent).
    pub fn into_vec(self) -> Vec<f32> {
        match self.values {
            Values::Owned(v) => v,
            Values::Lent(_) => Vec::new(),
        }
    }
}

impl ValueSink for Output {
    fn put(&mut self, values: &[f32]) {
        match &mut self.values {
            Values::Owned(v) => v.put(values),
            Values::Lent(o) => o.put(values),
        }
    }

    fn put_raw(&mut self, raw: &[u8]) {
        match &mut self.values {
            Values::Owned(v) => v.put_raw(raw),
            Values::Lent(o) => o.put_raw(raw),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lent_buffer_fills_in_order_and_counts_what_runs_over() {
        let mut buf = [0f32; 5];
        {
            // SAFETY: `out` is dropped at the end of this block, before `buf` is read.
            let mut out = Output::lent(unsafe { OutSlice::of(&mut buf) });
            out.put(&[1.0, 2.0]);
            out.put_raw(&[3.0f32, 4.0].map(f32::to_ne_bytes).concat());
            assert_eq!(out.len(), 4);
            out.put(&[5.0, 6.0]); // runs over: dropped, counted
            assert_eq!(out.len(), 6);
            out.truncate(4);
            out.put(&[5.0]);
            assert_eq!((out.len(), out.limit()), (5, Some(5)));
        }
        assert_eq!(buf, [1.0, 2.0, 3.0, 4.0, 5.0]);
    }

    #[test]
    fn raw_bytes_at_any_alignment_land_as_values() {
        let values = [1.5f32, -0.0, f32::from_bits(0x7fc0_0001)];
        let mut bytes = vec![0u8];
        bytes.extend(values.iter().flat_map(|v| v.to_ne_bytes()));
        let mut v: Vec<f32> = vec![9.0];
        v.put_raw(&bytes[1..]);
        let bits: Vec<u32> = v.iter().map(|x| x.to_bits()).collect();
        assert_eq!(bits, [9.0f32, 1.5, -0.0, values[2]].map(f32::to_bits));
    }
}
