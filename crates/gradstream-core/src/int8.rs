//! The int8 wire (`wire_dtype="int8"`, docs/spec/wire-format.md "The int8 wire"): float32
//! values as blocks of int8 with one float32 scale each, blockwise absmax quantization.
//! Lossy by design; both implementations produce the same bytes and decode the same
//! values, so every step here is one IEEE float32 operation the reference repeats:
//!
//! - a block's scale is `absmax / 127` (float32 division); below 127 x 2^-149 it is
//!   `absmax x 2^149 / 127` rounded down, in steps of 2^-149 (at least one); lowered to the float32
//!   below it when `127 * scale` overflows (absmax near float32's largest); a block holding a NaN
//!   or an infinity has the scale NaN and every value 0, so it arrives as all NaN (an
//!   overflow check on the receiver, such as torch's GradScaler, still sees it);
//! - a value is `round_half_even(x / scale)` (float32 division), clamped to -127..=127; a
//!   block of zeros is all 0 with scale 0;
//! - a value decodes as `q * scale` in float32.
//!
//! Uses nothing of the crate; the codec's writer and reader use it.

/// Values a block holds (the last block of a chunk may hold fewer). With one int8 a
/// value and 8 bytes a block (its scale and its list offset), 512 keeps a 65,536-value
/// payload under 0.26 of the compact float32 one (256 would not: 0.261 with Arrow's
/// own bytes). A receiver assumes nothing about it: it reads each block's length from
/// the list offsets.
pub const BLOCK: usize = 512;

/// Below 127 steps of the smallest subnormal (as bits), a scale is rounded down rather
/// than to nearest (`scale_of`).
const SUBNORMAL_FLOOR: u32 = 127;

/// The canonical quiet NaN, the scale of a block that holds a non-finite value.
const NAN_SCALE: f32 = f32::from_bits(0x7fc0_0000);

/// Quantize `values` block by block, appending each block's int8 values to `q` and its
/// scale to `scales`.
pub fn quantize(values: &[f32], q: &mut Vec<i8>, scales: &mut Vec<f32>) {
    let start = q.len();
    q.resize(start + values.len(), 0);
    scales.reserve(values.len().div_ceil(BLOCK));
    for (block, out) in values.chunks(BLOCK).zip(q[start..].chunks_mut(BLOCK)) {
        let scale = scale_of(block);
        scales.push(scale);
        if scale == 0.0 || scale.is_nan() {
            continue; // every value 0, as `resize` left them
        }
        for (o, &x) in out.iter_mut().zip(block) {
            *o = nearest(x / scale) as i8;
        }
    }
}

/// 1.5 x 2^23: adding and subtracting it rounds a float32 of magnitude below 2^22 to an
/// integer, ties to even (the rounding mode every float operation uses), in two
/// additions the compiler vectorises where `round_ties_even` would be a call per value.
const ROUNDER: f32 = 12_582_912.0;

/// `v` (finite) clamped to -127..=127 and rounded to the nearest integer, ties to even:
/// the same as rounding first and clamping after, since the bounds are integers.
fn nearest(v: f32) -> f32 {
    (v.clamp(-127.0, 127.0) + ROUNDER) - ROUNDER
}

/// The scale of one block: NaN when it holds a non-finite value, 0 for zeros, else
/// `absmax / 127`, at least the smallest subnormal, and below what overflows at 127.
fn scale_of(block: &[f32]) -> f32 {
    // Magnitudes compared as bits (the order of non-negative floats), an integer max
    // that vectorises; the bits of an infinity or a NaN are the largest of all.
    let top = block
        .iter()
        .map(|x| x.to_bits() & 0x7fff_ffff)
        .fold(0, u32::max);
    if top >= 0x7f80_0000 {
        return NAN_SCALE;
    }
    let absmax = f32::from_bits(top);
    if absmax == 0.0 {
        return 0.0;
    }
    let scale = absmax / 127.0;
    if scale.to_bits() < SUBNORMAL_FLOOR {
        // A few subnormal steps: rounded down, so that the block's largest value takes
        // all 127 steps (a scale rounded up would leave it at 126, and its decoded values
        // would quantize to another scale). In units of the smallest subnormal, exact in
        // f64; at least one.
        let units = f64::from(absmax) * 2f64.powi(149);
        return f32::from_bits(((units / 127.0).floor() as u32).max(1));
    }
    if (127.0 * scale).is_infinite() {
        // Rounded up past what 127 steps can reach near float32's largest values: the
        // float32 just below it (a positive scale's bits less one).
        return f32::from_bits(scale.to_bits() - 1);
    }
    scale
}

/// Append the values of one block (`q` with `scale`) to `out`, in float32.
pub fn dequantize(q: &[i8], scale: f32, out: &mut Vec<f32>) {
    out.extend(q.iter().map(|&v| f32::from(v) * scale));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(values: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let (mut q, mut scales) = (Vec::new(), Vec::new());
        quantize(values, &mut q, &mut scales);
        assert_eq!(q.len(), values.len());
        assert_eq!(scales.len(), values.len().div_ceil(BLOCK));
        let mut back = Vec::new();
        for (block, &scale) in q.chunks(BLOCK).zip(&scales) {
            dequantize(block, scale, &mut back);
        }
        (back, scales)
    }

    #[test]
    fn each_value_is_within_half_a_step_of_its_block() {
        let values: Vec<f32> = (0..1000)
            .map(|k| ((k * 7919) % 2003) as f32 / 1000.0 - 1.0)
            .collect();
        let (back, scales) = round_trip(&values);
        for (k, (&x, &y)) in values.iter().zip(&back).enumerate() {
            let scale = scales[k / BLOCK];
            assert!(
                (x - y).abs() <= scale * (0.5 + 1.0 / 65536.0),
                "{k}: {x} {y}"
            );
        }
        // The largest magnitude of each block comes back exactly (q = +-127).
        let first_max = values[..BLOCK].iter().fold(0f32, |m, x| m.max(x.abs()));
        assert!(back[..BLOCK].iter().any(|y| y.abs() == 127.0 * scales[0]));
        assert_eq!(scales[0], first_max / 127.0);
    }

    #[test]
    fn a_block_with_a_non_finite_value_arrives_as_nan_and_others_are_untouched() {
        let mut values = vec![0.5f32; 2 * BLOCK + 3];
        values[BLOCK + 1] = f32::INFINITY;
        let (back, scales) = round_trip(&values);
        assert!(scales[1].is_nan());
        assert!(back[BLOCK..2 * BLOCK].iter().all(|y| y.is_nan()));
        assert!(back[..BLOCK]
            .iter()
            .chain(&back[2 * BLOCK..])
            .all(|&y| y == 0.5));
    }

    #[test]
    fn rounding_is_to_nearest_even_and_clamped() {
        for (v, want) in [
            (0.5f32, 0.0f32),
            (1.5, 2.0),
            (-2.5, -2.0),
            (-63.5, -64.0),
            (126.5, 126.0),
            (127.4, 127.0),
            (127.9, 127.0),
            (-130.0, -127.0),
            (3.499_999_8, 3.0),
        ] {
            assert_eq!(nearest(v), want, "{v}");
            assert_eq!(nearest(v), v.round_ties_even().clamp(-127.0, 127.0), "{v}");
        }
    }

    #[test]
    fn decoded_values_quantize_back_to_the_same_bytes() {
        // In the normal range `(127 * s) / 127 == s` for every `s = absmax / 127` (checked
        // over a whole binade of absmax by hand), so a block's decoded values have the
        // same scale: a block forwarded on the int8 wire keeps its bits.
        let mut values: Vec<f32> = (0..20_000)
            .map(|k| ((k * 7919 % 10007) as f32 - 5003.0) * 1.000_173_f32.powi(k % 4000))
            .collect();
        // And blocks whose scales are a few subnormal steps, or many.
        values.extend(
            (0..4 * BLOCK as u32).map(|k| {
                f32::from_bits((k.wrapping_mul(2_654_435_761) % (1 << 22)) >> (k / 512 * 6))
            }),
        );
        let (mut q, mut scales) = (Vec::new(), Vec::new());
        quantize(&values, &mut q, &mut scales);
        let mut back = Vec::new();
        for (block, &scale) in q.chunks(BLOCK).zip(&scales) {
            dequantize(block, scale, &mut back);
        }
        let (mut q2, mut scales2) = (Vec::new(), Vec::new());
        quantize(&back, &mut q2, &mut scales2);
        assert_eq!(q2, q);
        assert_eq!(scales2, scales);
    }

    #[test]
    fn the_largest_float32_values_stay_finite() {
        let values = [f32::MAX, -f32::MAX, 1.0];
        let (back, scales) = round_trip(&values);
        assert!((127.0 * scales[0]).is_finite());
        assert!(back.iter().all(|y| y.is_finite()), "{back:?}");
        assert!((back[0] - f32::MAX).abs() <= f32::MAX / 254.0);
    }

    #[test]
    fn zeros_and_subnormal_blocks_keep_their_values() {
        let (back, scales) = round_trip(&[0.0; 10]);
        assert_eq!((back, scales), (vec![0.0; 10], vec![0.0]));
        // absmax / 127 underflows: the smallest subnormal step keeps them exact.
        let tiny = [f32::from_bits(3), -f32::from_bits(100), 0.0];
        let (back, scales) = round_trip(&tiny);
        assert_eq!(scales, [f32::from_bits(1)]);
        assert_eq!(back, tiny);
        // A few steps: rounded down, the largest value on step 127.
        let few = [f32::from_bits(1000), f32::from_bits(10)];
        let (back, scales) = round_trip(&few);
        assert_eq!(scales, [f32::from_bits(7)]); // 1000 / 127 = 7.87
        assert_eq!(back, [f32::from_bits(7 * 127), f32::from_bits(7)]);
    }
}
