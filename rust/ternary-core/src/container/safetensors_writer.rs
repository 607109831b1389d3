//! Streaming safetensors writer.
//!
//! The header is built from the full list of (name, dtype, shape) given at creation and written at
//! once; data then follows tensor by tensor in that order (each tensor in as many chunks as the
//! caller likes). Offsets follow the given order with no gaps, as safetensors requires, so a dtype
//! is aligned in the file only if the tensors before it keep it so (give wider dtypes first, or keep
//! byte sizes multiples of 8). [`SafetensorsWriter::finish`] checks every tensor is complete.

use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::gguf_writer::{finish_stream, Declared};
use super::limits::*;
use super::safetensors::Dtype;
use crate::{Error, Result};

#[derive(Debug)]
struct Planned {
    name: String,
    nbytes: u64,
}

impl Declared for Planned {
    fn name(&self) -> &str {
        &self.name
    }
    fn nbytes(&self) -> u64 {
        self.nbytes
    }
}

pub struct SafetensorsWriter {
    path: PathBuf,
    out: Option<BufWriter<File>>,
    tensors: Vec<Planned>,
    current: usize,
    current_written: u64,
}

impl SafetensorsWriter {
    /// Create `path` and write its header for `tensors` (name, dtype, shape) and optional
    /// `__metadata__`.
    pub fn create(
        path: impl AsRef<Path>,
        tensors: &[(String, Dtype, Vec<u64>)],
        metadata: Option<&BTreeMap<String, String>>,
    ) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let mut header = serde_json::Map::new();
        if let Some(m) = metadata {
            let obj = m
                .iter()
                .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
                .collect();
            header.insert("__metadata__".into(), serde_json::Value::Object(obj));
        }
        let mut names = HashSet::new();
        let mut planned = Vec::with_capacity(tensors.len());
        let mut offset = 0u64;
        for (name, dtype, shape) in tensors {
            if name == "__metadata__" {
                return Err(Error::invalid("'__metadata__' cannot be a tensor name"));
            }
            if !names.insert(name.as_str()) {
                return Err(Error::invalid(format!("duplicate tensor name '{name}'")));
            }
            if shape.len() > MAX_SAFETENSORS_DIMS {
                return Err(Error::invalid(format!(
                    "tensor '{name}': too many dims ({})",
                    shape.len()
                )));
            }
            let numel = shape
                .iter()
                .try_fold(1u64, |a, &d| {
                    a.checked_mul(d).filter(|&n| n <= MAX_ELEMENTS)
                })
                .ok_or_else(|| {
                    Error::invalid(format!("tensor '{name}': element count overflows"))
                })?;
            let nbytes = dtype.bytes_for(numel).ok_or_else(|| {
                Error::invalid(format!(
                    "tensor '{name}': {numel} {} elements do not fill whole bytes",
                    dtype.name()
                ))
            })?;
            let end = offset
                .checked_add(nbytes)
                .ok_or_else(|| Error::invalid("total data size overflows"))?;
            header.insert(
                name.clone(),
                serde_json::json!({"dtype": dtype.name(), "shape": shape, "data_offsets": [offset, end]}),
            );
            planned.push(Planned {
                name: name.clone(),
                nbytes,
            });
            offset = end;
        }
        let mut text = serde_json::to_string(&serde_json::Value::Object(header))
            .map_err(|e| Error::invalid(format!("cannot serialise header: {e}")))?;
        // Pad with spaces so the data starts 8-byte aligned, as the safetensors crate does.
        while (text.len() + 8) % 8 != 0 {
            text.push(' ');
        }
        if text.len() as u64 > MAX_HEADER_SIZE {
            return Err(Error::invalid(format!(
                "header of {} bytes exceeds MAX_HEADER_SIZE = {MAX_HEADER_SIZE}",
                text.len()
            )));
        }
        let file = File::create(&path).map_err(|e| Error::io(&path, e))?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(&(text.len() as u64).to_le_bytes())
            .and_then(|_| out.write_all(text.as_bytes()))
            .map_err(|e| Error::io(&path, e))?;
        let mut w = SafetensorsWriter {
            path,
            out: Some(out),
            tensors: planned,
            current: 0,
            current_written: 0,
        };
        w.skip_empty();
        Ok(w)
    }

    fn skip_empty(&mut self) {
        while self.current < self.tensors.len() && self.tensors[self.current].nbytes == 0 {
            self.current += 1;
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Append `data` to tensor `name` (which must be the next incomplete tensor in the given order).
    pub fn write(&mut self, name: &str, data: &[u8]) -> Result<()> {
        let p = self.path.display().to_string();
        if data.is_empty() && self.tensors.iter().any(|t| t.name == name) {
            return Ok(()); // nothing to append (e.g. a zero-size tensor)
        }
        let Some(t) = self.tensors.get(self.current) else {
            return Err(Error::invalid(format!(
                "{p}: tensor '{name}': all declared tensors are already complete"
            )));
        };
        if t.name != name {
            return Err(Error::invalid(format!(
                "{p}: got data for tensor '{name}' but the next tensor to write is '{}' (write in the declared order)",
                t.name
            )));
        }
        let nbytes = t.nbytes;
        let after = self.current_written.checked_add(data.len() as u64);
        if after.is_none_or(|a| a > nbytes) {
            return Err(Error::invalid(format!(
                "{p}: tensor '{name}': {} more bytes would exceed its {nbytes} bytes ({} already written)",
                data.len(),
                self.current_written
            )));
        }
        let out = self
            .out
            .as_mut()
            .ok_or_else(|| Error::invalid(format!("{p}: writer already finished")))?;
        out.write_all(data).map_err(|e| Error::io(&self.path, e))?;
        self.current_written += data.len() as u64;
        if self.current_written == nbytes {
            self.current += 1;
            self.current_written = 0;
            self.skip_empty();
        }
        Ok(())
    }

    /// Flush and close; errors if any tensor is incomplete.
    pub fn finish(&mut self) -> Result<()> {
        finish_stream(
            &self.path,
            &mut self.out,
            &self.tensors,
            self.current,
            self.current_written,
        )
    }
}
