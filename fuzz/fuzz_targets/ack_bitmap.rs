//! SeqBitmap::from_bytes on arbitrary (base, nbits, bytes): never panics;
//! an accepted bitmap writes back the same bytes and its counts agree.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 6 {
        return;
    }
    let base = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
    let nbits = u16::from_le_bytes([data[4], data[5]]);
    let bytes = &data[6..];
    if let Ok(bm) = aggbox::wire::proto::SeqBitmap::from_bytes(base, nbits, bytes) {
        let mut out = Vec::new();
        bm.write_bytes(&mut out);
        assert_eq!(out, bytes);
        let received = bm.received().count() as u32;
        let missing = bm.missing().count() as u32;
        assert_eq!(received, bm.count_received());
        assert_eq!(received + missing, u32::from(nbits));
        assert_eq!(bm.is_complete(), missing == 0);
    }
});
