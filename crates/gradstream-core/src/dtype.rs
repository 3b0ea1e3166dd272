//! The value dtypes a gradient can travel in, and the one cast rule both implementations
//! follow (docs/guides/dtypes-and-shapes.md): same dtype keeps every bit; to float64 is exact; to
//! anything
//! else goes through float32, rounding to nearest-even each time; a NaN becomes the
//! target's canonical quiet NaN with its sign kept (so the two implementations agree bit
//! for bit, where hardware and libraries differ on NaN payloads).
//!
//! Uses nothing of the crate; most files use it.

use half::{bf16, f16};

/// A value dtype. bfloat16 travels as the bits of an Arrow UInt16 column tagged with the
/// extension name `gradstream.bfloat16`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Dtype {
    F16,
    BF16,
    #[default]
    F32,
    F64,
}

/// The schema metadata key naming the dtype a receiver hands back, when it is not the
/// column's (after a `wire_dtype` cast).
pub const DTYPE_KEY: &str = "gradient_dtype";
/// The Arrow extension name of the bfloat16 column (over UInt16 storage).
pub const BF16_EXTENSION: &str = "gradstream.bfloat16";

impl Dtype {
    pub const ALL: [Dtype; 4] = [Dtype::F16, Dtype::BF16, Dtype::F32, Dtype::F64];

    /// The numpy name, used on the wire (`gradient_dtype`) and in messages.
    pub fn name(self) -> &'static str {
        match self {
            Self::F16 => "float16",
            Self::BF16 => "bfloat16",
            Self::F32 => "float32",
            Self::F64 => "float64",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|d| d.name() == name)
    }

    /// Bytes a value.
    pub fn width(self) -> usize {
        match self {
            Self::F16 | Self::BF16 => 2,
            Self::F32 => 4,
            Self::F64 => 8,
        }
    }
}

/// What a gradient's values travel as (`wire_dtype`): a value dtype, cast to by the rule,
/// or the int8 wire: cast to float32 by the rule, then quantized blockwise (`crate::int8`,
/// docs/spec/wire-format.md "The int8 wire"), read back as float32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WireDtype {
    Float(Dtype),
    Int8,
}

impl WireDtype {
    /// The name `wire_dtype=` takes and messages use.
    pub fn name(self) -> &'static str {
        match self {
            Self::Float(dtype) => dtype.name(),
            Self::Int8 => "int8",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "int8" => Some(Self::Int8),
            _ => Dtype::from_name(name).map(Self::Float),
        }
    }

    /// The dtype the values are cast to before they are written, which is also the one
    /// a receiver reads them back in (float32 for the int8 wire).
    pub fn carrier(self) -> Dtype {
        match self {
            Self::Float(dtype) => dtype,
            Self::Int8 => Dtype::F32,
        }
    }
}

const F16_NAN: u16 = 0x7e00;
const BF16_NAN: u16 = 0x7fc0;
const F32_NAN: u32 = 0x7fc0_0000;
const F64_NAN: u64 = 0x7ff8_0000_0000_0000;

/// The bytes of `values` as they lie in memory.
pub fn f32_bytes(values: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and every byte pattern is a valid u8.
    unsafe {
        std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
    }
}

/// One value of `dtype` read from its native-endian bytes; every such value (NaN sign
/// included) is exact in f64.
#[cfg(test)]
fn read(dtype: Dtype, b: &[u8]) -> f64 {
    match dtype {
        Dtype::F16 => f16::from_bits(u16::from_ne_bytes([b[0], b[1]])).to_f64(),
        Dtype::BF16 => bf16::from_bits(u16::from_ne_bytes([b[0], b[1]])).to_f64(),
        Dtype::F32 => f64::from(f32::from_ne_bytes([b[0], b[1], b[2], b[3]])),
        Dtype::F64 => f64::from_ne_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]),
    }
}

/// `x` (exact in f64) cast to `to` by the rule, written as native-endian bytes to `out`.
#[cfg(test)]
fn write(to: Dtype, x: f64, out: &mut [u8]) {
    let nan = x.is_nan();
    let negative = x.is_sign_negative();
    match to {
        Dtype::F64 => {
            let bits = if nan {
                F64_NAN | (u64::from(negative) << 63)
            } else {
                x.to_bits()
            };
            out.copy_from_slice(&bits.to_ne_bytes());
        }
        _ => {
            // Through float32: one rounding (exact for float16/bfloat16 sources).
            let f = x as f32;
            let sign16 = u16::from(negative) << 15;
            match to {
                Dtype::F32 => {
                    let bits = if nan {
                        F32_NAN | (u32::from(negative) << 31)
                    } else {
                        f.to_bits()
                    };
                    out.copy_from_slice(&bits.to_ne_bytes());
                }
                Dtype::F16 => {
                    let bits = if nan {
                        F16_NAN | sign16
                    } else {
                        f16::from_f32(f).to_bits()
                    };
                    out.copy_from_slice(&bits.to_ne_bytes());
                }
                Dtype::BF16 => {
                    let bits = if nan {
                        BF16_NAN | sign16
                    } else {
                        bf16::from_f32(f).to_bits()
                    };
                    out.copy_from_slice(&bits.to_ne_bytes());
                }
                Dtype::F64 => unreachable!("handled above"),
            }
        }
    }
}

/// Cast the values in `src` (native-endian bytes of `from`) into `dst` (bytes of `to`,
/// exactly as many values). Same dtype: a copy, every bit kept.
///
/// Every other cast goes through float32, as the rule says, in blocks: the source to
/// float32 (exact, or the one rounding from float64), NaNs made canonical, then float32
/// to the target (exact to float64, rounding to float16/bfloat16). Plain arrays per block
/// let the compiler vectorise each loop.
pub fn convert(src: &[u8], from: Dtype, dst: &mut [u8], to: Dtype) {
    if from == to {
        dst.copy_from_slice(src);
        return;
    }
    const BLOCK: usize = 1024;
    let mut wide = [0f32; BLOCK];
    let mut halves = [0u16; BLOCK];
    for (s, d) in src
        .chunks(from.width() * BLOCK)
        .zip(dst.chunks_mut(to.width() * BLOCK))
    {
        let n = s.len() / from.width();
        let wide = &mut wide[..n];
        to_f32(s, from, wide, &mut halves[..n]);
        from_f32(wide, d, to, &mut halves[..n]);
    }
}

fn canonical_f32(w: &mut f32) {
    if w.is_nan() {
        *w = f32::from_bits(F32_NAN | (w.to_bits() & 0x8000_0000));
    }
}

/// Stage one: `n` values of `from` to float32, NaNs canonical.
fn to_f32(src: &[u8], from: Dtype, wide: &mut [f32], halves: &mut [u16]) {
    match from {
        Dtype::F16 | Dtype::BF16 => {
            for (h, b) in halves.iter_mut().zip(src.chunks_exact(2)) {
                *h = u16::from_ne_bytes([b[0], b[1]]);
            }
            if from == Dtype::BF16 {
                for (w, &h) in wide.iter_mut().zip(halves.iter()) {
                    *w = f32::from_bits(u32::from(h) << 16);
                }
            } else {
                use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
                let as_f16: &[f16] = halves.reinterpret_cast();
                as_f16.convert_to_f32_slice(wide);
            }
        }
        Dtype::F32 => {
            for (w, b) in wide.iter_mut().zip(src.chunks_exact(4)) {
                *w = f32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        Dtype::F64 => {
            for (w, b) in wide.iter_mut().zip(src.chunks_exact(8)) {
                let x = f64::from_ne_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
                // NaN keeps its sign here; its payload is made canonical below.
                *w = if x.is_nan() {
                    f32::from_bits(F32_NAN | (u32::from(x.is_sign_negative()) << 31))
                } else {
                    x as f32
                };
            }
        }
    }
    wide.iter_mut().for_each(canonical_f32);
}

/// Stage two: float32 values (NaNs canonical) to `to`, NaNs canonical there too.
fn from_f32(wide: &[f32], dst: &mut [u8], to: Dtype, halves: &mut [u16]) {
    match to {
        Dtype::F32 => {
            for (b, w) in dst.chunks_exact_mut(4).zip(wide) {
                b.copy_from_slice(&w.to_ne_bytes());
            }
        }
        Dtype::F64 => {
            for (b, &w) in dst.chunks_exact_mut(8).zip(wide) {
                let bits = if w.is_nan() {
                    F64_NAN | (u64::from(w.is_sign_negative()) << 63)
                } else {
                    f64::from(w).to_bits()
                };
                b.copy_from_slice(&bits.to_ne_bytes());
            }
        }
        Dtype::F16 | Dtype::BF16 => {
            let (nan, exponent) = if to == Dtype::F16 {
                use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
                let as_f16: &mut [f16] = halves.reinterpret_cast_mut();
                as_f16.convert_from_f32_slice(wide);
                (F16_NAN, 0x7c00)
            } else {
                for (h, &w) in halves.iter_mut().zip(wide) {
                    *h = bf16::from_f32(w).to_bits();
                }
                (BF16_NAN, 0x7f80)
            };
            for (b, h) in dst.chunks_exact_mut(2).zip(halves.iter_mut()) {
                if *h & 0x7fff > exponent {
                    *h = nan | (*h & 0x8000);
                }
                b.copy_from_slice(&h.to_ne_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cast1(bits: u64, from: Dtype, to: Dtype) -> u64 {
        let src = &bits.to_ne_bytes()[..from.width()];
        let mut dst = [0u8; 8];
        convert(src, from, &mut dst[..to.width()], to);
        u64::from_ne_bytes(dst)
    }

    #[test]
    fn casts_round_to_nearest_even_and_canonicalise_nans() {
        use Dtype::*;
        // 1 + 2^-8 is a tie between bfloat16 1.0 and 1 + 2^-7: even wins (1.0).
        assert_eq!(cast1(0x3f80_8000, F32, BF16), 0x3f80);
        // Just above the tie rounds up.
        assert_eq!(cast1(0x3f80_8001, F32, BF16), 0x3f81);
        // 1 + 3*2^-8 ties to 1 + 2^-6 (even mantissa 2).
        assert_eq!(cast1(0x3f81_8000, F32, BF16), 0x3f82);
        // float16: 65520 rounds to inf, 65504 is the largest finite.
        assert_eq!(cast1(65520f32.to_bits() as u64, F32, F16), 0x7c00);
        assert_eq!(cast1(65504f32.to_bits() as u64, F32, F16), 0x7bff);
        // NaNs of any payload: canonical, sign kept.
        assert_eq!(cast1(0xffc0_1234, F32, BF16), 0xffc0);
        assert_eq!(cast1(0x7f80_0001, F32, F16), 0x7e00);
        assert_eq!(cast1(0x7e01, F16, F32), 0x7fc0_0000);
        assert_eq!(cast1(0xfe01, F16, F64), 0xfff8_0000_0000_0000);
        // Same dtype keeps NaN payloads.
        assert_eq!(cast1(0x7f80_0001, F32, F32), 0x7f80_0001);
        // Widening is exact; float64 to float16 rounds twice (through float32).
        assert_eq!(cast1(0x3f81, BF16, F32), 0x3f81_0000);
        let x = 1.0f64 + 2f64.powi(-11) + 2f64.powi(-30);
        // Direct rounding would go up; via float32 (1 + 2^-11 exactly, a tie) it stays 1.
        assert_eq!(cast1(x.to_bits(), F64, F16), 0x3c00);
        assert_eq!(cast1((-0.0f64).to_bits(), F64, BF16), 0x8000);
    }

    #[test]
    fn the_block_casts_agree_with_the_rule_value_by_value() {
        // Every float16/bfloat16 bit pattern, and float32/float64 patterns around every
        // rounding boundary of the narrow types (all exponents, ties, NaNs, infinities).
        let mut sources: Vec<(Dtype, Vec<u8>)> = [Dtype::F16, Dtype::BF16]
            .into_iter()
            .map(|d| (d, (0..=u16::MAX).flat_map(u16::to_ne_bytes).collect()))
            .collect();
        let f32s: Vec<u32> = (0..=u16::MAX as u32)
            .flat_map(|hi| [0u32, 0x7fff, 0x8000, 0x8001, 0x1000, 0xffff].map(|lo| hi << 16 | lo))
            .collect();
        sources.push((
            Dtype::F32,
            f32s.iter().flat_map(|b| b.to_ne_bytes()).collect(),
        ));
        let f64s: Vec<u64> = f32s
            .iter()
            .flat_map(|&b| {
                let x = f64::from(f32::from_bits(b)).to_bits();
                [
                    x,
                    x ^ 1,
                    x | 0x0000_0000_1000_0000,
                    x ^ 0x0000_0000_0fff_ffff,
                ]
            })
            .collect();
        sources.push((
            Dtype::F64,
            f64s.iter().flat_map(|b| b.to_ne_bytes()).collect(),
        ));
        for (from, src) in &sources {
            for to in Dtype::ALL {
                let n = src.len() / from.width();
                let mut fast = vec![0u8; n * to.width()];
                convert(src, *from, &mut fast, to);
                if *from == to {
                    assert_eq!(&fast, src);
                    continue;
                }
                for (s, f) in src
                    .chunks_exact(from.width())
                    .zip(fast.chunks_exact(to.width()))
                {
                    let mut general = [0u8; 8];
                    write(to, read(*from, s), &mut general[..to.width()]);
                    assert_eq!(f, &general[..to.width()], "{from:?} -> {to:?}: {s:?}");
                }
            }
        }
    }
}
