//! PrismML PTQ1_0 (GGUF type 143, Bonsai 2): `{ qs: [u8; 24], qh: [u8; 2], d: f16 }`, 28 bytes,
//! 128 values, 1.75 bpw (FORMATS.md §1.3.4): TQ1_0's base-3 packing at group 128 — stages of 16 and
//! 8 bytes (the 32-byte stage does not fit in 24), then 2 `qh` bytes; see [`super::base3`].

use super::base3::base3_block;
use super::Format;

base3_block!(BlockPtq1_0, Format::Ptq1_0, values: 128, bytes: 28, qs: 24, qh: 2, stages: [16, 8]);
