//! A read-only memory map of a whole file, shared by the readers and every view they hand out.
//!
//! The map is behind an [`Arc`] so views (e.g. NumPy arrays in the bindings) can keep it alive after
//! the reader itself is dropped.
//!
//! Files can change under a reader. The map keeps the file open and remembers its identity (device,
//! inode, size, modification time) at open; [`MappedFile::check_unchanged`] says whether the bytes
//! read since are still those of the file at that path. A file that *shrinks* would raise SIGBUS on
//! access; [`super::sigbus`] turns that into zero pages plus a mark that `check_unchanged` reports, so
//! a conversion fails with an error naming the file instead of dying.

use std::fs::File;
use std::ops::Deref;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use super::sigbus;
use crate::{Error, Result};

/// The bytes behind a [`MappedFile`]: a map registered with the SIGBUS guard for as long as it
/// lives, or bytes held in memory ([`MappedFile::from_bytes`]).
pub struct SharedBytes(Storage);

enum Storage {
    Map { map: Mmap, slot: Option<usize> },
    Owned(Vec<u8>),
}

impl SharedBytes {
    fn guard_slot(&self) -> Option<usize> {
        match self.0 {
            Storage::Map { slot, .. } => slot,
            Storage::Owned(_) => None,
        }
    }
}

impl Deref for SharedBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.0 {
            Storage::Map { map, .. } => map,
            Storage::Owned(v) => v,
        }
    }
}

impl Drop for SharedBytes {
    fn drop(&mut self) {
        // Unregister before the map itself is unmapped (the field drops after this).
        if let Storage::Map {
            slot: Some(slot), ..
        } = self.0
        {
            sigbus::unregister(slot);
        }
    }
}

/// What identifies the file a map was made from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Identity {
    dev: u64,
    ino: u64,
    len: u64,
    mtime_ns: i128,
}

impl Identity {
    fn of(meta: &std::fs::Metadata) -> Self {
        Identity {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.len(),
            mtime_ns: meta.mtime() as i128 * 1_000_000_000 + meta.mtime_nsec() as i128,
        }
    }
}

/// A read-only map of one file. Empty files map to an empty slice.
#[derive(Clone)]
pub struct MappedFile {
    path: PathBuf,
    map: Option<Arc<SharedBytes>>,
    /// The open file and what it was at open (None for in-memory bytes, which cannot change).
    file: Option<(Arc<File>, Identity)>,
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
            // raises SIGBUS on access to the lost pages; the guard registered here turns that into
            // zero pages and a mark that `check_unchanged` reports (see the module docs).
            let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
            let slot = sigbus::register(map.as_ptr(), map.len());
            Some(Arc::new(SharedBytes(Storage::Map { map, slot })))
        };
        Ok(MappedFile {
            path,
            map,
            file: Some((Arc::new(file), Identity::of(&meta))),
        })
    }

    /// Bytes already in memory, read as if they were the file `path` (which is only a name for error
    /// messages): for tests, fuzzing and data that never was a file.
    pub fn from_bytes(path: impl Into<PathBuf>, bytes: Vec<u8>) -> Self {
        MappedFile {
            path: path.into(),
            map: (!bytes.is_empty()).then(|| Arc::new(SharedBytes(Storage::Owned(bytes)))),
            file: None,
        }
    }

    /// Whether the file is still the one that was mapped, unchanged: not truncated under the map,
    /// not resized or rewritten in place (size, modification time of the open file), not replaced
    /// or removed (device and inode at the path). Cheap (two `stat` calls): call it after reading a
    /// tensor and before trusting or committing anything derived from the bytes.
    pub fn check_unchanged(&self) -> Result<()> {
        let fail_at = |offset: u64, what: String| {
            Err(Error::format(
                &self.path,
                offset,
                format!(
                    "{what} while it was being read; its data cannot be trusted (read it again)"
                ),
            ))
        };
        let fail = |what: String| fail_at(0, what);
        let Some((file, was)) = &self.file else {
            return Ok(());
        };
        if let Some(offset) = self
            .map
            .as_ref()
            .and_then(|m| m.guard_slot())
            .and_then(sigbus::tripped)
        {
            return fail_at(
                offset,
                format!("the file shrank (of {} bytes mapped)", was.len),
            );
        }
        let now = Identity::of(&file.metadata().map_err(|e| Error::io(&self.path, e))?);
        if now.len != was.len {
            return fail(format!(
                "the file changed size from {} to {} bytes",
                was.len, now.len
            ));
        }
        if now.mtime_ns != was.mtime_ns {
            return fail("the file was modified".to_string());
        }
        match std::fs::metadata(&self.path) {
            Ok(m) if (m.dev(), m.ino()) == (was.dev, was.ino) => Ok(()),
            Ok(_) => fail("the file was replaced by another file".to_string()),
            Err(_) => fail("the file was removed or renamed".to_string()),
        }
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
    pub fn shared_map(&self) -> Option<Arc<SharedBytes>> {
        self.map.clone()
    }
}
