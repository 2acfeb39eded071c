//! proto::split_agg on arbitrary bytes: never panics; an accepted datagram
//! is exactly 24 + 4·count bytes and its header re-encodes to its bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match aggbox::wire::proto::split_agg(data) {
        Ok((hdr, payload)) => {
            assert_eq!(payload.len(), 4 * hdr.count as usize);
            assert_eq!(data.len(), 24 + payload.len());
            assert_eq!(&aggbox::wire::proto::agg_header_bytes(&hdr)[..], &data[..24]);
        }
        Err(e) => {
            // Every AGG1 error has a kernel drop reason, except the
            // user-space-only FLOAT32 + bitwise rule and non-AGG1 input.
            let _ = e.drop_reason();
        }
    }
});
