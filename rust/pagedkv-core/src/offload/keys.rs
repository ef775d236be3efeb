//! `OffloadKey`: a chunk's last block hash followed by its KV-cache group index,
//! 4 bytes big-endian (vLLM 0.33 `make_offload_key`), held inline.

use std::cmp::Ordering;
use std::fmt;
use std::hash::{Hash, Hasher};

use xxhash_rust::xxh3::xxh3_64;

use crate::error::{Result, invalid};

/// The longest key held: a 32-byte digest plus the 4-byte group index fits with room.
pub const MAX_KEY_LEN: usize = 55;

/// One offloaded chunk's key. Compared and ordered as its bytes (Python `bytes`
/// order: lexicographic, a prefix first); its 64-bit digest (XXH3 of the bytes)
/// is computed once, and maps hash that.
#[derive(Clone, Copy)]
pub struct OffloadKey {
    digest: u64,
    len: u8,
    bytes: [u8; MAX_KEY_LEN],
}

impl OffloadKey {
    /// A key from its raw bytes.
    ///
    /// # Errors
    /// `InvalidArgument` when longer than [`MAX_KEY_LEN`].
    pub fn from_bytes(raw: &[u8]) -> Result<Self> {
        if raw.len() > MAX_KEY_LEN {
            return Err(invalid(format!(
                "offload key of {} bytes: at most {MAX_KEY_LEN} are supported",
                raw.len()
            )));
        }
        let mut bytes = [0u8; MAX_KEY_LEN];
        bytes[..raw.len()].copy_from_slice(raw);
        Ok(Self {
            digest: xxh3_64(raw),
            len: raw.len() as u8,
            bytes,
        })
    }

    /// `make_offload_key`: `block_hash` then `group_idx` as 4 bytes big-endian.
    ///
    /// # Errors
    /// `InvalidArgument` when the key would be longer than [`MAX_KEY_LEN`].
    pub fn new(block_hash: &[u8], group_idx: u32) -> Result<Self> {
        if block_hash.len() + 4 > MAX_KEY_LEN {
            return Err(invalid(format!(
                "block hash of {} bytes: at most {} are supported",
                block_hash.len(),
                MAX_KEY_LEN - 4
            )));
        }
        let mut bytes = [0u8; MAX_KEY_LEN];
        let n = block_hash.len();
        bytes[..n].copy_from_slice(block_hash);
        bytes[n..n + 4].copy_from_slice(&group_idx.to_be_bytes());
        Ok(Self {
            digest: xxh3_64(&bytes[..n + 4]),
            len: (n + 4) as u8,
            bytes,
        })
    }

    /// The key's 64-bit digest (XXH3 of its bytes): what maps hash.
    #[must_use]
    pub fn digest(&self) -> u64 {
        self.digest
    }

    /// The key's bytes.
    #[must_use]
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }

    /// `get_offload_block_hash`: all but the last 4 bytes.
    #[must_use]
    pub fn block_hash(&self) -> &[u8] {
        let b = self.as_bytes();
        &b[..b.len().saturating_sub(4)]
    }

    /// `get_offload_group_idx`: the last 4 bytes (fewer in a shorter key) big-endian.
    #[must_use]
    pub fn group_idx(&self) -> u32 {
        let b = self.as_bytes();
        b[b.len().saturating_sub(4)..]
            .iter()
            .fold(0u32, |acc, &x| (acc << 8) | u32::from(x))
    }
}

impl PartialEq for OffloadKey {
    fn eq(&self, other: &Self) -> bool {
        // bytes past `len` are zero in every key: the arrays compare as the keys
        self.digest == other.digest && self.len == other.len && self.bytes == other.bytes
    }
}

impl Eq for OffloadKey {}

impl Hash for OffloadKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.digest);
    }
}

impl Ord for OffloadKey {
    fn cmp(&self, other: &Self) -> Ordering {
        self.as_bytes().cmp(other.as_bytes())
    }
}

impl PartialOrd for OffloadKey {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Debug for OffloadKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OffloadKey(")?;
        for b in self.as_bytes() {
            write!(f, "{b:02x}")?;
        }
        write!(f, ")")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_make_offload_key() {
        let k = OffloadKey::new(b"12", 258).unwrap();
        assert_eq!(k.as_bytes(), b"12\x00\x00\x01\x02");
        assert_eq!(k.block_hash(), b"12");
        assert_eq!(k.group_idx(), 258);
        assert_eq!(
            OffloadKey::from_bytes(b"\x01\x02").unwrap().group_idx(),
            0x0102
        );
        assert!(OffloadKey::from_bytes(&[0; 56]).is_err());
        assert!(OffloadKey::new(&[0; 52], 0).is_err());
    }

    #[test]
    fn orders_as_python_bytes() {
        let a = OffloadKey::from_bytes(b"ab").unwrap();
        let b = OffloadKey::from_bytes(b"abc").unwrap();
        let c = OffloadKey::from_bytes(b"b").unwrap();
        assert!(a < b && b < c);
        assert_eq!(a, OffloadKey::from_bytes(b"ab").unwrap());
    }
}
