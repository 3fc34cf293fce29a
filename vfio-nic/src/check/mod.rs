//! Frame checking: what the device side uses to judge what reached the
//! wire (checksums, each flow's sequence, the generator's payload pattern),
//! and what a virtio-net device makes of the frames a driver posted.

pub mod gso;
pub mod wire;
