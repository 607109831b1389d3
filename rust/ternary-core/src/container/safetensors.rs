//! Zero-copy safetensors reader: single files and sharded checkpoints (`*.safetensors.index.json`).
//!
//! Validation follows the `safetensors` crate, in one place ([`SafetensorsFile::from_mapped`]):
//! an 8-byte little-endian header length no larger than [`MAX_HEADER_SIZE`], a UTF-8 JSON object
//! header, every tensor's `data_offsets` contiguous from 0 in offset order with a size equal to
//! `numel × bits / 8`, and the data section ending exactly at the end of the file. Tensor data is
//! never read at open. Offsets need not be aligned to the dtype (MLX writes such files); readers
//! that need aligned values copy in that case.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::limits::*;
use super::mapping::MappedFile;
use crate::{Error, Result};

/// Bytes of the little-endian `u64` header length at the start of every safetensors file.
pub const HEADER_LEN_BYTES: u64 = 8;

/// Every dtype the `safetensors` crate (0.8) defines.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    BOOL,
    F4,
    F6_E2M3,
    F6_E3M2,
    U8,
    I8,
    F8_E5M2,
    F8_E4M3,
    F8_E8M0,
    F8_E4M3FNUZ,
    F8_E5M2FNUZ,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    C64,
    F64,
    I64,
    U64,
}

pub const ALL_DTYPES: &[Dtype] = &[
    Dtype::BOOL,
    Dtype::F4,
    Dtype::F6_E2M3,
    Dtype::F6_E3M2,
    Dtype::U8,
    Dtype::I8,
    Dtype::F8_E5M2,
    Dtype::F8_E4M3,
    Dtype::F8_E8M0,
    Dtype::F8_E4M3FNUZ,
    Dtype::F8_E5M2FNUZ,
    Dtype::I16,
    Dtype::U16,
    Dtype::F16,
    Dtype::BF16,
    Dtype::I32,
    Dtype::U32,
    Dtype::F32,
    Dtype::C64,
    Dtype::F64,
    Dtype::I64,
    Dtype::U64,
];

impl Dtype {
    pub const fn name(self) -> &'static str {
        use Dtype::*;
        match self {
            BOOL => "BOOL",
            F4 => "F4",
            F6_E2M3 => "F6_E2M3",
            F6_E3M2 => "F6_E3M2",
            U8 => "U8",
            I8 => "I8",
            F8_E5M2 => "F8_E5M2",
            F8_E4M3 => "F8_E4M3",
            F8_E8M0 => "F8_E8M0",
            F8_E4M3FNUZ => "F8_E4M3FNUZ",
            F8_E5M2FNUZ => "F8_E5M2FNUZ",
            I16 => "I16",
            U16 => "U16",
            F16 => "F16",
            BF16 => "BF16",
            I32 => "I32",
            U32 => "U32",
            F32 => "F32",
            C64 => "C64",
            F64 => "F64",
            I64 => "I64",
            U64 => "U64",
        }
    }

    /// Bits per element (sub-byte types pack several elements per byte).
    pub const fn bits(self) -> u64 {
        use Dtype::*;
        match self {
            F4 => 4,
            F6_E2M3 | F6_E3M2 => 6,
            BOOL | U8 | I8 | F8_E5M2 | F8_E4M3 | F8_E8M0 | F8_E4M3FNUZ | F8_E5M2FNUZ => 8,
            I16 | U16 | F16 | BF16 => 16,
            I32 | U32 | F32 => 32,
            C64 | F64 | I64 | U64 => 64,
        }
    }

    pub fn from_name(name: &str) -> Option<Dtype> {
        ALL_DTYPES.iter().copied().find(|d| d.name() == name)
    }

    /// Bytes of `numel` elements, or None when they do not fill whole bytes or the size overflows.
    pub fn bytes_for(self, numel: u64) -> Option<u64> {
        let bits = numel.checked_mul(self.bits())?;
        (bits % 8 == 0).then_some(bits / 8)
    }
}

/// One tensor of a safetensors file, validated.
#[derive(Debug, Clone)]
pub struct SafetensorsTensorInfo {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    /// `data_offsets[0]`, relative to the data section.
    pub data_start: u64,
    /// Absolute offset in the file.
    pub abs_offset: u64,
    pub nbytes: u64,
}

/// An open safetensors file.
#[derive(Debug)]
pub struct SafetensorsFile {
    map: MappedFile,
    pub header_size: u64,
    metadata: Option<BTreeMap<String, String>>,
    /// In data-offset order (the order the bytes appear in the file).
    tensors: Vec<SafetensorsTensorInfo>,
    index: HashMap<String, usize>,
}

/// A serde error's message without the " at line L column C" serde_json appends (the outer error
/// reports the position once).
fn without_position(e: &impl std::fmt::Display) -> String {
    let msg = e.to_string();
    match msg.rfind(" at line ") {
        Some(i) => msg[..i].to_string(),
        None => msg,
    }
}

/// A `*.safetensors.index.json` as the JSON gives it.
#[derive(serde::Deserialize)]
struct RawIndex {
    weight_map: Option<HashMap<String, String>>,
    metadata: Option<Value>,
}

/// One header entry as the JSON gives it (validated after parsing).
#[derive(serde::Deserialize)]
struct RawTensor {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

/// The whole JSON header: `__metadata__` plus tensors in the order the JSON lists them.
struct RawHeader {
    metadata: Option<BTreeMap<String, String>>,
    tensors: Vec<(String, RawTensor)>,
}

impl<'de> serde::Deserialize<'de> for RawHeader {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct HeaderVisitor;
        impl<'de> serde::de::Visitor<'de> for HeaderVisitor {
            type Value = RawHeader;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object of tensor entries and an optional __metadata__")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<RawHeader, A::Error> {
                use serde::de::Error as _;
                let mut h = RawHeader {
                    metadata: None,
                    tensors: Vec::new(),
                };
                while let Some(key) = map.next_key::<String>()? {
                    if key == "__metadata__" {
                        let m = map.next_value().map_err(|e| {
                            A::Error::custom(format!(
                                "__metadata__ must be an object of strings: {}",
                                without_position(&e)
                            ))
                        })?;
                        h.metadata = Some(m);
                    } else {
                        let t: RawTensor = map.next_value().map_err(|e| {
                            A::Error::custom(format!(
                                "tensor '{key}': {} (an entry is {{\"dtype\": str, \"shape\": [int], \"data_offsets\": [int, int]}})",
                                without_position(&e)
                            ))
                        })?;
                        h.tensors.push((key, t));
                    }
                }
                Ok(h)
            }
        }
        d.deserialize_map(HeaderVisitor)
    }
}

/// The header length and the JSON text it covers, refused when the file cannot hold them, the text
/// is not UTF-8 or not a JSON object.
fn header_text<'b>(path: &Path, buf: &'b [u8]) -> Result<(u64, &'b str)> {
    let err = |offset: u64, what: String| Error::format(path, offset, what);
    if (buf.len() as u64) < HEADER_LEN_BYTES {
        return Err(err(
            0,
            format!(
                "file of {} bytes is too small for the 8-byte header length",
                buf.len()
            ),
        ));
    }
    let n = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes"));
    if n > MAX_HEADER_SIZE {
        return Err(err(
            0,
            format!("header size {n} exceeds MAX_HEADER_SIZE = {MAX_HEADER_SIZE}"),
        ));
    }
    let data_start = HEADER_LEN_BYTES + n; // n ≤ MAX_HEADER_SIZE: no overflow
    if data_start > buf.len() as u64 {
        return Err(err(
            0,
            format!(
                "header size {n} runs past the end of the file ({} bytes)",
                buf.len()
            ),
        ));
    }
    let text = std::str::from_utf8(&buf[8..data_start as usize]).map_err(|e| {
        err(
            8 + e.valid_up_to() as u64,
            format!("header is not valid UTF-8: {e}"),
        )
    })?;
    if !text.starts_with('{') {
        return Err(err(
            8,
            "header does not start with '{' (not a JSON object)".into(),
        ));
    }
    Ok((n, text))
}

fn parse_header(path: &Path, text: &str) -> Result<RawHeader> {
    let err = |offset: u64, what: String| Error::format(path, offset, what);
    // Typed parse (no intermediate JSON tree): this is most of the cost of opening a shard.
    serde_json::from_str(text).map_err(|e| {
        // Headers are one line in practice, so line 1's column is the byte offset in the JSON.
        let at = if e.line() == 1 {
            HEADER_LEN_BYTES + (e.column() as u64).saturating_sub(1)
        } else {
            HEADER_LEN_BYTES
        };
        err(
            at,
            format!("header is not a valid safetensors JSON header: {e}"),
        )
    })
}

/// One header entry, checked: a known dtype, at most MAX_SAFETENSORS_DIMS dims, and data offsets
/// that span exactly its bytes.
fn tensor_info(path: &Path, name: String, entry: RawTensor) -> Result<SafetensorsTensorInfo> {
    let err = |offset: u64, what: String| Error::format(path, offset, what);
    let bad = |what: &str| err(8, format!("tensor '{name}': {what}"));
    let dtype = Dtype::from_name(&entry.dtype).ok_or_else(|| Error::UnsupportedType {
        file: path.display().to_string(),
        tensor: name.clone(),
        what: format!("safetensors dtype '{}'", entry.dtype),
        supported: ALL_DTYPES
            .iter()
            .map(|d| d.name())
            .collect::<Vec<_>>()
            .join(", "),
    })?;
    let shape = entry.shape;
    if shape.len() > MAX_SAFETENSORS_DIMS {
        return Err(bad(&format!(
            "{} dims exceed MAX_SAFETENSORS_DIMS = {MAX_SAFETENSORS_DIMS}",
            shape.len()
        )));
    }
    let offs = entry.data_offsets;
    let numel = shape
        .iter()
        .try_fold(1u64, |a, &d| {
            a.checked_mul(d).filter(|&n| n <= MAX_ELEMENTS)
        })
        .ok_or_else(|| bad("element count overflows"))?;
    let nbytes = dtype.bytes_for(numel).ok_or_else(|| {
        bad(&format!(
            "{numel} {} elements do not fill whole bytes",
            dtype.name()
        ))
    })?;
    if offs.1 < offs.0 || offs.1 - offs.0 != nbytes {
        return Err(bad(&format!(
            "data_offsets [{}, {}] do not span the {nbytes} bytes of {}{shape:?}",
            offs.0,
            offs.1,
            dtype.name()
        )));
    }
    Ok(SafetensorsTensorInfo {
        name,
        dtype,
        shape,
        data_start: offs.0,
        abs_offset: 0,
        nbytes,
    })
}

fn check_unique_names(path: &Path, tensors: &[SafetensorsTensorInfo]) -> Result<()> {
    let err = |offset: u64, what: String| Error::format(path, offset, what);
    let mut seen = std::collections::HashSet::with_capacity(tensors.len());
    if let Some(dup) = tensors.iter().find(|t| !seen.insert(t.name.as_str())) {
        return Err(err(
            8,
            format!("duplicate tensor name '{}' in the header", dup.name),
        ));
    }

    Ok(())
}

/// Sort the tensors by their data and check that they cover the data section contiguously from 0,
/// without gaps or overlaps, ending exactly at the end of the file.
fn place_contiguously(
    path: &Path,
    tensors: &mut [SafetensorsTensorInfo],
    data_start: u64,
    data_len: u64,
) -> Result<()> {
    let err = |offset: u64, what: String| Error::format(path, offset, what);
    // By (start, end) like the safetensors crate, so an empty tensor sorts before one sharing its start.
    tensors
        .sort_by(|a, b| (a.data_start, a.nbytes, &a.name).cmp(&(b.data_start, b.nbytes, &b.name)));
    let mut expected = 0u64;
    for t in tensors.iter_mut() {
        if t.data_start != expected {
            return Err(err(
                data_start.saturating_add(t.data_start),
                format!(
                    "tensor '{}': data starts at {} but the previous tensor ends at {expected} (offsets must be contiguous and non-overlapping)",
                    t.name, t.data_start
                ),
            ));
        }
        expected = t.data_start + t.nbytes; // ≤ data_len checked next
        if expected > data_len {
            return Err(err(
                data_start.saturating_add(t.data_start),
                format!(
                    "tensor '{}': {} bytes at data offset {} run past the end of the file (data section holds {data_len} bytes)",
                    t.name, t.nbytes, t.data_start
                ),
            ));
        }
        t.abs_offset = data_start + t.data_start;
    }
    if expected != data_len {
        return Err(err(
            data_start + expected,
            format!("tensors cover {expected} bytes but the data section holds {data_len} bytes"),
        ));
    }
    Ok(())
}

impl SafetensorsFile {
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::from_mapped(MappedFile::open(path)?)
    }

    pub fn from_mapped(map: MappedFile) -> Result<Self> {
        let path = map.path().to_path_buf();
        let buf = map.bytes();
        let (n, text) = header_text(&path, buf)?;
        let header = parse_header(&path, text)?;
        let data_start = HEADER_LEN_BYTES + n; // checked against the file length by header_text
        let metadata = header.metadata;
        let mut tensors = header
            .tensors
            .into_iter()
            .map(|(name, entry)| tensor_info(&path, name, entry))
            .collect::<Result<Vec<_>>>()?;
        check_unique_names(&path, &tensors)?;
        place_contiguously(
            &path,
            &mut tensors,
            data_start,
            buf.len() as u64 - data_start,
        )?;
        let index = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(SafetensorsFile {
            map,
            header_size: n,
            metadata,
            tensors,
            index,
        })
    }

    pub fn path(&self) -> &Path {
        self.map.path()
    }

    pub fn mapped(&self) -> &MappedFile {
        &self.map
    }

    /// The `__metadata__` map, if present.
    pub fn metadata(&self) -> Option<&BTreeMap<String, String>> {
        self.metadata.as_ref()
    }

    /// Tensors in the order their bytes appear in the file.
    pub fn tensors(&self) -> &[SafetensorsTensorInfo] {
        &self.tensors
    }

    pub fn tensor_info(&self, name: &str) -> Option<&SafetensorsTensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// A tensor's bytes (validated in bounds at open).
    pub fn tensor_data(&self, name: &str) -> Option<&[u8]> {
        let t = self.tensor_info(name)?;
        if t.nbytes == 0 {
            // An empty tensor may sit at the (padded) data start past the end of a header-only file.
            return Some(&[]);
        }
        self.map
            .bytes()
            .get(t.abs_offset as usize..(t.abs_offset + t.nbytes) as usize)
    }
}

/// A checkpoint: one safetensors file or the shards of an index.
#[derive(Debug)]
pub struct SafetensorsCheckpoint {
    /// The index file, when opened from one.
    pub index_path: Option<PathBuf>,
    /// The index's `metadata` object (e.g. `total_size`), when present.
    pub index_metadata: Option<Value>,
    shards: Vec<SafetensorsFile>,
    /// (shard, tensor index in shard) in order: shards in index order, tensors in file order.
    order: Vec<(usize, usize)>,
    by_name: HashMap<String, (usize, usize)>,
}

impl SafetensorsCheckpoint {
    /// One `.safetensors` file.
    pub fn open_file(path: impl AsRef<Path>) -> Result<Self> {
        Self::from_shards(None, None, vec![SafetensorsFile::open(path)?])
    }

    /// Open the shards named by a `*.safetensors.index.json`, checking every tensor its `weight_map`
    /// names is in the shard it names. Shard names must be plain file names next to the index.
    pub fn open_index(index_path: impl AsRef<Path>) -> Result<Self> {
        let index_path = index_path.as_ref().to_path_buf();
        let ferr = |what: String| Error::format(&index_path, 0, what);
        let size = std::fs::metadata(&index_path)
            .map_err(|e| Error::io(&index_path, e))?
            .len();
        if size > MAX_INDEX_SIZE {
            return Err(ferr(format!(
                "index of {size} bytes exceeds MAX_INDEX_SIZE = {MAX_INDEX_SIZE}"
            )));
        }
        let text = std::fs::read(&index_path).map_err(|e| Error::io(&index_path, e))?;
        let index: RawIndex = serde_json::from_slice(&text).map_err(|e| {
            ferr(format!(
                "not a valid index (JSON with a 'weight_map' of tensor name -> shard file): {e} (line {}, column {})",
                e.line(),
                e.column()
            ))
        })?;
        let weight_map = index
            .weight_map
            .ok_or_else(|| ferr("missing 'weight_map' object".into()))?;
        let dir = index_path
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default();
        let mut shard_names: Vec<String> = Vec::new();
        let mut shard_ids: HashMap<String, usize> = HashMap::new();
        let mut expected: Vec<(String, usize)> = Vec::with_capacity(weight_map.len());
        for (tensor, shard) in weight_map {
            if shard.is_empty()
                || shard.contains('/')
                || shard.contains('\\')
                || shard == "."
                || shard == ".."
            {
                return Err(ferr(format!(
                    "weight_map['{tensor}'] = '{shard}' is not a plain file name next to the index"
                )));
            }
            let k = match shard_ids.get(&shard) {
                Some(&k) => k,
                None => {
                    if shard_names.len() >= MAX_SHARDS {
                        return Err(ferr(format!("more than MAX_SHARDS = {MAX_SHARDS} shards")));
                    }
                    shard_ids.insert(shard.clone(), shard_names.len());
                    shard_names.push(shard);
                    shard_names.len() - 1
                }
            };
            expected.push((tensor, k));
        }
        // Shards in name order (model-00001-of-…, model-00002-of-…).
        let mut sorted: Vec<usize> = (0..shard_names.len()).collect();
        sorted.sort_by(|&a, &b| shard_names[a].cmp(&shard_names[b]));
        let mut rank = vec![0usize; shard_names.len()];
        for (r, &k) in sorted.iter().enumerate() {
            rank[k] = r;
        }
        let mut shards = Vec::with_capacity(sorted.len());
        for &k in &sorted {
            let p = dir.join(&shard_names[k]);
            if !p.is_file() {
                let example = expected
                    .iter()
                    .find(|(_, s)| *s == k)
                    .map(|(t, _)| t.as_str())
                    .unwrap_or("");
                return Err(ferr(format!(
                    "shard '{}' (for tensor '{example}') does not exist in {}",
                    shard_names[k],
                    dir.display()
                )));
            }
            shards.push(SafetensorsFile::open(&p)?);
        }
        let index_metadata = index.metadata;
        let ckpt = Self::from_shards(Some(index_path.clone()), index_metadata, shards)?;
        for (tensor, k) in &expected {
            let found = ckpt.by_name.get(tensor).map(|&(s, _)| s);
            if found != Some(rank[*k]) {
                return Err(ferr(format!(
                    "weight_map says tensor '{tensor}' is in shard '{}', but it is not there",
                    shard_names[*k]
                )));
            }
        }
        Ok(ckpt)
    }

    fn from_shards(
        index_path: Option<PathBuf>,
        index_metadata: Option<Value>,
        shards: Vec<SafetensorsFile>,
    ) -> Result<Self> {
        let mut order = Vec::new();
        let mut by_name = HashMap::new();
        for (s, f) in shards.iter().enumerate() {
            for (i, t) in f.tensors().iter().enumerate() {
                if let Some((prev, _)) = by_name.insert(t.name.clone(), (s, i)) {
                    return Err(Error::format(
                        f.path(),
                        t.abs_offset,
                        format!(
                            "tensor '{}' is also in shard {}",
                            t.name,
                            shards[prev].path().display()
                        ),
                    ));
                }
                order.push((s, i));
            }
        }
        Ok(SafetensorsCheckpoint {
            index_path,
            index_metadata,
            shards,
            order,
            by_name,
        })
    }

    pub fn shards(&self) -> &[SafetensorsFile] {
        &self.shards
    }

    /// (shard index, tensor) pairs in checkpoint order.
    pub fn tensors(&self) -> impl Iterator<Item = (usize, &SafetensorsTensorInfo)> + '_ {
        self.order
            .iter()
            .map(|&(s, i)| (s, &self.shards[s].tensors()[i]))
    }

    pub fn len(&self) -> usize {
        self.order.len()
    }

    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// (shard index, tensor info) by name.
    pub fn tensor_info(&self, name: &str) -> Option<(usize, &SafetensorsTensorInfo)> {
        let &(s, i) = self.by_name.get(name)?;
        Some((s, &self.shards[s].tensors()[i]))
    }

    pub fn tensor_data(&self, name: &str) -> Option<&[u8]> {
        let &(s, _) = self.by_name.get(name)?;
        self.shards[s].tensor_data(name)
    }

    /// Merged `__metadata__` of all shards (first shard wins on conflicting keys), if any has one.
    pub fn metadata(&self) -> Option<BTreeMap<String, String>> {
        let mut out: Option<BTreeMap<String, String>> = None;
        for f in &self.shards {
            if let Some(m) = f.metadata() {
                let o = out.get_or_insert_with(BTreeMap::new);
                for (k, v) in m {
                    o.entry(k.clone()).or_insert_with(|| v.clone());
                }
            }
        }
        out
    }
}
