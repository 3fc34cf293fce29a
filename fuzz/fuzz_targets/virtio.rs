//! Fuzz target: `pfrag_lab::harness::virtio_ring` (see its docs for the property).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = pfrag_lab::harness::virtio_ring(data) {
        panic!("{e}");
    }
});
