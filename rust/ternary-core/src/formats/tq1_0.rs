//! Upstream GGUF TQ1_0 (type 34): `{ qs: [u8; 48], qh: [u8; 4], d: f16 }`, 54 bytes, 256 values
//! (docs/formats.md#tq1_0): base-3 stages of 32 and 16 bytes, then 4 `qh` bytes; see [`super::base3`].

use super::base3::base3_block;
use super::Format;

base3_block!(BlockTq1_0, Format::Tq1_0, values: 256, bytes: 54, qs: 48, qh: 4, stages: [32, 16]);
