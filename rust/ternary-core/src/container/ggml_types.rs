//! The ggml tensor type table: id, name, values per block and bytes per block.
//!
//! Covers every type of gguf-py 0.19's `GGML_QUANT_SIZES` plus the ternary types of the forks
//! (bitnet.cpp I2_S, PrismML PQ2_0/PTQ1_0, Tencent STQ1_0 of llama.cpp PR #22836). Type id 42 names two formats (upstream Q2_0 with
//! 64-value blocks, first-generation PrismML "Q2_0" with 128-value blocks); the reader tells them
//! apart by the tensor's byte span and reports [`GgmlType::Q2_0`] or [`GgmlType::Q2_0_G128`].

/// `QK_K`, the super-block size of the k-quants, IQ* and TQ* types.
const QK_K: u64 = 256;

/// A resolved ggml tensor type.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    /// bitnet.cpp: 2-bit codes, `n/4` bytes plus a 32-byte tail holding one f32 scale.
    I2_S,
    MXFP4,
    NVFP4,
    Q1_0,
    /// Upstream Q2_0 (id 42): 64 values, 18 bytes (`d f16` + `qs[16]`).
    Q2_0,
    /// First-generation PrismML "Q2_0" (also id 42): 128 values, 34 bytes, the bytes of PQ2_0.
    Q2_0_G128,
    /// Tencent STQ1_0 (id 43, llama.cpp PR #22836): 256 values, 42 bytes (`qs[32]`, `sign[8]`, `d`).
    STQ1_0,
    /// PrismML PQ2_0 (id 142): 128 values, 34 bytes.
    PQ2_0,
    /// PrismML PTQ1_0 (id 143): 128 values, 28 bytes.
    PTQ1_0,
}

/// Every type, in id order (id 42 twice).
pub const ALL_TYPES: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q8_1,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q8_K,
    GgmlType::IQ2_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ3_XXS,
    GgmlType::IQ1_S,
    GgmlType::IQ4_NL,
    GgmlType::IQ3_S,
    GgmlType::IQ2_S,
    GgmlType::IQ4_XS,
    GgmlType::I8,
    GgmlType::I16,
    GgmlType::I32,
    GgmlType::I64,
    GgmlType::F64,
    GgmlType::IQ1_M,
    GgmlType::BF16,
    GgmlType::TQ1_0,
    GgmlType::TQ2_0,
    GgmlType::I2_S,
    GgmlType::MXFP4,
    GgmlType::NVFP4,
    GgmlType::Q1_0,
    GgmlType::Q2_0,
    GgmlType::Q2_0_G128,
    GgmlType::STQ1_0,
    GgmlType::PQ2_0,
    GgmlType::PTQ1_0,
];

/// Bytes of the f32 scale tail of an I2_S tensor (bitnet.cpp pads the 4-byte scale to 32).
pub const I2_S_TAIL_BYTES: u64 = 32;

impl GgmlType {
    /// (type id, name, values per block, bytes per block). For I2_S the block is 4 values in 1 byte
    /// and the 32-byte tail is added by [`GgmlType::tensor_bytes`].
    const fn row(self) -> (u32, &'static str, u64, u64) {
        use GgmlType::*;
        match self {
            F32 => (0, "F32", 1, 4),
            F16 => (1, "F16", 1, 2),
            Q4_0 => (2, "Q4_0", 32, 2 + 16),
            Q4_1 => (3, "Q4_1", 32, 2 + 2 + 16),
            Q5_0 => (6, "Q5_0", 32, 2 + 4 + 16),
            Q5_1 => (7, "Q5_1", 32, 2 + 2 + 4 + 16),
            Q8_0 => (8, "Q8_0", 32, 2 + 32),
            Q8_1 => (9, "Q8_1", 32, 4 + 4 + 32),
            Q2_K => (10, "Q2_K", QK_K, 2 + 2 + QK_K / 16 + QK_K / 4),
            Q3_K => (11, "Q3_K", QK_K, 2 + QK_K / 4 + QK_K / 8 + 12),
            Q4_K => (12, "Q4_K", QK_K, 2 + 2 + QK_K / 2 + 12),
            Q5_K => (13, "Q5_K", QK_K, 2 + 2 + QK_K / 2 + QK_K / 8 + 12),
            Q6_K => (14, "Q6_K", QK_K, 2 + QK_K / 2 + QK_K / 4 + QK_K / 16),
            Q8_K => (15, "Q8_K", QK_K, 4 + QK_K + QK_K / 8),
            IQ2_XXS => (16, "IQ2_XXS", QK_K, 2 + QK_K / 4),
            IQ2_XS => (17, "IQ2_XS", QK_K, 2 + QK_K / 4 + QK_K / 32),
            IQ3_XXS => (18, "IQ3_XXS", QK_K, 2 + QK_K / 4 + QK_K / 8),
            IQ1_S => (19, "IQ1_S", QK_K, 2 + QK_K / 8 + QK_K / 16),
            IQ4_NL => (20, "IQ4_NL", 32, 2 + 16),
            IQ3_S => (21, "IQ3_S", QK_K, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4),
            IQ2_S => (22, "IQ2_S", QK_K, 2 + QK_K / 4 + QK_K / 16),
            IQ4_XS => (23, "IQ4_XS", QK_K, 2 + 2 + QK_K / 2 + QK_K / 64),
            I8 => (24, "I8", 1, 1),
            I16 => (25, "I16", 1, 2),
            I32 => (26, "I32", 1, 4),
            I64 => (27, "I64", 1, 8),
            F64 => (28, "F64", 1, 8),
            IQ1_M => (29, "IQ1_M", QK_K, QK_K / 8 + QK_K / 16 + QK_K / 32),
            BF16 => (30, "BF16", 1, 2),
            TQ1_0 => (34, "TQ1_0", QK_K, 2 + 4 * 13),
            TQ2_0 => (35, "TQ2_0", QK_K, 2 + 64),
            I2_S => (36, "I2_S", 4, 1),
            MXFP4 => (39, "MXFP4", 32, 1 + 16),
            NVFP4 => (40, "NVFP4", 64, 4 + 32),
            Q1_0 => (41, "Q1_0", 128, 2 + 16),
            Q2_0 => (42, "Q2_0", 64, 2 + 16),
            Q2_0_G128 => (42, "Q2_0_G128", 128, 2 + 32),
            STQ1_0 => (43, "STQ1_0", QK_K, QK_K / 8 + QK_K / 32 + 2),
            PQ2_0 => (142, "PQ2_0", 128, 2 + 32),
            PTQ1_0 => (143, "PTQ1_0", 128, 24 + 2 + 2),
        }
    }

    /// The ggml type id stored in the file.
    pub const fn id(self) -> u32 {
        self.row().0
    }

    /// The name ternary_rs reports (gguf-py's name where gguf-py has one).
    pub const fn name(self) -> &'static str {
        self.row().1
    }

    /// Values per block; `ne[0]` must be a multiple of it.
    pub const fn block_size(self) -> u64 {
        self.row().2
    }

    /// Bytes per block.
    pub const fn type_size(self) -> u64 {
        self.row().3
    }

    /// The type for a file's type id. Id 42 gives upstream [`GgmlType::Q2_0`]; the reader replaces it
    /// with [`GgmlType::Q2_0_G128`] when the byte span says so.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        ALL_TYPES.iter().copied().find(|t| t.id() == id)
    }

    /// Look a type up by the name [`GgmlType::name`] reports.
    pub fn from_name(name: &str) -> Option<GgmlType> {
        ALL_TYPES.iter().copied().find(|t| t.name() == name)
    }

    /// Bytes a tensor of `n_elements` values takes, or `None` when `n_elements` is not a whole number
    /// of blocks or the size overflows.
    pub fn tensor_bytes(self, n_elements: u64) -> Option<u64> {
        if !n_elements.is_multiple_of(self.block_size()) {
            return None;
        }
        let body = (n_elements / self.block_size()).checked_mul(self.type_size())?;
        if self == GgmlType::I2_S {
            body.checked_add(I2_S_TAIL_BYTES)
        } else {
            Some(body)
        }
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A comma-separated list of the known type names and ids, for error messages.
pub fn supported_types() -> String {
    ALL_TYPES
        .iter()
        .map(|t| format!("{} ({})", t.name(), t.id()))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_matches_formats_md() {
        // Sizes from docs/formats.md#ggml-type-ids and gguf-py 0.19 GGML_QUANT_SIZES.
        let expect = [
            (GgmlType::F32, 0, 1, 4),
            (GgmlType::F16, 1, 1, 2),
            (GgmlType::BF16, 30, 1, 2),
            (GgmlType::Q8_0, 8, 32, 34),
            (GgmlType::Q4_0, 2, 32, 18),
            (GgmlType::IQ1_S, 19, 256, 50),
            (GgmlType::IQ1_M, 29, 256, 56),
            (GgmlType::TQ1_0, 34, 256, 54),
            (GgmlType::TQ2_0, 35, 256, 66),
            (GgmlType::Q1_0, 41, 128, 18),
            (GgmlType::Q2_0, 42, 64, 18),
            (GgmlType::Q2_0_G128, 42, 128, 34),
            (GgmlType::PQ2_0, 142, 128, 34),
            (GgmlType::PTQ1_0, 143, 128, 28),
            (GgmlType::STQ1_0, 43, 256, 42),
            (GgmlType::MXFP4, 39, 32, 17),
            (GgmlType::NVFP4, 40, 64, 36),
        ];
        for (t, id, bs, ts) in expect {
            assert_eq!((t.id(), t.block_size(), t.type_size()), (id, bs, ts), "{t}");
        }
    }

    #[test]
    fn i2_s_has_a_32_byte_tail() {
        assert_eq!(GgmlType::I2_S.tensor_bytes(128 * 4), Some(128 + 32));
        assert_eq!(GgmlType::I2_S.tensor_bytes(6), None);
    }

    #[test]
    fn id_42_defaults_to_upstream_and_names_round_trip() {
        assert_eq!(GgmlType::from_id(42), Some(GgmlType::Q2_0));
        assert_eq!(GgmlType::from_id(37), None);
        for &t in ALL_TYPES {
            assert_eq!(GgmlType::from_name(t.name()), Some(t));
        }
    }

    #[test]
    fn partial_blocks_and_overflow_are_refused() {
        assert_eq!(GgmlType::TQ2_0.tensor_bytes(128), None);
        assert_eq!(GgmlType::F64.tensor_bytes(u64::MAX), None);
    }
}
