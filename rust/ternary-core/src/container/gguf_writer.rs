//! Streaming GGUF v3 writer (little-endian).
//!
//! Metadata and every tensor's info (name, dims, type id, byte size) are given up front; the header
//! is written when the first tensor data arrives, then tensor data is streamed one tensor at a time,
//! in the order the infos were added, in as many chunks as the caller likes. Only a `BufWriter`'s
//! buffer is held in memory, so a converter's peak memory is one tensor (or one chunk), not the file.
//! [`GgufWriter::finish`] checks that every tensor received exactly its declared bytes.

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::ggml_types::GgmlType;
use super::gguf::{GgufValueType, GGUF_MAGIC};
use super::limits::*;
use crate::{Error, Result};

/// The GGUF version this writer produces.
pub const GGUF_WRITE_VERSION: u32 = 3;

/// An owned metadata value to write.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    U64(u64),
    I64(i64),
    F64(f64),
    /// Element type and elements; every element must be of that type (arrays may nest).
    Array(GgufValueType, Vec<MetaValue>),
}

impl MetaValue {
    pub fn value_type(&self) -> GgufValueType {
        use GgufValueType as T;
        match self {
            MetaValue::U8(_) => T::U8,
            MetaValue::I8(_) => T::I8,
            MetaValue::U16(_) => T::U16,
            MetaValue::I16(_) => T::I16,
            MetaValue::U32(_) => T::U32,
            MetaValue::I32(_) => T::I32,
            MetaValue::F32(_) => T::F32,
            MetaValue::Bool(_) => T::Bool,
            MetaValue::String(_) => T::String,
            MetaValue::U64(_) => T::U64,
            MetaValue::I64(_) => T::I64,
            MetaValue::F64(_) => T::F64,
            MetaValue::Array(..) => T::Array,
        }
    }

    fn check(&self, key: &str, depth: usize) -> Result<()> {
        match self {
            MetaValue::String(s) if s.len() as u64 > MAX_STRING_LEN => {
                Err(Error::invalid(format!(
                "metadata '{key}': string of {} bytes exceeds MAX_STRING_LEN = {MAX_STRING_LEN}",
                s.len()
            )))
            }
            MetaValue::Array(elem, items) => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(Error::invalid(format!(
                        "metadata '{key}': arrays nested deeper than MAX_ARRAY_DEPTH = {MAX_ARRAY_DEPTH}"
                    )));
                }
                if items.len() as u64 > MAX_ARRAY_LEN {
                    return Err(Error::invalid(format!(
                        "metadata '{key}': array of {} elements exceeds MAX_ARRAY_LEN = {MAX_ARRAY_LEN}",
                        items.len()
                    )));
                }
                for (i, it) in items.iter().enumerate() {
                    if it.value_type() != *elem {
                        return Err(Error::invalid(format!(
                            "metadata '{key}': array element {i} is a {}, but the array holds {}",
                            it.value_type().name(),
                            elem.name()
                        )));
                    }
                    it.check(key, depth + 1)?;
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    fn write_to(&self, out: &mut Vec<u8>) {
        match self {
            MetaValue::U8(v) => out.push(*v),
            MetaValue::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::Bool(v) => out.push(u8::from(*v)),
            MetaValue::String(s) => write_string(out, s),
            MetaValue::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::Array(elem, items) => {
                out.extend_from_slice(&(*elem as u32).to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                // Nested arrays carry their own element type and length, written by the same call.
                for it in items {
                    it.write_to(out);
                }
            }
        }
    }
}

fn write_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

#[derive(Debug)]
struct PlannedTensor {
    name: String,
    ne: Vec<u64>,
    type_id: u32,
    nbytes: u64,
    offset: u64,
}

/// Streaming GGUF writer; see the module docs for the call order.
pub struct GgufWriter {
    path: PathBuf,
    out: Option<BufWriter<File>>,
    alignment: u64,
    kv: Vec<(String, MetaValue)>,
    keys: HashSet<String>,
    tensors: Vec<PlannedTensor>,
    names: HashSet<String>,
    data_size: u64,
    header_written: bool,
    /// Index of the tensor now receiving data and how many of its bytes arrived.
    current: usize,
    current_written: u64,
}

fn align_up(v: u64, a: u64) -> Option<u64> {
    Some(v.checked_add(a - 1)? / a * a)
}

impl GgufWriter {
    /// Create (truncate) `path`. `alignment` must be a power of two; when it differs from the default
    /// 32 a `general.alignment` u32 is added to the metadata (unless the caller adds it).
    pub fn create(path: impl AsRef<Path>, alignment: u64) -> Result<Self> {
        if alignment == 0
            || !alignment.is_power_of_two()
            || alignment > MAX_ALIGNMENT
            || alignment > u64::from(u32::MAX)
        {
            return Err(Error::invalid(format!(
                "alignment {alignment} must be a power of two between 1 and MAX_ALIGNMENT = {MAX_ALIGNMENT}"
            )));
        }
        let path = path.as_ref().to_path_buf();
        let file = File::create(&path).map_err(|e| Error::io(&path, e))?;
        Ok(GgufWriter {
            path,
            out: Some(BufWriter::with_capacity(1 << 20, file)),
            alignment,
            kv: Vec::new(),
            keys: HashSet::new(),
            tensors: Vec::new(),
            names: HashSet::new(),
            data_size: 0,
            header_written: false,
            current: 0,
            current_written: 0,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn before_header(&self, what: &str) -> Result<()> {
        if self.header_written {
            return Err(Error::invalid(format!(
                "{}: cannot add {what} after tensor data has started",
                self.path.display()
            )));
        }
        Ok(())
    }

    /// Add one metadata key/value (keys must be unique).
    pub fn add_metadata(&mut self, key: &str, value: MetaValue) -> Result<()> {
        self.before_header("metadata")?;
        if key.len() as u64 > MAX_STRING_LEN {
            return Err(Error::invalid("metadata key exceeds MAX_STRING_LEN"));
        }
        value.check(key, 0)?;
        if key == "general.alignment" {
            match value {
                MetaValue::U32(a) if u64::from(a) == self.alignment => {}
                _ => {
                    return Err(Error::invalid(format!(
                        "general.alignment must be the u32 {} given when the writer was created, got {value:?}",
                        self.alignment
                    )))
                }
            }
        }
        if !self.keys.insert(key.to_owned()) {
            return Err(Error::invalid(format!("duplicate metadata key '{key}'")));
        }
        self.kv.push((key.to_owned(), value));
        Ok(())
    }

    /// Declare a tensor: `ne` in GGUF order (`ne[0]` fastest, i.e. the PyTorch shape reversed), its
    /// ggml type id and byte size. For ids ternary_rs knows, the size must match the dims (id 42:
    /// either variant); other ids are written as given.
    pub fn add_tensor_info(
        &mut self,
        name: &str,
        ne: &[u64],
        type_id: u32,
        nbytes: u64,
    ) -> Result<()> {
        self.before_header("tensor infos")?;
        let what = format!("tensor '{name}'");
        if name.len() as u64 > MAX_TENSOR_NAME_LEN {
            return Err(Error::invalid(format!(
                "{what}: name exceeds MAX_TENSOR_NAME_LEN = {MAX_TENSOR_NAME_LEN}"
            )));
        }
        if ne.len() as u64 > MAX_DIMS {
            return Err(Error::invalid(format!(
                "{what}: {} dims exceed MAX_DIMS = {MAX_DIMS}",
                ne.len()
            )));
        }
        if self.tensors.len() as u64 >= MAX_TENSORS {
            return Err(Error::invalid(format!(
                "more than MAX_TENSORS = {MAX_TENSORS} tensors"
            )));
        }
        let n = ne
            .iter()
            .try_fold(1u64, |a, &d| {
                a.checked_mul(d).filter(|&n| n <= MAX_ELEMENTS)
            })
            .ok_or_else(|| Error::invalid(format!("{what}: element count overflows")))?;
        let candidates: Vec<GgmlType> = match type_id {
            42 => vec![GgmlType::Q2_0, GgmlType::Q2_0_G128],
            id => GgmlType::from_id(id).into_iter().collect(),
        };
        let ne0 = ne.first().copied().unwrap_or(1);
        if !candidates.is_empty()
            && !candidates
                .iter()
                .any(|t| ne0 % t.block_size() == 0 && t.tensor_bytes(n) == Some(nbytes))
        {
            let expected: Vec<String> = candidates
                .iter()
                .map(
                    |t| match t.tensor_bytes(n).filter(|_| ne0 % t.block_size() == 0) {
                        Some(b) => format!("{} needs {b} bytes", t.name()),
                        None => {
                            format!("{} needs ne[0] a multiple of {}", t.name(), t.block_size())
                        }
                    },
                )
                .collect();
            return Err(Error::invalid(format!(
                "{what}: ne {ne:?} with type id {type_id} and {nbytes} bytes is inconsistent ({})",
                expected.join("; ")
            )));
        }
        if !self.names.insert(name.to_owned()) {
            return Err(Error::invalid(format!("duplicate tensor name '{name}'")));
        }
        let offset = self.data_size;
        self.data_size = offset
            .checked_add(nbytes)
            .and_then(|e| align_up(e, self.alignment))
            .ok_or_else(|| Error::invalid(format!("{what}: data size overflows")))?;
        self.tensors.push(PlannedTensor {
            name: name.to_owned(),
            ne: ne.to_vec(),
            type_id,
            nbytes,
            offset,
        });
        Ok(())
    }

    fn out(&mut self) -> Result<&mut BufWriter<File>> {
        self.out.as_mut().ok_or_else(|| {
            Error::invalid(format!("{}: writer already finished", self.path.display()))
        })
    }

    fn io(&self, e: std::io::Error) -> Error {
        Error::io(&self.path, e)
    }

    fn write_all(&mut self, b: &[u8]) -> Result<()> {
        let r = self.out()?.write_all(b);
        r.map_err(|e| self.io(e))
    }

    fn write_header(&mut self) -> Result<()> {
        if self.alignment != DEFAULT_ALIGNMENT && !self.keys.contains("general.alignment") {
            let a = MetaValue::U32(self.alignment as u32);
            self.add_metadata("general.alignment", a)?;
        }
        let mut h = Vec::with_capacity(4096);
        h.extend_from_slice(&GGUF_MAGIC);
        h.extend_from_slice(&GGUF_WRITE_VERSION.to_le_bytes());
        h.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        h.extend_from_slice(&(self.kv.len() as u64).to_le_bytes());
        for (k, v) in &self.kv {
            write_string(&mut h, k);
            h.extend_from_slice(&(v.value_type() as u32).to_le_bytes());
            v.write_to(&mut h);
        }
        for t in &self.tensors {
            write_string(&mut h, &t.name);
            h.extend_from_slice(&(t.ne.len() as u32).to_le_bytes());
            for d in &t.ne {
                h.extend_from_slice(&d.to_le_bytes());
            }
            h.extend_from_slice(&t.type_id.to_le_bytes());
            h.extend_from_slice(&t.offset.to_le_bytes());
        }
        let padded = align_up(h.len() as u64, self.alignment)
            .ok_or_else(|| Error::invalid("header size overflows"))?;
        h.resize(padded as usize, 0);
        self.header_written = true;
        self.write_all(&h)?;
        self.skip_empty_tensors()
    }

    /// Zero-byte tensors need no data; step past them.
    fn skip_empty_tensors(&mut self) -> Result<()> {
        while self.current < self.tensors.len() && self.tensors[self.current].nbytes == 0 {
            self.current += 1;
        }
        Ok(())
    }

    /// Append `data` to tensor `name`'s bytes. Tensors must be written in the order their infos were
    /// added; a tensor may arrive in several chunks. Padding follows each completed tensor.
    pub fn write_tensor_data(&mut self, name: &str, data: &[u8]) -> Result<()> {
        if !self.header_written {
            self.write_header()?;
        }
        if data.is_empty() && self.names.contains(name) {
            return Ok(()); // nothing to append (e.g. a zero-size tensor)
        }
        let Some(t) = self.tensors.get(self.current) else {
            return Err(Error::invalid(format!(
                "{}: tensor '{name}': all declared tensors are already complete",
                self.path.display()
            )));
        };
        if t.name != name {
            return Err(Error::invalid(format!(
                "{}: got data for tensor '{name}' but the next tensor to write is '{}' (write in the order the infos were added)",
                self.path.display(),
                t.name
            )));
        }
        let (nbytes, offset) = (t.nbytes, t.offset);
        let after = self.current_written.checked_add(data.len() as u64);
        if after.is_none_or(|a| a > nbytes) {
            return Err(Error::invalid(format!(
                "{}: tensor '{name}': {} more bytes would exceed its declared {nbytes} bytes ({} already written)",
                self.path.display(),
                data.len(),
                self.current_written
            )));
        }
        self.write_all(data)?;
        self.current_written += data.len() as u64;
        if self.current_written == nbytes {
            let pad = align_up(offset + nbytes, self.alignment).unwrap_or(offset + nbytes)
                - (offset + nbytes);
            self.write_all(&vec![0u8; pad as usize])?;
            self.current += 1;
            self.current_written = 0;
            self.skip_empty_tensors()?;
        }
        Ok(())
    }

    /// Flush and close; errors if any declared tensor did not receive all its bytes.
    pub fn finish(&mut self) -> Result<()> {
        if !self.header_written {
            self.write_header()?;
        }
        finish_stream(
            &self.path,
            &mut self.out,
            &self.tensors,
            self.current,
            self.current_written,
        )
    }
}

/// A tensor a streaming writer declared up front: its name and byte count.
pub(super) trait Declared {
    fn name(&self) -> &str;
    fn nbytes(&self) -> u64;
}

impl Declared for PlannedTensor {
    fn name(&self) -> &str {
        &self.name
    }
    fn nbytes(&self) -> u64 {
        self.nbytes
    }
}

/// Flush and close a streaming writer, refusing when tensor `current` of `tensors` has not received all
/// its bytes (`written` so far): a file with a short tensor must never look finished.
pub(super) fn finish_stream<T: Declared>(
    path: &Path,
    out: &mut Option<BufWriter<File>>,
    tensors: &[T],
    current: usize,
    written: u64,
) -> Result<()> {
    if let Some(t) = tensors.get(current) {
        let (name, nbytes, total) = (t.name(), t.nbytes(), tensors.len());
        return Err(Error::invalid(format!(
            "{}: tensor '{name}' received {written} of its {nbytes} bytes ({current} of {total} tensors complete)",
            path.display(),
        )));
    }
    let out = out
        .take()
        .ok_or_else(|| Error::invalid(format!("{}: writer already finished", path.display())))?;
    out.into_inner()
        .map_err(|e| Error::io(path, e.into_error()))?;
    Ok(())
}
