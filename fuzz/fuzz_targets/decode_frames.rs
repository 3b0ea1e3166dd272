//! Hostile bytes into the receiver: as a frame stream, and straight into the payload
//! decoder (random bytes rarely pass a CRC, so the decoder gets its own call). Whatever
//! comes in, the result is a gradient or an error, never a panic, and never more values
//! than the limit allows, however well the payload compresses. Run with
//! `-malloc_limit_mb=64`: no single allocation may exceed what the limit allows
//! (8 bytes a value of 2^20 values for a compressed buffer's declared size).
#![no_main]

use gradstream_core::codec::decode_payload;
use gradstream_core::SessionConfig;
use libfuzzer_sys::fuzz_target;

const LIMIT: usize = 1 << 20;

fuzz_target!(|data: &[u8]| {
    let mut session = SessionConfig::new("fuzz", 16);
    session.limits.max_gradient_len = LIMIT;
    session.limits.max_payload_len = 1 << 20;
    if let Ok(values) = session.decode_frames(data) {
        assert!(values.len() <= LIMIT);
    }
    let mut out = Vec::new();
    let _ = decode_payload(data, &mut out, LIMIT);
    assert!(out.len() <= LIMIT);
});
