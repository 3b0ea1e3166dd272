//! Hostile bytes into the receiver: as a frame stream, and straight into the payload
//! decoder (random bytes rarely pass a CRC, so the decoder gets its own call). Whatever
//! comes in, the result is a gradient or an error, never a panic, and never more values
//! than a quarter of the input's bytes.
#![no_main]

use gradstream::codec::decode_payload;
use gradstream::SessionConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut session = SessionConfig::new("fuzz", 16);
    session.limits.max_gradient_len = 1 << 20;
    session.limits.max_payload_len = 1 << 20;
    if let Ok(values) = session.decode_frames(data) {
        assert!(values.len() <= data.len() / 4);
    }
    let mut out = Vec::new();
    let _ = decode_payload(data, &mut out);
    assert!(out.len() <= data.len() / 4);
});
