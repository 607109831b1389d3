//! Zero-copy GGUF (v2, v3) reader.
//!
//! [`GgufFile::open`] maps the file and parses only the header (metadata and tensor infos); tensor
//! data is never touched, so opening costs the same whatever the data size. Every count, length,
//! dimension, offset and size is checked against [`super::limits`] and the file length before use,
//! with checked arithmetic; a malformed file gives [`Error::Format`] naming file, field and byte
//! offset. Validation happens once, here: after `open` succeeds every tensor's bytes are in bounds,
//! aligned, and disjoint from every other tensor's.
//!
//! Byte-swapped (big-endian) files are read (gguf-py's rule: a version whose low 16 bits are zero
//! is byte-swapped). Metadata numbers and lengths are swapped on read; tensor bytes are returned as
//! stored.

use std::collections::HashMap;
use std::path::Path;

use super::ggml_types::{supported_types, GgmlType};
use super::limits::*;
use super::mapping::MappedFile;
use crate::{Error, Result};

/// "GGUF" as stored in the first four bytes.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";

/// Byte order of a GGUF file's header fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ByteOrder {
    Little,
    Big,
}

/// GGUF metadata value types (the `u32` stored before every value).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgufValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl GgufValueType {
    pub fn from_u32(v: u32) -> Option<Self> {
        use GgufValueType::*;
        Some(match v {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The short name used by the Python API ("u8", "string", "array", …).
    pub fn name(self) -> &'static str {
        use GgufValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        (0..=12)
            .filter_map(Self::from_u32)
            .find(|t| t.name() == name)
    }

    /// Bytes of one value of a fixed-size type (None for string and array).
    pub fn fixed_size(self) -> Option<usize> {
        use GgufValueType::*;
        match self {
            U8 | I8 | Bool => Some(1),
            U16 | I16 => Some(2),
            U32 | I32 | F32 => Some(4),
            U64 | I64 | F64 => Some(8),
            String | Array => None,
        }
    }
}

/// A byte range inside the mapped file (strings and scalar arrays are not copied).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub offset: usize,
    pub len: usize,
}

/// One metadata value. Strings and arrays refer to the mapping; read them through [`GgufFile`].
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(Span),
    Array(GgufArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl GgufValue {
    pub fn value_type(&self) -> GgufValueType {
        use GgufValue::*;
        match self {
            U8(_) => GgufValueType::U8,
            I8(_) => GgufValueType::I8,
            U16(_) => GgufValueType::U16,
            I16(_) => GgufValueType::I16,
            U32(_) => GgufValueType::U32,
            I32(_) => GgufValueType::I32,
            F32(_) => GgufValueType::F32,
            Bool(_) => GgufValueType::Bool,
            String(_) => GgufValueType::String,
            Array(_) => GgufValueType::Array,
            U64(_) => GgufValueType::U64,
            I64(_) => GgufValueType::I64,
            F64(_) => GgufValueType::F64,
        }
    }

    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        use GgufValue::*;
        match *self {
            U8(v) => Some(v.into()),
            U16(v) => Some(v.into()),
            U32(v) => Some(v.into()),
            U64(v) => Some(v),
            I8(v) => u64::try_from(v).ok(),
            I16(v) => u64::try_from(v).ok(),
            I32(v) => u64::try_from(v).ok(),
            I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
}

/// A metadata array: `len` elements of type `elem`.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufArray {
    pub elem: GgufValueType,
    pub len: usize,
    pub items: ArrayItems,
}

#[derive(Debug, Clone, PartialEq)]
pub enum ArrayItems {
    /// Fixed-size elements, stored back to back (in the file's byte order).
    Scalars(Span),
    Strings(Vec<Span>),
    Arrays(Vec<GgufArray>),
}

/// One tensor's header entry, validated.
#[derive(Debug, Clone)]
pub struct GgufTensorInfo {
    pub name: String,
    /// Dimensions in GGUF order (`ne[0]` fastest); the PyTorch shape is this reversed.
    pub ne: Vec<u64>,
    /// The type id stored in the file.
    pub type_id: u32,
    /// The resolved type (id 42 resolved to `Q2_0` or `Q2_0_G128` by byte span).
    pub ggml_type: GgmlType,
    /// Offset relative to the start of the data section, as stored.
    pub offset: u64,
    /// Absolute offset in the file.
    pub abs_offset: u64,
    pub nbytes: u64,
    pub n_elements: u64,
}

impl GgufTensorInfo {
    /// The shape in PyTorch order (GGUF `ne` reversed).
    pub fn shape(&self) -> Vec<u64> {
        self.ne.iter().rev().copied().collect()
    }
}

/// An open GGUF file: header parsed, data mapped.
#[derive(Debug)]
pub struct GgufFile {
    map: MappedFile,
    pub version: u32,
    pub byte_order: ByteOrder,
    pub alignment: u64,
    /// Absolute offset of the data section (header end rounded up to `alignment`).
    pub data_offset: u64,
    metadata: Vec<(String, GgufValue)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
}

/// Metadata pairs in file order.
type Metadata = Vec<(String, GgufValue)>;

/// Bounds-checked reader over the header bytes.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    order: ByteOrder,
    path: &'a Path,
}

macro_rules! read_num {
    ($name:ident, $t:ty) => {
        fn $name(&mut self, what: &str) -> Result<$t> {
            let b = self.take(std::mem::size_of::<$t>() as u64, what)?;
            let arr = b.try_into().expect("take returned the requested length");
            Ok(match self.order {
                ByteOrder::Little => <$t>::from_le_bytes(arr),
                ByteOrder::Big => <$t>::from_be_bytes(arr),
            })
        }
    };
}

impl<'a> Cursor<'a> {
    fn err(&self, offset: usize, what: impl Into<String>) -> Error {
        Error::format(self.path, offset as u64, what)
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() as u64 {
            return Err(self.err(
                self.pos,
                format!(
                    "{what}: needs {n} bytes but only {} remain (file is {} bytes; truncated?)",
                    self.remaining(),
                    self.buf.len()
                ),
            ));
        }
        let start = self.pos;
        self.pos += n as usize;
        Ok(&self.buf[start..self.pos])
    }

    read_num!(u8, u8);
    read_num!(i8, i8);
    read_num!(u16, u16);
    read_num!(i16, i16);
    read_num!(u32, u32);
    read_num!(i32, i32);
    read_num!(u64, u64);
    read_num!(i64, i64);
    read_num!(f32, f32);
    read_num!(f64, f64);

    /// A `u64` length followed by that many bytes; `max` is the named limit that applies.
    fn string(&mut self, max: u64, limit_name: &str, what: &str) -> Result<Span> {
        let at = self.pos;
        let len = self.u64(what)?;
        if len > max {
            return Err(self.err(
                at,
                format!("{what}: length {len} exceeds {limit_name} = {max}"),
            ));
        }
        let start = self.pos;
        self.take(len, what)?;
        Ok(Span {
            offset: start,
            len: len as usize,
        })
    }

    fn utf8(&self, span: Span, what: &str) -> Result<String> {
        std::str::from_utf8(&self.buf[span.offset..span.offset + span.len])
            .map(str::to_owned)
            .map_err(|e| self.err(span.offset, format!("{what} is not valid UTF-8: {e}")))
    }

    fn bool(&mut self, what: &str) -> Result<bool> {
        let at = self.pos;
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(self.err(
                at,
                format!("{what}: bool byte is {v:#04x}, expected 0x00 or 0x01"),
            )),
        }
    }

    fn value_type(&mut self, what: &str) -> Result<GgufValueType> {
        let at = self.pos;
        let v = self.u32(what)?;
        GgufValueType::from_u32(v).ok_or_else(|| {
            self.err(
                at,
                format!("{what}: unknown metadata value type {v} (known: 0..=12)"),
            )
        })
    }

    fn value(&mut self, ty: GgufValueType, depth: usize, what: &str) -> Result<GgufValue> {
        use GgufValueType as T;
        Ok(match ty {
            T::U8 => GgufValue::U8(self.u8(what)?),
            T::I8 => GgufValue::I8(self.i8(what)?),
            T::U16 => GgufValue::U16(self.u16(what)?),
            T::I16 => GgufValue::I16(self.i16(what)?),
            T::U32 => GgufValue::U32(self.u32(what)?),
            T::I32 => GgufValue::I32(self.i32(what)?),
            T::F32 => GgufValue::F32(self.f32(what)?),
            T::Bool => GgufValue::Bool(self.bool(what)?),
            T::String => GgufValue::String(self.string(MAX_STRING_LEN, "MAX_STRING_LEN", what)?),
            T::Array => GgufValue::Array(self.array(depth + 1, what)?),
            T::U64 => GgufValue::U64(self.u64(what)?),
            T::I64 => GgufValue::I64(self.i64(what)?),
            T::F64 => GgufValue::F64(self.f64(what)?),
        })
    }

    fn array(&mut self, depth: usize, what: &str) -> Result<GgufArray> {
        if depth > MAX_ARRAY_DEPTH {
            return Err(self.err(
                self.pos,
                format!("{what}: arrays nested deeper than MAX_ARRAY_DEPTH = {MAX_ARRAY_DEPTH}"),
            ));
        }
        let elem = self.value_type(what)?;
        let at = self.pos;
        let len = self.u64(what)?;
        if len > MAX_ARRAY_LEN {
            return Err(self.err(
                at,
                format!("{what}: array length {len} exceeds MAX_ARRAY_LEN = {MAX_ARRAY_LEN}"),
            ));
        }
        // Every element takes at least this many bytes, so a length the file cannot hold fails
        // before anything is allocated for it.
        let min_elem = elem
            .fixed_size()
            .unwrap_or(if elem == GgufValueType::String { 8 } else { 12 });
        if len.saturating_mul(min_elem as u64) > self.remaining() as u64 {
            return Err(self.err(
                at,
                format!(
                    "{what}: array of {len} {} elements needs at least {} bytes but only {} remain",
                    elem.name(),
                    len.saturating_mul(min_elem as u64),
                    self.remaining()
                ),
            ));
        }
        let n = len as usize;
        let items = match elem {
            GgufValueType::String => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.string(MAX_STRING_LEN, "MAX_STRING_LEN", what)?);
                }
                ArrayItems::Strings(v)
            }
            GgufValueType::Array => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.array(depth + 1, what)?);
                }
                ArrayItems::Arrays(v)
            }
            GgufValueType::Bool => {
                let start = self.pos;
                for _ in 0..n {
                    self.bool(what)?;
                }
                ArrayItems::Scalars(Span {
                    offset: start,
                    len: n,
                })
            }
            _ => {
                let start = self.pos;
                let bytes = (n as u64) * (min_elem as u64); // bounded by remaining() above
                self.take(bytes, what)?;
                ArrayItems::Scalars(Span {
                    offset: start,
                    len: bytes as usize,
                })
            }
        };
        Ok(GgufArray {
            elem,
            len: n,
            items,
        })
    }

    /// The magic and the version (2 or 3); sets the byte order the version reveals.
    fn magic_and_version(&mut self) -> Result<u32> {
        let magic = self.take(4, "magic")?;
        if magic != GGUF_MAGIC {
            return Err(Error::format(
                self.path,
                0,
                format!(
                    "bad magic {}: not a GGUF file (expected \"GGUF\" = 0x47 0x47 0x55 0x46)",
                    hex_bytes(magic)
                ),
            ));
        }
        let raw_version = self.u32("version")?;
        // gguf-py: the version is small, so a byte-swapped file has its low 16 bits all zero.
        let (version, byte_order) = if raw_version & 0xFFFF == 0 {
            (raw_version.swap_bytes(), ByteOrder::Big)
        } else {
            (raw_version, ByteOrder::Little)
        };
        self.order = byte_order;
        match version {
            2 | 3 => {}
            1 => {
                return Err(Error::format(
                    self.path,
                    4,
                    "GGUF version 1 (32-bit counts) is not supported; only versions 2 and 3",
                ))
            }
            v => {
                return Err(Error::format(
                    self.path,
                    4,
                    format!("unsupported GGUF version {v} (raw {raw_version:#010x}); only 2 and 3"),
                ))
            }
        }
        Ok(version)
    }

    /// A count of at most `max` (named `max_name` in the message).
    fn count(&mut self, what: &str, max: u64, max_name: &str) -> Result<u64> {
        let at = self.pos;
        let n = self.u64(what)?;
        if n > max {
            return Err(Error::format(
                self.path,
                at as u64,
                format!("{what} {n} exceeds {max_name} = {max}"),
            ));
        }
        Ok(n)
    }

    /// `n_kv` metadata pairs and the index of their keys (a duplicate key is refused).
    fn metadata(&mut self, n_kv: u64) -> Result<(Metadata, HashMap<String, usize>)> {
        // Capacity is bounded by what the remaining bytes could hold (a KV takes ≥ 12 bytes).
        let mut metadata = Vec::with_capacity((n_kv as usize).min(self.remaining() / 12));
        let mut metadata_index = HashMap::with_capacity(metadata.capacity());
        for i in 0..n_kv {
            let at = self.pos;
            let key_span = self.string(
                MAX_STRING_LEN,
                "MAX_STRING_LEN",
                &format!("metadata key #{i}"),
            )?;
            let key = self.utf8(key_span, &format!("metadata key #{i}"))?;
            let what = format!("metadata '{key}'");
            let ty = self.value_type(&what)?;
            let value = self.value(ty, 0, &what)?;
            if metadata_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(Error::format(
                    self.path,
                    at as u64,
                    format!("duplicate metadata key '{key}'"),
                ));
            }
            metadata.push((key, value));
        }

        Ok((metadata, metadata_index))
    }

    /// `n_tensors` tensor infos and the index of their names (a duplicate name is refused).
    fn tensor_infos(
        &mut self,
        n_tensors: u64,
        alignment: u64,
    ) -> Result<(Vec<GgufTensorInfo>, HashMap<String, usize>)> {
        // A tensor info takes at least 8 (name len) + 4 + 4 + 8 bytes.
        let mut tensors: Vec<GgufTensorInfo> =
            Vec::with_capacity((n_tensors as usize).min(self.remaining() / 24));
        let mut tensor_index = HashMap::with_capacity(tensors.capacity());
        for i in 0..n_tensors {
            let info_at = self.pos;
            let info = self.tensor_info(i, alignment)?;
            if tensor_index
                .insert(info.name.clone(), tensors.len())
                .is_some()
            {
                return Err(Error::format(
                    self.path,
                    info_at as u64,
                    format!("duplicate tensor name '{}'", info.name),
                ));
            }
            tensors.push(info);
        }
        Ok((tensors, tensor_index))
    }

    /// Tensor info `#i`: name, dimensions, type, data offset (sized and placed later).
    fn tensor_info(&mut self, i: u64, alignment: u64) -> Result<GgufTensorInfo> {
        let name_span = self.string(
            MAX_TENSOR_NAME_LEN,
            "MAX_TENSOR_NAME_LEN",
            &format!("tensor #{i} name"),
        )?;
        let name = self.utf8(name_span, &format!("tensor #{i} name"))?;
        let what = format!("tensor '{name}'");
        let at = self.pos;
        let n_dims = u64::from(self.u32(&what)?);
        if n_dims > MAX_DIMS {
            return Err(Error::format(
                self.path,
                at as u64,
                format!("{what}: {n_dims} dimensions exceed MAX_DIMS = {MAX_DIMS}"),
            ));
        }
        let mut ne = Vec::with_capacity(n_dims as usize);
        let mut n_elements: u64 = 1;
        for _ in 0..n_dims {
            let at = self.pos;
            let d = self.u64(&what)?;
            n_elements = n_elements
                .checked_mul(d)
                .filter(|&n| n <= MAX_ELEMENTS)
                .ok_or_else(|| {
                    Error::format(
                        self.path,
                        at as u64,
                        format!("{what}: element count overflows MAX_ELEMENTS = {MAX_ELEMENTS} (dimension {d})"),
                    )
                })?;
            ne.push(d);
        }
        let at = self.pos;
        let type_id = self.u32(&what)?;
        let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| Error::UnsupportedType {
            file: self.path.display().to_string(),
            tensor: name.clone(),
            what: format!("ggml type id {type_id} (at byte offset {at})"),
            supported: supported_types(),
        })?;
        let ne0 = ne.first().copied().unwrap_or(1);
        // Id 42 may be the 128-block variant; checked against the span below.
        let block = if type_id == 42 {
            64
        } else {
            ggml_type.block_size()
        };
        if ne0 % block != 0 {
            return Err(Error::format(
                self.path,
                at as u64,
                format!(
                    "{what}: ne[0] = {ne0} is not a multiple of the {} block size {block}",
                    ggml_type.name()
                ),
            ));
        }
        let at = self.pos;
        let offset = self.u64(&what)?;
        if offset % alignment != 0 {
            return Err(Error::format(
                self.path,
                at as u64,
                format!(
                    "{what}: data offset {offset} is not a multiple of the alignment {alignment}"
                ),
            ));
        }
        Ok(GgufTensorInfo {
            name,
            ne,
            type_id,
            ggml_type,
            offset,
            abs_offset: 0,
            nbytes: 0,
            n_elements,
        })
    }
}

/// Tensor indices in offset order, and the bytes from each tensor's offset to the next larger tensor
/// offset (or the data end), in one backward pass: linear even when many (empty) tensors share an
/// offset.
fn byte_spans(tensors: &[GgufTensorInfo], data_len: u64) -> (Vec<usize>, Vec<u64>) {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by_key(|&i| tensors[i].offset);
    let mut span = vec![0u64; tensors.len()];
    let mut next_start = data_len;
    for k in (0..order.len()).rev() {
        let off = tensors[order[k]].offset;
        if let Some(&j) = order.get(k + 1) {
            if tensors[j].offset > off {
                next_start = tensors[j].offset;
            }
        }
        span[order[k]] = next_start.max(off) - off;
    }

    (order, span)
}

/// Id 42 is Q2_0 (g64) or Q2_0_G128: the variant whose size fills the tensor's byte span.
fn resolve_type_42(
    path: &Path,
    tensors: &mut [GgufTensorInfo],
    span: &[u64],
    data_offset: u64,
    alignment: u64,
) -> Result<()> {
    // Id 42: a variant fits when its size fills the span up to less than one alignment of padding.
    let fits = |t: &GgufTensorInfo, ty: GgmlType, span: u64| {
        ty.tensor_bytes(t.n_elements)
            .is_some_and(|b| b <= span && span - b < alignment)
    };
    let mut votes = [0usize; 2];
    for (i, t) in tensors.iter().enumerate() {
        if t.type_id == 42 {
            match (
                fits(t, GgmlType::Q2_0, span[i]),
                fits(t, GgmlType::Q2_0_G128, span[i]),
            ) {
                (true, false) => votes[0] += 1,
                (false, true) => votes[1] += 1,
                _ => {}
            }
        }
    }
    // Small tensors can fit both; they follow the file's unambiguous tensors (upstream if none).
    let file_default = if votes[1] > votes[0] {
        GgmlType::Q2_0_G128
    } else {
        GgmlType::Q2_0
    };
    for (i, t) in tensors.iter_mut().enumerate() {
        if t.type_id != 42 {
            continue;
        }
        t.ggml_type = match (
            fits(t, GgmlType::Q2_0, span[i]),
            fits(t, GgmlType::Q2_0_G128, span[i]),
        ) {
            (true, false) => GgmlType::Q2_0,
            (false, true) => GgmlType::Q2_0_G128,
            (true, true) => file_default,
            (false, false) => {
                let size = |ty: GgmlType| {
                    ty.tensor_bytes(t.n_elements)
                        .map_or_else(|| "n/a".to_string(), |b| b.to_string())
                };
                return Err(Error::format(
                    path,
                    data_offset.saturating_add(t.offset),
                    format!(
                        "tensor '{}': type id 42 byte span {} matches neither Q2_0 (g64: {} bytes) nor Q2_0_G128 (g128: {} bytes) within alignment {alignment}",
                        t.name,
                        span[i],
                        size(GgmlType::Q2_0),
                        size(GgmlType::Q2_0_G128)
                    ),
                ));
            }
        };
    }

    Ok(())
}

/// Each tensor's byte size, refused when it runs past the data section.
fn size_within_data(
    path: &Path,
    tensors: &mut [GgufTensorInfo],
    data_offset: u64,
    data_len: u64,
) -> Result<()> {
    for t in tensors.iter_mut() {
        t.nbytes = t.ggml_type.tensor_bytes(t.n_elements).ok_or_else(|| {
            Error::format(
                path,
                data_offset.saturating_add(t.offset),
                format!(
                    "tensor '{}': {} elements are not a whole number of {} blocks",
                    t.name, t.n_elements, t.ggml_type
                ),
            )
        })?;
        let end = t.offset.checked_add(t.nbytes);
        if end.is_none_or(|e| e > data_len) {
            return Err(Error::format(
                path,
                data_offset.saturating_add(t.offset),
                format!(
                    "tensor '{}': {} bytes at data offset {} run past the end of the file (data section holds {data_len} bytes)",
                    t.name, t.nbytes, t.offset
                ),
            ));
        }
        t.abs_offset = data_offset + t.offset; // ≤ file length, checked above
    }

    Ok(())
}

/// Refuse tensors whose bytes overlap.
fn check_overlaps(path: &Path, tensors: &[GgufTensorInfo], order: &mut [usize]) -> Result<()> {
    // Overlaps: in offset order (empty tensors first at a shared offset), each must end before the next starts.
    order.sort_by_key(|&i| (tensors[i].offset, tensors[i].nbytes));
    for w in order.windows(2) {
        let (a, b) = (&tensors[w[0]], &tensors[w[1]]);
        if a.offset + a.nbytes > b.offset {
            return Err(Error::format(
                path,
                b.abs_offset,
                format!(
                    "tensor '{}' (data offset {}, {} bytes) overlaps tensor '{}' (data offset {})",
                    a.name, a.offset, a.nbytes, b.name, b.offset
                ),
            ));
        }
    }
    Ok(())
}

/// Bytes as messages show them: `0x47 0x47 0x55 0x46`.
fn hex_bytes(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|b| format!("{b:#04x}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// `general.alignment` (a power of two up to MAX_ALIGNMENT), or the default.
fn alignment(
    path: &Path,
    metadata: &Metadata,
    metadata_index: &HashMap<String, usize>,
) -> Result<u64> {
    let alignment = match metadata_index
        .get("general.alignment")
        .map(|&i| &metadata[i].1)
    {
        None => DEFAULT_ALIGNMENT,
        Some(GgufValue::U32(a)) => {
            let a = u64::from(*a);
            if a == 0 || !a.is_power_of_two() || a > MAX_ALIGNMENT {
                return Err(Error::format(
                        path,
                        0,
                        format!(
                            "general.alignment = {a} must be a power of two between 1 and MAX_ALIGNMENT = {MAX_ALIGNMENT}"
                        ),
                    ));
            }
            a
        }
        Some(other) => {
            return Err(Error::format(
                path,
                0,
                format!(
                    "general.alignment must be a u32, found a {}",
                    other.value_type().name()
                ),
            ))
        }
    };

    Ok(alignment)
}

fn align_up(v: u64, alignment: u64) -> Option<u64> {
    // alignment is a power of two (checked when read).
    Some(v.checked_add(alignment - 1)? & !(alignment - 1))
}

impl GgufFile {
    /// Map `path` and parse its header.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::from_mapped(MappedFile::open(path)?)
    }

    /// Parse the header of an already mapped file.
    pub fn from_mapped(map: MappedFile) -> Result<Self> {
        let path = map.path().to_path_buf();
        let buf = map.bytes();
        let mut c = Cursor {
            buf,
            pos: 0,
            order: ByteOrder::Little,
            path: &path,
        };
        let version = c.magic_and_version()?;
        let byte_order = c.order;
        let n_tensors = c.count("tensor count", MAX_TENSORS, "MAX_TENSORS")?;
        let n_kv = c.count("metadata count", MAX_KV, "MAX_KV")?;
        let (metadata, metadata_index) = c.metadata(n_kv)?;
        let alignment = alignment(&path, &metadata, &metadata_index)?;
        let (mut tensors, tensor_index) = c.tensor_infos(n_tensors, alignment)?;

        let header_end = c.pos as u64;
        let data_offset = align_up(header_end, alignment)
            .ok_or_else(|| Error::format(&path, header_end, "data offset overflows"))?;
        let data_len = (buf.len() as u64).saturating_sub(data_offset);
        Self::place_tensors(&path, &mut tensors, data_offset, data_len, alignment)?;

        Ok(GgufFile {
            map,
            version,
            byte_order,
            alignment,
            data_offset,
            metadata,
            metadata_index,
            tensors,
            tensor_index,
        })
    }

    /// Size every tensor, resolve id 42, and check bounds and overlaps.
    fn place_tensors(
        path: &Path,
        tensors: &mut [GgufTensorInfo],
        data_offset: u64,
        data_len: u64,
        alignment: u64,
    ) -> Result<()> {
        let (mut order, span) = byte_spans(tensors, data_len);
        resolve_type_42(path, tensors, &span, data_offset, alignment)?;
        size_within_data(path, tensors, data_offset, data_len)?;
        check_overlaps(path, tensors, &mut order)
    }

    pub fn path(&self) -> &Path {
        self.map.path()
    }

    /// The mapping, shared with any view that must outlive this reader.
    pub fn mapped(&self) -> &MappedFile {
        &self.map
    }

    /// Metadata in file order.
    pub fn metadata(&self) -> &[(String, GgufValue)] {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// A string value's text (lossy only if the file holds invalid UTF-8).
    pub fn str_lossy(&self, span: Span) -> std::borrow::Cow<'_, str> {
        String::from_utf8_lossy(self.span_bytes(span))
    }

    /// A string value's bytes.
    pub fn span_bytes(&self, span: Span) -> &[u8] {
        // Spans are produced by the parser from in-bounds ranges of this same mapping.
        &self.map.bytes()[span.offset..span.offset + span.len]
    }

    /// A metadata string by key (None if absent or not a string).
    pub fn get_str(&self, key: &str) -> Option<std::borrow::Cow<'_, str>> {
        match self.get(key)? {
            GgufValue::String(s) => Some(self.str_lossy(*s)),
            _ => None,
        }
    }

    /// Element `index` of a scalar array (None for string/array elements or out of range).
    pub fn array_scalar(&self, arr: &GgufArray, index: usize) -> Option<GgufValue> {
        let ArrayItems::Scalars(span) = &arr.items else {
            return None;
        };
        let size = arr.elem.fixed_size()?;
        if index >= arr.len {
            return None;
        }
        let b = &self.span_bytes(*span)[index * size..(index + 1) * size];
        decode_scalar(arr.elem, b, self.byte_order)
    }

    /// Tensor infos in file order.
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    pub fn tensor_index(&self, name: &str) -> Option<usize> {
        self.tensor_index.get(name).copied()
    }

    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensor_index(name).map(|i| &self.tensors[i])
    }

    /// A tensor's bytes by index (validated in bounds at open).
    pub fn tensor_data(&self, index: usize) -> Option<&[u8]> {
        let t = self.tensors.get(index)?;
        if t.nbytes == 0 {
            // An empty tensor may sit at the (padded) data start past the end of a header-only file.
            return Some(&[]);
        }
        self.map
            .bytes()
            .get(t.abs_offset as usize..(t.abs_offset + t.nbytes) as usize)
    }

    /// A tensor's bytes by name.
    pub fn tensor_data_by_name(&self, name: &str) -> Option<&[u8]> {
        self.tensor_data(self.tensor_index(name)?)
    }
}

/// Decode one fixed-size value of type `ty` from its `ty.fixed_size()` bytes (None for string,
/// array, or a slice of the wrong length).
pub fn decode_scalar(ty: GgufValueType, b: &[u8], order: ByteOrder) -> Option<GgufValue> {
    if Some(b.len()) != ty.fixed_size() {
        return None;
    }
    macro_rules! num {
        ($t:ty) => {{
            let a = b.try_into().ok()?;
            match order {
                ByteOrder::Little => <$t>::from_le_bytes(a),
                ByteOrder::Big => <$t>::from_be_bytes(a),
            }
        }};
    }
    use GgufValueType as T;
    Some(match ty {
        T::U8 => GgufValue::U8(b[0]),
        T::I8 => GgufValue::I8(b[0] as i8),
        T::Bool => GgufValue::Bool(b[0] != 0),
        T::U16 => GgufValue::U16(num!(u16)),
        T::I16 => GgufValue::I16(num!(i16)),
        T::U32 => GgufValue::U32(num!(u32)),
        T::I32 => GgufValue::I32(num!(i32)),
        T::F32 => GgufValue::F32(num!(f32)),
        T::U64 => GgufValue::U64(num!(u64)),
        T::I64 => GgufValue::I64(num!(i64)),
        T::F64 => GgufValue::F64(num!(f64)),
        T::String | T::Array => return None,
    })
}
