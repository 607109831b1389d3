//! PrismML PQ2_0 (GGUF type 142) and the first-gen fork "Q2_0" (type 42 with 128-value blocks, also
//! called Q2_0_G128): `{ d: f16, qs: [u8; 32] }`, 34 bytes, the consecutive 2-bit codec of
//! [`super::q2_0`] at group 128 (docs/formats.md#pq2_0). Both names share these bytes; the container
//! layer tells the two id-42 variants apart by byte span.

use super::q2_0::consecutive_2bit_block;
use super::Format;

consecutive_2bit_block!(BlockPq2_0, Format::Pq2_0, values: 128, bytes: 34);
