//! Block hashing: the prefix-cache hash chain.
//!
//! A block hash is `H(parent or NONE_HASH, block token ids, extra keys)`. The two
//! vLLM-compatible algorithms serialise that triple as canonical CBOR (exactly what
//! `cbor2.dumps(obj, canonical=True)` writes) and digest it with SHA-256
//! (`sha256_cbor`, 32 bytes) or XXH3-128 (`xxhash_cbor`, 16 bytes, big-endian digest
//! as Python's `xxh3_128_digest`). `xxh3_native` is pagedkv's own opt-in fast hash:
//! XXH3-128 over the parent digest, the tokens as little-endian `u32` and a typed,
//! length-prefixed encoding of the extra keys — no CBOR, no per-token branching.
//!
//! This file holds the digest type, the algorithms and the extra keys; the
//! hasher is in `hasher`, the encoders in `encode`, the direct SHA-256 path in
//! `sha256` and the memo of plain `sha256_cbor` blocks in `memo`.

mod encode;
mod hasher;
mod memo;
mod sha256;

use crate::error::{Error, Result};
pub use encode::CborValue;
use encode::cbor_text;
pub use hasher::{BlockHasher, ChainHasher};
pub use sha256::sha256_bytes;
use xxhash_rust::xxh3::xxh3_128;

/// The seed vLLM 0.33 derives `NONE_HASH` from when `PYTHONHASHSEED` is unset
/// (cryptographic algorithms only).
pub const DEFAULT_NONE_HASH_SEED: &str = "vllm-none-hash";

/// A block hash digest (16 or 32 bytes), stored inline.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct BlockHash {
    bytes: [u8; 32],
    len: u8,
}

impl BlockHash {
    /// Builds a hash from a 1..=32 byte digest. Longer input is rejected.
    #[must_use]
    pub fn from_slice(digest: &[u8]) -> Option<Self> {
        if digest.is_empty() || digest.len() > 32 {
            return None;
        }
        let mut bytes = [0u8; 32];
        bytes[..digest.len()].copy_from_slice(digest);
        Some(Self {
            bytes,
            len: u8::try_from(digest.len()).ok()?,
        })
    }

    /// The digest bytes.
    #[must_use]
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }

    /// vLLM's integer form for KV events: the last 8 bytes, big-endian.
    #[must_use]
    pub fn to_event_int(&self) -> u64 {
        event_int(self.as_bytes())
    }

    /// A cheap 64-bit fingerprint for hash-map bucketing (digests are uniform).
    #[must_use]
    pub fn fingerprint(&self) -> u64 {
        let mut w = [0u8; 8];
        w.copy_from_slice(&self.bytes[..8]);
        u64::from_le_bytes(w)
    }
}

/// vLLM's integer form of a block-hash digest of any length (KV events, routers):
/// its last 8 bytes, big-endian (all of a shorter digest).
#[must_use]
pub fn event_int(digest: &[u8]) -> u64 {
    digest[digest.len().saturating_sub(8)..]
        .iter()
        .fold(0, |acc, &x| (acc << 8) | u64::from(x))
}

impl std::fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for b in self.as_bytes() {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// Hash algorithm of the prefix cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HashAlgo {
    /// `sha256(cbor2.dumps(obj, canonical=True))` — vLLM's `sha256_cbor`.
    Sha256Cbor,
    /// `xxh3_128_digest(cbor2.dumps(obj, canonical=True))` — vLLM's `xxhash_cbor`.
    XxhashCbor,
    /// pagedkv's native fast hash: XXH3-128 over a fixed binary layout.
    Xxh3Native,
}

impl HashAlgo {
    /// Every algorithm, the vLLM-compatible default first.
    pub const ALL: [Self; 3] = [Self::Sha256Cbor, Self::XxhashCbor, Self::Xxh3Native];

    /// Parses an algorithm name.
    #[must_use]
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "sha256_cbor" => Some(Self::Sha256Cbor),
            "xxhash_cbor" => Some(Self::XxhashCbor),
            "xxh3_native" => Some(Self::Xxh3Native),
            _ => None,
        }
    }

    /// Parses an algorithm name, explaining a bad one.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an unknown name.
    pub fn parse(name: &str) -> Result<Self> {
        Self::from_name(name).ok_or_else(|| {
            Error::InvalidConfig(format!(
                "unknown hash_algo {name:?}; expected 'sha256_cbor', 'xxhash_cbor' or 'xxh3_native'"
            ))
        })
    }

    /// The algorithm's name.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Sha256Cbor => "sha256_cbor",
            Self::XxhashCbor => "xxhash_cbor",
            Self::Xxh3Native => "xxh3_native",
        }
    }

    /// Whether the algorithm is collision resistant. vLLM keeps a random per-process
    /// `NONE_HASH` for the others unless a seed is given.
    #[must_use]
    pub fn is_cryptographic(self) -> bool {
        matches!(self, Self::Sha256Cbor)
    }

    fn digest(self, bytes: &[u8]) -> BlockHash {
        match self {
            Self::Sha256Cbor => BlockHash {
                bytes: sha256_bytes(bytes),
                len: 32,
            },
            Self::XxhashCbor | Self::Xxh3Native => digest128(xxh3_128(bytes)),
        }
    }

    /// `hash_fn(seed)`: the `NONE_HASH` derived from a seed string.
    #[must_use]
    pub fn none_hash(self, seed: &str) -> BlockHash {
        let mut buf = Vec::with_capacity(seed.len() + 9);
        match self {
            Self::Sha256Cbor | Self::XxhashCbor => cbor_text(&mut buf, seed),
            Self::Xxh3Native => {
                buf.extend_from_slice(b"pagedkv-none:");
                buf.extend_from_slice(seed.as_bytes());
            }
        }
        self.digest(&buf)
    }
}

fn digest128(v: u128) -> BlockHash {
    let mut out = BlockHash {
        bytes: [0; 32],
        len: 16,
    };
    out.bytes[..16].copy_from_slice(&v.to_be_bytes());
    out
}

/// One tagged extra key of a block, in the shape vLLM 0.33 hashes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExtraKey<'a> {
    /// `("lora", lora_name, lora_path)`.
    Lora {
        /// Adapter name.
        name: &'a str,
        /// Adapter path, when it takes part in the key.
        path: Option<&'a str>,
    },
    /// `("mm", identifier, item offset - block start)`.
    Mm {
        /// The item's identifier (its content hash).
        identifier: &'a str,
        /// Item offset minus block start (negative when it began earlier).
        offset: i64,
    },
    /// `("cache_salt", salt)`, first block only.
    CacheSalt(&'a str),
    /// `("prompt_embeds", sha256 digest of the block's embedding bytes)`.
    PromptEmbeds([u8; 32]),
}

#[cfg(test)]
mod tests {
    use super::encode::{cbor_bytes, cbor_head, cbor_int, encode_extra_cbor, encode_tokens_cbor};
    use super::sha256::{DIRECT_MAX_TOKENS, sha256_cbor_direct};
    use super::*;

    fn hex(h: &BlockHash) -> String {
        format!("{h:?}")
    }

    #[test]
    fn default_none_hash_matches_vllm() {
        let h = HashAlgo::Sha256Cbor.none_hash(DEFAULT_NONE_HASH_SEED);
        assert_eq!(
            hex(&h),
            "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
        );
    }

    #[test]
    fn seeded_none_hash_matches_vllm() {
        assert_eq!(
            hex(&HashAlgo::Sha256Cbor.none_hash("0")),
            "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
        );
        assert_eq!(
            hex(&HashAlgo::XxhashCbor.none_hash("0")),
            "1ebe36576dcb573f26b99533a20aaeca"
        );
    }

    #[test]
    fn cbor_integers_use_minimal_heads() {
        let mut b = Vec::new();
        for v in [0u64, 23, 24, 255, 256, 65535, 65536, u64::from(u32::MAX)] {
            cbor_head(&mut b, 0, v);
        }
        assert_eq!(
            b,
            [
                0x00, 0x17, 0x18, 0x18, 0x18, 0xff, 0x19, 0x01, 0x00, 0x19, 0xff, 0xff, 0x1a, 0x00,
                0x01, 0x00, 0x00, 0x1a, 0xff, 0xff, 0xff, 0xff
            ]
        );
        let mut n = Vec::new();
        cbor_int(&mut n, -5);
        assert_eq!(n, [0x24]);
    }

    #[test]
    fn direct_block_encoder_matches_the_general_one() {
        let none = HashAlgo::Sha256Cbor.none_hash(DEFAULT_NONE_HASH_SEED);
        let mut h = BlockHasher::new(HashAlgo::Sha256Cbor, none);
        // Token values across every CBOR integer width, block sizes around the
        // array-head and buffer limits.
        let values = [0u32, 1, 23, 24, 255, 256, 65_535, 65_536, u32::MAX, 151_643];
        for n in [0usize, 1, 15, 16, 23, 24, 32, 63, 64, 65, 80] {
            let tokens: Vec<u32> = (0..n).map(|i| values[(i * 7 + n) % values.len()]).collect();
            let mut buf = Vec::new();
            buf.push(0x83);
            cbor_bytes(&mut buf, none.as_bytes());
            encode_tokens_cbor(&mut buf, &tokens);
            encode_extra_cbor(&mut buf, &[]);
            let general = sha256_bytes(&buf);
            assert_eq!(
                h.hash_block(None, &tokens, &[]).as_bytes(),
                &general[..],
                "{n} tokens"
            );
            if n <= DIRECT_MAX_TOKENS {
                let direct = sha256_cbor_direct(&none, &tokens).unwrap();
                assert_eq!(direct.as_bytes(), &general[..]);
            } else {
                assert!(sha256_cbor_direct(&none, &tokens).is_none());
            }
        }
    }

    #[test]
    fn direct_sha256_matches_the_digest_api_at_every_length() {
        use sha2::{Digest, Sha256};
        // Every tail case: empty, one block, the 55/56-byte padding split, many blocks.
        let data: Vec<u8> = (0..400u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for len in 0..=data.len() {
            let msg = &data[..len];
            assert_eq!(
                sha256_bytes(msg)[..],
                Sha256::digest(msg)[..],
                "length {len}"
            );
        }
    }

    #[test]
    fn event_int_is_last_eight_bytes_big_endian() {
        let mut d = [0u8; 32];
        d[24..].copy_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
        let h = BlockHash::from_slice(&d).unwrap_or_default();
        assert_eq!(h.to_event_int(), 0x0102_0304_0506_0708);
    }

    #[test]
    fn native_hash_separates_tokens_and_keys() {
        let mut h = BlockHasher::new(HashAlgo::Xxh3Native, HashAlgo::Xxh3Native.none_hash("s"));
        let a = h.hash_block(None, &[1, 2, 3], &[]);
        let b = h.hash_block(None, &[1, 2, 4], &[]);
        let c = h.hash_block(None, &[1, 2, 3], &[ExtraKey::CacheSalt("x")]);
        assert_ne!(a, b);
        assert_ne!(a, c);
        assert_eq!(a, h.hash_block(None, &[1, 2, 3], &[]));
    }
}
