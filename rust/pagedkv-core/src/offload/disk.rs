//! A disk tier below host memory: chunks kept in one file of fixed-size slots
//! under a directory the caller names, bounded in bytes, evicted least recently
//! used first. Every slot carries a header (magic, the key, the payload's XXH3)
//! that a read checks: a corrupt or truncated slot is a miss, counted, its entry
//! dropped, never wrong KV.
//!
//! The tier owns only its file: created new in the directory (never an existing
//! path, never through a symlink), removed when the tier is dropped.
//!
//! Without a directory the tier keeps only its index: which chunks a disk of
//! `capacity_bytes` would hold and what it would evict, with no file and no
//! bytes moved (a simulator's disk; reads and writes take empty buffers).

use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use hashlink::LinkedHashMap;
use rustc_hash::FxBuildHasher;
use xxhash_rust::xxh3::xxh3_64;

use super::events::{Medium, OffloadEvent};
use super::keys::{MAX_KEY_LEN, OffloadKey};
use crate::error::{Error, Result, invalid};

const MAGIC: u64 = 0x7061_6765_646b_7644; // "pagedkvD"
/// Header bytes before each slot's payload: magic, checksum, key length, key.
pub const HEADER_BYTES: u64 = 24 + MAX_KEY_LEN as u64 + 1;
const O_NOFOLLOW: i32 = 0o400_000;

static NEXT_FILE: AtomicU64 = AtomicU64::new(0);

/// How a disk tier is built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskConfig {
    /// An existing, writable directory (not a symlink); `None`: no file, the
    /// index only (reads and writes move no bytes).
    pub dir: Option<PathBuf>,
    /// The most bytes the tier's file may hold (headers included).
    pub capacity_bytes: u64,
    /// Bytes of one chunk's KV data.
    pub chunk_bytes: u64,
    /// Whether stores and removals are recorded as events (medium `STORAGE`).
    pub enable_events: bool,
}

/// What a read found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiskRead {
    /// The chunk's bytes were read and checked.
    Hit,
    /// Not on disk.
    Miss,
    /// On disk but its slot failed the checks (dropped, counted).
    Corrupt,
}

/// Running totals of a disk tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiskCounters {
    /// Chunks written.
    pub writes: u64,
    /// Reads that returned a chunk.
    pub hits: u64,
    /// Reads of an absent key.
    pub misses: u64,
    /// Reads that found a slot failing its checks (corrupt or truncated).
    pub corrupt: u64,
    /// Writes refused because the file could not be written (a full disk).
    pub write_errors: u64,
    /// Chunks evicted for room.
    pub evictions: u64,
    /// Payload bytes written.
    pub bytes_written: u64,
    /// Payload bytes read.
    pub bytes_read: u64,
}

impl DiskCounters {
    /// Every total with its name.
    #[must_use]
    pub fn named(&self) -> [(&'static str, u64); 8] {
        [
            ("writes", self.writes),
            ("hits", self.hits),
            ("misses", self.misses),
            ("corrupt", self.corrupt),
            ("write_errors", self.write_errors),
            ("evictions", self.evictions),
            ("bytes_written", self.bytes_written),
            ("bytes_read", self.bytes_read),
        ]
    }
}

/// The disk tier.
#[derive(Debug)]
pub struct DiskTier {
    config: DiskConfig,
    /// The file and its path; `None` for an index-only tier.
    file: Option<(File, PathBuf)>,
    num_slots: u64,
    fresh: u64,
    free: Vec<u64>,
    /// key -> slot, least recently used first.
    index: LinkedHashMap<OffloadKey, u64, FxBuildHasher>,
    events: Option<Vec<OffloadEvent>>,
    counters: DiskCounters,
}

impl DiskTier {
    /// Creates the tier's file in `config.dir`.
    ///
    /// # Errors
    /// `InvalidConfig` for a chunk size of 0, a capacity smaller than one chunk
    /// (with its header), or a directory that is missing, a symlink, not a
    /// directory or not writable.
    pub fn open(config: DiskConfig) -> Result<Self> {
        let bad = |m: String| Error::InvalidConfig(m);
        if config.chunk_bytes == 0 || config.chunk_bytes > 1 << 34 {
            return Err(bad(format!(
                "chunk_bytes {} out of range (1..=2**34)",
                config.chunk_bytes
            )));
        }
        let slot_bytes = HEADER_BYTES + config.chunk_bytes;
        let num_slots = config.capacity_bytes / slot_bytes;
        if num_slots == 0 {
            return Err(bad(format!(
                "disk tier of {} bytes is smaller than one chunk ({slot_bytes} bytes with its header)",
                config.capacity_bytes
            )));
        }
        let file = match &config.dir {
            Some(dir) => Some(Self::create_file(dir)?),
            None => None,
        };
        Ok(Self {
            events: config.enable_events.then(Vec::new),
            config,
            file,
            num_slots,
            fresh: 0,
            free: Vec::new(),
            index: LinkedHashMap::with_hasher(FxBuildHasher),
            counters: DiskCounters::default(),
        })
    }

    fn create_file(dir: &Path) -> Result<(File, PathBuf)> {
        let bad = |m: String| Error::InvalidConfig(m);
        let meta = std::fs::symlink_metadata(dir)
            .map_err(|e| bad(format!("disk path {}: {e}", dir.display())))?;
        if meta.file_type().is_symlink() || !meta.is_dir() {
            return Err(bad(format!(
                "disk path {} is not a directory",
                dir.display()
            )));
        }
        let name = format!(
            "pagedkv-offload-{}-{}.bin",
            std::process::id(),
            NEXT_FILE.fetch_add(1, Ordering::Relaxed)
        );
        let path = dir.join(name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .custom_flags(O_NOFOLLOW)
            .open(&path)
            .map_err(|e| {
                bad(format!(
                    "disk path {}: cannot create a file: {e}",
                    dir.display()
                ))
            })?;
        Ok((file, path))
    }

    /// The file holding the chunks; `None` for an index-only tier.
    #[must_use]
    pub fn path(&self) -> Option<&Path> {
        self.file.as_ref().map(|(_, p)| p.as_path())
    }

    /// Bytes a read or a write moves: one chunk's, or 0 for an index-only tier.
    #[must_use]
    pub fn payload_bytes(&self) -> u64 {
        if self.file.is_some() {
            self.config.chunk_bytes
        } else {
            0
        }
    }

    /// Bytes of one chunk's KV data.
    #[must_use]
    pub fn chunk_bytes(&self) -> u64 {
        self.config.chunk_bytes
    }

    /// Slots in the file.
    #[must_use]
    pub fn num_slots(&self) -> u64 {
        self.num_slots
    }

    /// Chunks on disk.
    #[must_use]
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether no chunk is on disk.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// The running totals.
    #[must_use]
    pub fn counters(&self) -> DiskCounters {
        self.counters
    }

    /// Whether `key` is on disk (its slot is checked only when read).
    #[must_use]
    pub fn contains(&self, key: &OffloadKey) -> bool {
        self.index.contains_key(key)
    }

    fn offset(&self, slot: u64) -> u64 {
        slot * (HEADER_BYTES + self.config.chunk_bytes)
    }

    fn header(key: &OffloadKey, data: &[u8]) -> Vec<u8> {
        let mut h = Vec::with_capacity(HEADER_BYTES as usize);
        h.extend_from_slice(&MAGIC.to_le_bytes());
        h.extend_from_slice(&xxh3_64(data).to_le_bytes());
        h.extend_from_slice(&(key.as_bytes().len() as u64).to_le_bytes());
        let mut k = [0u8; MAX_KEY_LEN + 1];
        k[..key.as_bytes().len()].copy_from_slice(key.as_bytes());
        h.extend_from_slice(&k);
        h
    }

    /// Writes a chunk (write-through from the host tier), evicting the least
    /// recently used chunks for room. `Ok(false)`: the file could not be written
    /// (a full disk): counted, nothing kept for the key.
    ///
    /// # Errors
    /// `InvalidArgument` when `data` is not one chunk's size.
    ///
    /// # Panics
    /// Never: a file without a free slot holds chunks to evict.
    pub fn put(&mut self, key: &OffloadKey, data: &[u8]) -> Result<bool> {
        if data.len() as u64 != self.payload_bytes() {
            return Err(invalid(format!(
                "a disk chunk is {} bytes, got {}",
                self.payload_bytes(),
                data.len()
            )));
        }
        let slot = if let Some(&slot) = self.index.get(key) {
            self.index.remove(key);
            slot
        } else if let Some(slot) = self.take_slot() {
            slot
        } else {
            let (old, slot) = self.index.pop_front().expect("a full file holds chunks");
            self.counters.evictions += 1;
            self.push_event(old, true);
            slot
        };
        if let Some((file, _)) = &self.file {
            let mut buf = Self::header(key, data);
            buf.extend_from_slice(data);
            if let Err(e) = file.write_all_at(&buf, self.offset(slot)) {
                debug_assert!(e.kind() != ErrorKind::Interrupted);
                self.counters.write_errors += 1;
                self.free.push(slot);
                return Ok(false);
            }
        }
        self.index.insert(*key, slot);
        self.counters.writes += 1;
        self.counters.bytes_written += self.config.chunk_bytes;
        self.push_event(*key, false);
        Ok(true)
    }

    fn take_slot(&mut self) -> Option<u64> {
        if let Some(s) = self.free.pop() {
            return Some(s);
        }
        (self.fresh < self.num_slots).then(|| {
            self.fresh += 1;
            self.fresh - 1
        })
    }

    /// Reads a chunk into `out` (one chunk's size), checking its slot; a hit
    /// refreshes its recency. A slot failing its checks is dropped.
    ///
    /// # Errors
    /// `InvalidArgument` when `out` is not one chunk's size.
    pub fn get(&mut self, key: &OffloadKey, out: &mut [u8]) -> Result<DiskRead> {
        if out.len() as u64 != self.payload_bytes() {
            return Err(invalid(format!(
                "a disk chunk is {} bytes, the buffer {}",
                self.payload_bytes(),
                out.len()
            )));
        }
        let Some(&slot) = self.index.get(key) else {
            self.counters.misses += 1;
            return Ok(DiskRead::Miss);
        };
        let off = self.offset(slot);
        let ok = self.file.as_ref().is_none_or(|(file, _)| {
            let mut header = vec![0u8; HEADER_BYTES as usize];
            file.read_exact_at(&mut header, off).is_ok()
                && file.read_exact_at(out, off + HEADER_BYTES).is_ok()
                && header == Self::header(key, out)
        });
        if !ok {
            out.fill(0);
            self.index.remove(key);
            self.free.push(slot);
            self.counters.corrupt += 1;
            self.push_event(*key, true);
            return Ok(DiskRead::Corrupt);
        }
        self.index.to_back(key);
        self.counters.hits += 1;
        self.counters.bytes_read += self.config.chunk_bytes;
        Ok(DiskRead::Hit)
    }

    /// Drops a chunk (its bytes stay until the slot is reused).
    pub fn remove(&mut self, key: &OffloadKey) -> bool {
        let Some(slot) = self.index.remove(key) else {
            return false;
        };
        self.free.push(slot);
        self.push_event(*key, true);
        true
    }

    /// The events since the last call.
    pub fn take_events(&mut self) -> Vec<OffloadEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn push_event(&mut self, key: OffloadKey, removed: bool) {
        if let Some(events) = &mut self.events {
            match events.last_mut() {
                Some(e) if e.removed == removed => e.keys.push(key),
                _ => events.push(OffloadEvent {
                    keys: vec![key],
                    medium: Medium::Storage,
                    removed,
                    metadata_only: false,
                }),
            }
        }
    }

    /// The tier's invariants: every slot held once, in range, never free.
    ///
    /// # Errors
    /// `InvariantViolation` naming the first violation.
    pub fn check_invariants(&self) -> Result<()> {
        let mut seen = rustc_hash::FxHashSet::default();
        for &s in self.index.values().chain(&self.free) {
            if s >= self.fresh || !seen.insert(s) {
                return Err(Error::InvariantViolation(format!(
                    "disk slot {s} held twice or unused"
                )));
            }
        }
        if seen.len() as u64 != self.fresh {
            return Err(Error::InvariantViolation("a disk slot is lost".into()));
        }
        Ok(())
    }
}

impl Drop for DiskTier {
    fn drop(&mut self) {
        // only the file this tier created
        if let Some((_, path)) = &self.file {
            let _ = std::fs::remove_file(path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("pagedkv-disk-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn k(i: u32) -> OffloadKey {
        OffloadKey::new(&i.to_be_bytes(), 0).unwrap()
    }

    fn tier(d: &Path, slots: u64) -> DiskTier {
        DiskTier::open(DiskConfig {
            dir: Some(d.to_owned()),
            capacity_bytes: slots * (HEADER_BYTES + 8),
            chunk_bytes: 8,
            enable_events: true,
        })
        .unwrap()
    }

    #[test]
    fn round_trip_lru_eviction_and_events() {
        let d = dir("lru");
        let mut t = tier(&d, 2);
        assert!(t.put(&k(1), &[1; 8]).unwrap());
        assert!(t.put(&k(2), &[2; 8]).unwrap());
        let mut out = [0u8; 8];
        assert_eq!(t.get(&k(1), &mut out).unwrap(), DiskRead::Hit);
        assert_eq!(out, [1; 8]);
        // 1 was read last: 2 is the least recently used
        assert!(t.put(&k(3), &[3; 8]).unwrap());
        assert_eq!(t.get(&k(2), &mut out).unwrap(), DiskRead::Miss);
        assert_eq!(t.get(&k(3), &mut out).unwrap(), DiskRead::Hit);
        assert_eq!(out, [3; 8]);
        let ev: Vec<(bool, Vec<OffloadKey>)> = t
            .take_events()
            .into_iter()
            .map(|e| (e.removed, e.keys))
            .collect();
        assert_eq!(
            ev,
            vec![
                (false, vec![k(1), k(2)]),
                (true, vec![k(2)]),
                (false, vec![k(3)])
            ]
        );
        assert_eq!(t.counters().evictions, 1);
        t.check_invariants().unwrap();
        let path = t.path().unwrap().to_owned();
        drop(t);
        assert!(!path.exists());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn corrupt_and_truncated_slots_are_counted_misses() {
        let d = dir("corrupt");
        let mut t = tier(&d, 4);
        t.put(&k(1), &[1; 8]).unwrap();
        t.put(&k(2), &[2; 8]).unwrap();
        // flip one payload byte of slot 0
        let f = OpenOptions::new()
            .write(true)
            .open(t.path().unwrap())
            .unwrap();
        f.write_all_at(&[9], HEADER_BYTES + 3).unwrap();
        let mut out = [7u8; 8];
        assert_eq!(t.get(&k(1), &mut out).unwrap(), DiskRead::Corrupt);
        assert_eq!(out, [0; 8], "no bytes of a corrupt slot are handed out");
        assert!(!t.contains(&k(1)));
        // cut the file inside slot 1
        f.set_len(HEADER_BYTES + 8 + 10).unwrap();
        assert_eq!(t.get(&k(2), &mut out).unwrap(), DiskRead::Corrupt);
        assert_eq!(t.counters().corrupt, 2);
        t.check_invariants().unwrap();
        // the slots are reused
        assert!(t.put(&k(3), &[3; 8]).unwrap());
        assert_eq!(t.get(&k(3), &mut out).unwrap(), DiskRead::Hit);
        drop(t);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn bad_configuration_and_buffers_are_refused() {
        let d = dir("bad");
        let cfg = |dir: PathBuf, capacity_bytes| DiskConfig {
            dir: Some(dir),
            capacity_bytes,
            chunk_bytes: 8,
            enable_events: false,
        };
        let e = DiskTier::open(cfg(d.clone(), HEADER_BYTES + 7)).unwrap_err();
        assert!(e.to_string().contains("smaller than one chunk"), "{e}");
        assert!(DiskTier::open(cfg(d.join("missing"), 1 << 20)).is_err());
        std::fs::write(d.join("a-file"), b"x").unwrap();
        assert!(DiskTier::open(cfg(d.join("a-file"), 1 << 20)).is_err());
        std::os::unix::fs::symlink(&d, d.join("link")).unwrap();
        let e = DiskTier::open(cfg(d.join("link"), 1 << 20)).unwrap_err();
        assert!(e.to_string().contains("not a directory"), "{e}");
        let mut t = tier(&d, 1);
        assert!(t.put(&k(1), &[0; 7]).is_err());
        assert!(t.get(&k(1), &mut [0; 9]).is_err());
        assert!(t.is_empty());
        t.check_invariants().unwrap();
        drop(t);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn an_index_only_tier_holds_and_evicts_as_its_capacity_says() {
        let mut t = DiskTier::open(DiskConfig {
            dir: None,
            capacity_bytes: 2 * (HEADER_BYTES + 8) + 5,
            chunk_bytes: 8,
            enable_events: true,
        })
        .unwrap();
        assert_eq!((t.num_slots(), t.payload_bytes(), t.path()), (2, 0, None));
        // buffers are empty: no bytes move
        assert!(t.put(&k(1), &[1; 8]).is_err());
        assert!(t.put(&k(1), &[]).unwrap());
        assert!(t.put(&k(2), &[]).unwrap());
        assert_eq!(t.get(&k(1), &mut []).unwrap(), DiskRead::Hit);
        assert!(t.get(&k(1), &mut [0; 8]).is_err());
        // 2 is the least recently used
        assert!(t.put(&k(3), &[]).unwrap());
        assert_eq!(t.get(&k(2), &mut []).unwrap(), DiskRead::Miss);
        assert!(t.contains(&k(1)) && t.contains(&k(3)));
        let c = t.counters();
        assert_eq!(
            (c.writes, c.hits, c.evictions, c.bytes_written, c.bytes_read),
            (3, 1, 1, 24, 8)
        );
        assert_eq!(t.take_events().len(), 3);
        t.check_invariants().unwrap();
    }
}
