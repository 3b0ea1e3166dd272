//! Where a received gradient's values go: a vector of our own, or memory the caller
//! lends (`out=` in Python, for training loops that receive into one buffer every step,
//! so no fresh pages are faulted in per gradient).
//!
//! Also `advise_huge_pages`, which makes fresh memory cheap to fault in: every result
//! buffer of our own (vectors of values here, frame streams in `encoder`, `bytes` in the
//! bindings) is advised with it.
//!
//! Uses `dtype`, `error` and `codec::Stores` (the copy into large destinations), and libc
//! (madvise); `codec`'s reader writes through its `ValueSink`, and `rules`,
//! `reassembler` and `receiver` fill its `Output`.

use std::mem::MaybeUninit;
use std::ptr::NonNull;

use crate::codec::Stores;

use crate::dtype::{convert, Dtype};
use crate::error::Result;

/// What a payload's schema says, read before any of its values: the `value` column's
/// dtype and the metadata gradstream reads (each the first entry of its key).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Head {
    /// The dtype of the `value` column's values (float32 for the int8 wire's).
    pub column: Dtype,
    /// The `value` column is the int8 wire's (int8 blocks with a `scale` column).
    pub int8: bool,
    /// `gradient_shape`, unchecked text.
    pub shape: Option<String>,
    /// `gradient_dtype`, checked to name a dtype.
    pub dtype: Option<Dtype>,
    /// `gradstream_tensors`: a tensor set's manifest.
    pub manifest: Option<String>,
    /// `gradstream_seal`, unchecked text (the receiver's `SealRule` reads it).
    pub seal: Option<String>,
}

impl Head {
    /// The dtype the values are handed back in.
    pub fn result(&self) -> Dtype {
        self.dtype.unwrap_or(self.column)
    }

    /// What the `value` column holds, as messages name it: a dtype, or `int8`.
    pub fn column_name(&self) -> &'static str {
        if self.int8 {
            "int8"
        } else {
            self.column.name()
        }
    }
}

/// Takes decoded values in order. The decoders write through this instead of into a
/// `Vec`, so that the same code fills either kind of output.
pub trait ValueSink {
    /// A payload's schema has been read; its values follow. A sink may refuse it (a
    /// dtype its output cannot take): the payload is then not decoded.
    fn begin(&mut self, _head: &Head) -> Result<()> {
        Ok(())
    }
    /// Values of dtype `from` given as their bytes in memory order, at any alignment.
    fn put_raw(&mut self, raw: &[u8], from: Dtype);

    fn put(&mut self, values: &[f32]) {
        self.put_raw(crate::dtype::f32_bytes(values), Dtype::F32);
    }
}

/// Buffers at least this large are advised to use huge pages: numpy's own threshold
/// (it advises every array data allocation of 4 MiB or more).
pub const HUGE_PAGES_FROM: usize = 4 << 20;

/// Ask the kernel to back the `len` bytes at `ptr` (fresh memory about to be written)
/// with transparent huge pages, when they are at least `HUGE_PAGES_FROM`. Each first
/// touch then faults in 2 MiB instead of 4 KiB: numpy asks the same for its arrays, and a
/// 256 MiB copy into a new array runs about 4 x faster for it on the development VM,
/// whose THP setting is `madvise` (under `always` this changes nothing; under `never`,
/// or off Linux, it does nothing). Only advice: the contents are not touched, so any
/// memory may be given, and an error (an old kernel) is ignored.
///
/// With the kernel's `defrag` setting `madvise` (this VM's), an advised fault may compact
/// memory when no huge page is free, which stalls it on a machine short of memory, as
/// numpy's arrays do. `NUMPY_MADVISE_HUGEPAGE=0`, numpy's own switch, turns the advice off
/// for both.
pub fn advise_huge_pages(ptr: *const u8, len: usize) {
    if len < HUGE_PAGES_FROM || !huge_pages_wanted() {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        const PAGE: usize = 4096;
        // Every page the buffer touches, its ends included: madvise wants a page-aligned
        // start, and a large allocation is a mapping of its own (glibc's, from 128 KiB up)
        // whose first page holds the allocator's header. Advising only the pages inside
        // would split that mapping in two, and a later realloc, which moves a mapping with
        // mremap, would fail and copy instead (measured: a growing vector copied, its new
        // half faulted 4 KiB at a time). Advising a neighbour's page is harmless.
        let start = ptr as usize / PAGE * PAGE;
        let end = (ptr as usize).saturating_add(len).div_ceil(PAGE) * PAGE;
        // SAFETY: MADV_HUGEPAGE changes how later faults in the range are served, not its
        // contents or mappings; the range is the pages of memory the caller holds.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = ptr;
}

/// Whether `advise_huge_pages` advises: unless numpy's switch, read once, says not.
fn huge_pages_wanted() -> bool {
    static WANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WANTED
        .get_or_init(|| std::env::var("NUMPY_MADVISE_HUGEPAGE").map_or(true, |v| v.trim() != "0"))
}

/// Advise the allocation of vector `v` (`capacity` values) for huge pages (see
/// `advise_huge_pages`) when it has just grown from `old_capacity`.
fn advise_growth<T>(v: &[T], capacity: usize, old_capacity: usize) {
    if capacity != old_capacity {
        // The whole allocation, so that its mapping keeps one advice (see above).
        let bytes = capacity * std::mem::size_of::<T>();
        advise_huge_pages(v.as_ptr().cast::<u8>(), bytes);
    }
}

/// Append `raw` (values of `from`) to `v` as values of `to`, whose width is T's.
fn append<T: Copy + Default>(v: &mut Vec<T>, raw: &[u8], from: Dtype, to: Dtype) {
    // The copies below size their bytes by `to`: a store of another width would overrun.
    assert_eq!(
        std::mem::size_of::<T>(),
        to.width(),
        "store and dtype disagree"
    );
    let n = raw.len() / from.width();
    let len = v.len();
    let capacity = v.capacity();
    if from == to {
        v.reserve(n);
        advise_growth(v, v.capacity(), capacity);
        // Our vectors are fresh memory: faulted in by these very stores, into cache (see
        // `SessionConfig::write_new_frames`), so they go through it.
        let stores = Stores::Cached;
        let spare = &mut v.spare_capacity_mut()[..n];
        // SAFETY: the n spare values are n * width bytes of T (plain data, no padding),
        // viewed as possibly uninitialised bytes, as they are.
        let spare = unsafe {
            std::slice::from_raw_parts_mut(
                spare.as_mut_ptr().cast::<MaybeUninit<u8>>(),
                n * to.width(),
            )
        };
        stores.copy_uninit(&raw[..n * from.width()], spare);
        // SAFETY: `reserve` made room for `n` more values and the copy filled exactly them
        // (any bit pattern is a float or u16).
        unsafe { v.set_len(len + n) };
        return;
    }
    v.reserve(n);
    advise_growth(v, v.capacity(), capacity);
    v.resize(len + n, T::default());
    // SAFETY: the n values just added are initialised T (plain data without padding).
    let dst = unsafe {
        std::slice::from_raw_parts_mut(v.as_mut_ptr().add(len).cast::<u8>(), n * to.width())
    };
    convert(&raw[..n * from.width()], from, dst, to);
}

impl ValueSink for Vec<f32> {
    fn put_raw(&mut self, raw: &[u8], from: Dtype) {
        append(self, raw, from, Dtype::F32);
    }
}

/// What a caller's array does with the values that arrive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lending {
    /// They replace what it held (`out=`).
    Fill,
    /// They are added to what it holds (`reduce_into=`), each value once, so the result
    /// does not depend on the order the chunks arrive in. A float32 or float64 array adds
    /// in its own dtype (the value cast to it first); a float16 or bfloat16 one adds in
    /// float32 (both widened, the value by the cast rule) and rounds the sum back to its
    /// dtype by the cast rule (`add_into`).
    Sum,
}

/// A caller's array being filled (`out=`) or summed into (`reduce_into=`), values of
/// `dtype`. It counts every value offered, also past its end (those are dropped), so that
/// an overrun is reported with the real count.
#[derive(Debug)]
pub struct OutSlice {
    ptr: NonNull<u8>,
    capacity: usize,
    dtype: Dtype,
    offered: usize,
    lending: Lending,
}

// SAFETY: the creator of an OutSlice promises exclusive access to the memory for its
// lifetime (see `new`); moving that access to another thread is then sound.
unsafe impl Send for OutSlice {}
// SAFETY: a shared reference only reads the counts; writes need `&mut`.
unsafe impl Sync for OutSlice {}

impl OutSlice {
    /// # Safety
    /// `ptr` must point to `capacity` writable values of `dtype` (`capacity * width`
    /// bytes) that nothing else reads or writes, and that stay allocated, until this
    /// OutSlice is dropped.
    pub unsafe fn new(ptr: NonNull<u8>, capacity: usize, dtype: Dtype) -> Self {
        Self {
            ptr,
            capacity,
            dtype,
            offered: 0,
            lending: Lending::Fill,
        }
    }

    /// The same buffer, float32 values, summed into instead of filled (`Lending::Sum`).
    ///
    /// # Safety
    /// As for `new`, with `capacity` float32 values.
    pub unsafe fn summing(ptr: NonNull<u8>, capacity: usize) -> Self {
        Self {
            lending: Lending::Sum,
            // SAFETY: the caller's promise, passed on.
            ..unsafe { Self::new(ptr, capacity, Dtype::F32) }
        }
    }

    /// The same buffer, values of `dtype` (any of the four), summed into (`Lending::Sum`;
    /// how each dtype adds: there).
    ///
    /// # Safety
    /// As for `new`.
    pub unsafe fn summing_as(ptr: NonNull<u8>, capacity: usize, dtype: Dtype) -> Self {
        Self {
            lending: Lending::Sum,
            // SAFETY: the caller's promise, passed on.
            ..unsafe { Self::new(ptr, capacity, dtype) }
        }
    }

    pub fn lending(&self) -> Lending {
        self.lending
    }

    /// # Safety
    /// The OutSlice (and any `Output` holding it) must be dropped before `out`'s borrow
    /// ends: it writes through a pointer the borrow checker does not follow.
    pub unsafe fn of(out: &mut [f32]) -> Self {
        let ptr = NonNull::new(out.as_mut_ptr().cast::<u8>()).unwrap_or(NonNull::dangling());
        // SAFETY: `out` is an exclusive borrow, outliving us by the caller's promise.
        unsafe { Self::new(ptr, out.len(), Dtype::F32) }
    }
}

impl ValueSink for OutSlice {
    fn put_raw(&mut self, raw: &[u8], from: Dtype) {
        let n = raw.len() / from.width();
        let fits = self
            .offered
            .checked_add(n)
            .is_some_and(|end| end <= self.capacity);
        if fits {
            let width = self.dtype.width();
            // SAFETY: offered + n <= capacity keeps the range inside the buffer, which is
            // ours alone (see `new`).
            let dst = unsafe {
                std::slice::from_raw_parts_mut(
                    self.ptr.as_ptr().add(self.offered * width),
                    n * width,
                )
            };
            if self.lending == Lending::Sum {
                add_into(&raw[..n * from.width()], from, dst, self.dtype);
            } else if from == self.dtype {
                // A large `out=` array is written around the caches (see codec::Stores).
                let stores = Stores::for_destination(self.capacity * width);
                stores.copy(&raw[..n * width], dst);
            } else {
                convert(&raw[..n * from.width()], from, dst, self.dtype);
            }
        }
        self.offered += n;
    }
}

/// `dst[i] += src[i]`, `dst` bytes of values of `to`, `src` values of `from`, as
/// `Lending::Sum` says: float32 by `add_f32`; float64 adds in float64 (the values cast to
/// it first); float16 and bfloat16 add in float32 and round back. A block at a time on
/// the stack.
fn add_into(src: &[u8], from: Dtype, dst: &mut [u8], to: Dtype) {
    const BLOCK: usize = 1024;
    match to {
        Dtype::F32 => add_f32(src, from, dst),
        Dtype::F64 => {
            let mut block = [0u8; BLOCK * 8];
            for (src, dst) in src
                .chunks(BLOCK * from.width())
                .zip(dst.chunks_mut(BLOCK * 8))
            {
                let values = &mut block[..dst.len()];
                convert(src, from, values, Dtype::F64);
                for (acc, add) in dst.chunks_exact_mut(8).zip(values.chunks_exact(8)) {
                    let mut a = [0u8; 8];
                    let mut b = [0u8; 8];
                    a.copy_from_slice(acc);
                    b.copy_from_slice(add);
                    let sum = f64::from_ne_bytes(a) + f64::from_ne_bytes(b);
                    acc.copy_from_slice(&sum.to_ne_bytes());
                }
            }
        }
        Dtype::F16 | Dtype::BF16 => {
            let mut wide = [0u8; BLOCK * 4];
            for (src, dst) in src
                .chunks(BLOCK * from.width())
                .zip(dst.chunks_mut(BLOCK * 2))
            {
                let acc = &mut wide[..dst.len() * 2];
                convert(dst, to, acc, Dtype::F32);
                add_f32(src, from, acc);
                convert(acc, Dtype::F32, dst, to);
            }
        }
    }
}

/// `dst[i] += src[i]` in float32, `dst` float32 bytes, `src` values of `from`: float32
/// added as they are, other dtypes converted to float32 first, a block at a time on the
/// stack.
fn add_f32(src: &[u8], from: Dtype, dst: &mut [u8]) {
    fn add(dst: &mut [u8], src: &[u8]) {
        for (acc, add) in dst.chunks_exact_mut(4).zip(src.chunks_exact(4)) {
            let sum = f32::from_ne_bytes([acc[0], acc[1], acc[2], acc[3]])
                + f32::from_ne_bytes([add[0], add[1], add[2], add[3]]);
            acc.copy_from_slice(&sum.to_ne_bytes());
        }
    }
    if from == Dtype::F32 {
        return add(dst, src);
    }
    const BLOCK: usize = 1024;
    let mut block = [0u8; BLOCK * 4];
    for (src, dst) in src
        .chunks(BLOCK * from.width())
        .zip(dst.chunks_mut(BLOCK * 4))
    {
        let values = &mut block[..dst.len()];
        convert(src, from, values, Dtype::F32);
        add(dst, values);
    }
}

/// Values of our own, typed by their width (bfloat16 and float16 as u16 bits).
#[derive(Debug)]
pub enum Store {
    U16(Vec<u16>),
    F32(Vec<f32>),
    F64(Vec<f64>),
}

impl Store {
    fn new(dtype: Dtype) -> Self {
        Self::with_capacity(dtype, 0)
    }

    fn with_capacity(dtype: Dtype, n: usize) -> Self {
        match dtype {
            Dtype::F16 | Dtype::BF16 => Self::U16(Vec::with_capacity(n)),
            Dtype::F32 => Self::F32(Vec::with_capacity(n)),
            Dtype::F64 => Self::F64(Vec::with_capacity(n)),
        }
    }

    fn capacity(&self) -> usize {
        match self {
            Self::U16(v) => v.capacity(),
            Self::F32(v) => v.capacity(),
            Self::F64(v) => v.capacity(),
        }
    }

    fn len(&self) -> usize {
        match self {
            Self::U16(v) => v.len(),
            Self::F32(v) => v.len(),
            Self::F64(v) => v.len(),
        }
    }

    fn bytes(&self) -> &[u8] {
        match self {
            Self::U16(v) => as_bytes(v),
            Self::F32(v) => as_bytes(v),
            Self::F64(v) => as_bytes(v),
        }
    }
}

fn as_bytes<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: u16, f32 and f64 have no padding; every byte is initialised.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// Where the values go: a vector of ours, or the caller's memory.
#[derive(Debug)]
enum Values {
    Owned(Store),
    Lent(OutSlice),
}

/// The values of one gradient (ours, or in the caller's memory), their dtype, and the
/// shape the sender kept, once the gradient is complete.
#[derive(Debug)]
pub struct Output {
    values: Values,
    dtype: Dtype,
    /// Set by the reassembly when the payloads carried `gradient_shape`.
    pub shape: Option<Vec<usize>>,
    /// Set by the reassembly when the payloads carried `gradstream_tensors`.
    pub manifest: Option<String>,
}

impl Default for Output {
    fn default() -> Self {
        Self::of(Dtype::F32)
    }
}

impl Output {
    /// An empty output of our own for values of `dtype`.
    pub fn of(dtype: Dtype) -> Self {
        Self {
            values: Values::Owned(Store::new(dtype)),
            dtype,
            shape: None,
            manifest: None,
        }
    }

    /// Values written into the caller's buffer.
    pub fn lent(out: OutSlice) -> Self {
        Self {
            dtype: out.dtype,
            values: Values::Lent(out),
            shape: None,
            manifest: None,
        }
    }

    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Take values of `dtype` from now on. An output of our own that holds no values yet
    /// changes type; a lent buffer cannot (Err: its dtype).
    pub fn set_dtype(&mut self, dtype: Dtype) -> std::result::Result<(), Dtype> {
        if dtype == self.dtype {
            return Ok(());
        }
        match &mut self.values {
            Values::Owned(store) if store.len() == 0 => {
                // Keep the room reserved for the gradient, in bytes.
                let room = store.capacity() * self.dtype.width() / dtype.width();
                *store = Store::with_capacity(dtype, 0);
                self.dtype = dtype;
                self.reserve(room);
                Ok(())
            }
            Values::Owned(_) => Err(self.dtype),
            // A sum takes any dtype, added in float32.
            Values::Lent(out) if out.lending == Lending::Sum => Ok(()),
            Values::Lent(out) => Err(out.dtype),
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

    /// What a lent buffer does with the values (None: values of our own).
    pub fn lending(&self) -> Option<Lending> {
        match &self.values {
            Values::Owned(_) => None,
            Values::Lent(o) => Some(o.lending),
        }
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
            Values::Owned(Store::U16(v)) => v.truncate(len),
            Values::Owned(Store::F32(v)) => v.truncate(len),
            Values::Owned(Store::F64(v)) => v.truncate(len),
            Values::Lent(o) => o.offered = o.offered.min(len),
        }
    }

    /// Make room for `n` more values, if the allocator gives it: a guess, so a refusal
    /// (a peer's header promising gigabytes) is ignored rather than aborting.
    pub fn reserve(&mut self, n: usize) {
        fn grow<T>(v: &mut Vec<T>, n: usize) {
            let capacity = v.capacity();
            if v.try_reserve(n).is_ok() {
                advise_growth(v, v.capacity(), capacity);
            }
        }
        match &mut self.values {
            Values::Owned(Store::U16(v)) => grow(v, n),
            Values::Owned(Store::F32(v)) => grow(v, n),
            Values::Owned(Store::F64(v)) => grow(v, n),
            Values::Lent(_) => {}
        }
    }

    /// The bytes of values of our own (empty for a lent buffer).
    pub fn owned_bytes(&self) -> &[u8] {
        match &self.values {
            Values::Owned(store) => store.bytes(),
            Values::Lent(_) => &[],
        }
    }

    /// The values of our own (None for a lent buffer, whose values are where the caller
    /// lent).
    pub fn into_store(self) -> Option<Store> {
        match self.values {
            Values::Owned(store) => Some(store),
            Values::Lent(_) => None,
        }
    }

    /// The owned values as float32 (empty for a lent buffer; other dtypes are cast).
    pub fn into_vec(self) -> Vec<f32> {
        let dtype = self.dtype;
        match self.values {
            Values::Owned(Store::F32(v)) => v,
            Values::Owned(store) => {
                let mut v = Vec::new();
                v.put_raw(store.bytes(), dtype);
                v
            }
            Values::Lent(_) => Vec::new(),
        }
    }
}

impl ValueSink for Output {
    fn put_raw(&mut self, raw: &[u8], from: Dtype) {
        let to = self.dtype;
        match &mut self.values {
            Values::Owned(Store::U16(v)) => append(v, raw, from, to),
            Values::Owned(Store::F32(v)) => append(v, raw, from, to),
            Values::Owned(Store::F64(v)) => append(v, raw, from, to),
            Values::Lent(o) => o.put_raw(raw, from),
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
            out.put_raw(&[3.0f32, 4.0].map(f32::to_ne_bytes).concat(), Dtype::F32);
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
    fn a_summing_buffer_of_another_dtype_adds_in_its_own_way() {
        // float64: the values cast to float64, added there.
        let mut wide = [1.0f64, 1e300, -0.5];
        let ptr = NonNull::new(wide.as_mut_ptr().cast::<u8>()).unwrap();
        {
            // SAFETY: `out` is dropped at the end of this block, before `wide` is read.
            let mut out = Output::lent(unsafe { OutSlice::summing_as(ptr, 3, Dtype::F64) });
            assert!(out.set_dtype(Dtype::F32).is_ok());
            out.put(&[0.1, 1.0, 0.25]);
        }
        assert_eq!(wide, [1.0 + f64::from(0.1f32), 1e300 + 1.0, -0.25]);
        // bfloat16: both widened to float32, added, rounded back to nearest even.
        let start = [1.0f32, 256.0, -2.0].map(half::bf16::from_f32);
        let mut narrow = start.map(half::bf16::to_bits);
        let ptr = NonNull::new(narrow.as_mut_ptr().cast::<u8>()).unwrap();
        {
            // SAFETY: as above, for `narrow`.
            let mut out = Output::lent(unsafe { OutSlice::summing_as(ptr, 3, Dtype::BF16) });
            out.put(&[2.0f32.powi(-8), 1.0, 0.5]);
        }
        let expected = [
            half::bf16::from_f32(1.0 + 2.0f32.powi(-8)), // a tie: stays 1.0
            half::bf16::from_f32(257.0),                 // 257 rounds to 256 (even)
            half::bf16::from_f32(-1.5),
        ];
        assert_eq!(narrow, expected.map(half::bf16::to_bits));
        assert_eq!(narrow[..2], start.map(half::bf16::to_bits)[..2]);
    }

    #[test]
    fn a_summing_buffer_adds_each_value_once_in_float32_whatever_its_dtype() {
        let start = [1.0f32, -2.5, 1e30, 0.1];
        let mut acc = start;
        let ptr = NonNull::new(acc.as_mut_ptr().cast::<u8>()).unwrap();
        {
            // SAFETY: `out` is dropped at the end of this block, before `acc` is read.
            let mut out = Output::lent(unsafe { OutSlice::summing(ptr, 4) });
            assert_eq!(out.lending(), Some(Lending::Sum));
            // Any dtype is taken (a bfloat16 wire adds into float32).
            assert!(out.set_dtype(Dtype::BF16).is_ok());
            out.put(&[0.5, 0.5]);
            let bf16 = [half::bf16::from_f32(3.0), half::bf16::from_f32(1e30)];
            let raw: Vec<u8> = bf16
                .iter()
                .flat_map(|v| v.to_bits().to_ne_bytes())
                .collect();
            out.put_raw(&raw, Dtype::BF16);
            out.put(&[7.0]); // runs over: dropped, counted
            assert_eq!((out.len(), out.limit()), (5, Some(4)));
        }
        let expected = [
            start[0] + 0.5,
            start[1] + 0.5,
            start[2] + 3.0,
            start[3] + half::bf16::from_f32(1e30).to_f32(),
        ];
        assert_eq!(acc.map(f32::to_bits), expected.map(f32::to_bits));
    }

    #[test]
    fn a_vector_of_ours_grows_past_the_huge_page_size_keeping_every_value() {
        // 3 MiB reserved, then 6 MiB of values put in odd pieces: the vector grows (and is
        // advised) past HUGE_PAGES_FROM; every value lands, in order, bit for bit.
        let values: Vec<f32> = (0..(6 << 20) / 4)
            .map(|i: u32| f32::from_bits(i.wrapping_mul(2_654_435_761)))
            .collect();
        let mut out = Output::default();
        out.reserve((3 << 20) / 4);
        for piece in values.chunks(65_537) {
            out.put(piece);
        }
        assert_eq!(out.len(), values.len());
        assert_eq!(out.owned_bytes(), crate::dtype::f32_bytes(&values));
        // Advice changes no byte, whatever the range's alignment.
        let mut bytes = vec![0x5au8; HUGE_PAGES_FROM + 4097];
        advise_huge_pages(bytes[3..].as_ptr(), bytes.len() - 3);
        bytes[HUGE_PAGES_FROM] = 1;
        assert_eq!(
            bytes.iter().filter(|&&b| b == 0x5a).count(),
            bytes.len() - 1
        );
    }

    #[test]
    fn raw_bytes_at_any_alignment_land_as_values() {
        let values = [1.5f32, -0.0, f32::from_bits(0x7fc0_0001)];
        let mut bytes = vec![0u8];
        bytes.extend(values.iter().flat_map(|v| v.to_ne_bytes()));
        let mut v: Vec<f32> = vec![9.0];
        v.put_raw(&bytes[1..], Dtype::F32);
        let bits: Vec<u32> = v.iter().map(|x| x.to_bits()).collect();
        assert_eq!(bits, [9.0f32, 1.5, -0.0, values[2]].map(f32::to_bits));
    }
}
