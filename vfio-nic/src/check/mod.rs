//! Frame checking: what the device side uses to judge what reached the
//! wire (checksums, each flow's sequence, the generator's payload pattern).

pub mod wire;
