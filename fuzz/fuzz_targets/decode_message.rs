//! proto::decode on arbitrary bytes: never panics; whatever decodes
//! re-encodes to the same bytes (the decoders accept only canonical input).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(msg) = aggbox::wire::proto::decode(data) {
        let mut out = Vec::new();
        msg.encode_into(&mut out).expect("a decoded message encodes");
        assert_eq!(out, data, "decode/encode round trip");
        assert_eq!(aggbox::wire::proto::classify(data), Some(msg.kind()));
    }
});
