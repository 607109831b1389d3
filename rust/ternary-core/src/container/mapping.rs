//! A read-only memory map of a whole file, shared by the readers and every view they hand out.
//!
//! The map is behind an [`Arc`] so views (e.g. NumPy arrays in the bindings) can keep it alive after
//! the reader itself is dropped.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::{Error, Result};

/// A read-only map of one file. Empty files map to an empty slice.
#[derive(Clone)]
pub struct MappedFile {
    path: PathBuf,
    map: Option<Arc<Mmap>>,
}

impl std::fmt::Debug for MappedFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedFile")
            .field("path", &self.path)
            .field("len", &self.len())
            .finish()
    }
}

impl MappedFile {
    /// Map `path` read-only.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
        let meta = file.metadata().map_err(|e| Error::io(&path, e))?;
        if !meta.is_file() {
            return Err(Error::format(&path, 0, "not a regular file"));
        }
        // mmap(2) refuses zero-length maps; an empty file is simply an empty slice.
        let map = if meta.len() == 0 {
            None
        } else {
            // SAFETY: the map is read-only. Another process truncating the file while it is mapped
            // can still raise SIGBUS on access; that is inherent to memory maps (safetensors and
            // llama.cpp accept the same risk) and is why callers should not edit files being read.
            let m = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
            Some(Arc::new(m))
        };
        Ok(MappedFile { path, map })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        self.map.as_deref().map(|m| &m[..]).unwrap_or(&[])
    }

    pub fn len(&self) -> usize {
        self.bytes().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `len` bytes at `offset`, or a format error naming `what` when they are not all in the file.
    pub fn slice(&self, offset: u64, len: u64, what: &str) -> Result<&[u8]> {
        let end = offset.checked_add(len);
        match end {
            Some(end) if end <= self.len() as u64 => Ok(&self.bytes()[offset as usize..end as usize]),
            _ => Err(Error::format(
                &self.path,
                offset,
                format!(
                    "{what}: {len} bytes at offset {offset} run past the end of the file ({} bytes)",
                    self.len()
                ),
            )),
        }
    }

    /// The shared map itself (None for an empty file), for views that must outlive the reader.
    pub fn shared_map(&self) -> Option<Arc<Mmap>> {
        self.map.clone()
    }
}
