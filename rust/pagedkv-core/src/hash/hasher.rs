//! `BlockHasher`: hashes the blocks of a chain under one algorithm, reusing
//! one serialisation buffer, with the `sha256_cbor` memo and truncation;
//! `ChainHasher`, the hasher holding the memo for a whole chain.

use super::encode::{
    CBOR_NULL, CborValue, cbor_bytes, encode_extra_cbor, encode_extra_native, encode_tokens_cbor,
};
use super::memo::HashMemo;
use super::sha256::{sha256_bytes, sha256_cbor_direct};
use super::{BlockHash, ExtraKey, HashAlgo};
use crate::error::{Result, invalid};
use std::sync::{Arc, Mutex, MutexGuard};

/// Hashes blocks of one algorithm, reusing one serialisation buffer.
#[derive(Clone, Debug)]
pub struct BlockHasher {
    algo: HashAlgo,
    none_hash: BlockHash,
    buf: Vec<u8>,
    /// Keep only this many leading bytes of every block hash (0: all).
    truncate: u8,
    /// Digests of recent plain `sha256_cbor` blocks by their input
    /// ([`Self::set_memo`]), shared with the hashers made from this one
    /// ([`Self::same_kind`]).
    memo: Option<Arc<Mutex<HashMemo>>>,
}

impl BlockHasher {
    /// A hasher whose chains start from `none_hash`.
    #[must_use]
    pub fn new(algo: HashAlgo, none_hash: BlockHash) -> Self {
        Self {
            algo,
            none_hash,
            buf: Vec::with_capacity(256),
            truncate: 0,
            memo: None,
        }
    }

    /// The same hasher (algorithm, `NONE_HASH`, truncation, the memo itself,
    /// shared) with an empty buffer: what a hashing job or a preparer takes
    /// along without copying the buffer.
    #[must_use]
    pub fn same_kind(&self) -> Self {
        Self {
            algo: self.algo,
            none_hash: self.none_hash,
            buf: Vec::new(),
            truncate: self.truncate,
            memo: self.memo.clone(),
        }
    }

    /// Keeps the digests of the last `entries` (rounded up to a power of two)
    /// plain `sha256_cbor` blocks of `width` tokens with their whole input
    /// (parent digest and tokens), so a block hashed again (a shared prefix, a
    /// conversation's earlier turns) is looked up, not hashed: the digest is
    /// returned only for the exact input it was computed from. 0 for either
    /// turns it off, as do blocks over 64 tokens and more than 2**40 entries.
    /// The table (`entries` x 128 bytes for 16 tokens) is allocated when
    /// first written; if it cannot be, every block is hashed. Other
    /// algorithms, truncated hashes and blocks with extra keys are always
    /// hashed.
    ///
    /// The memo is shared by the hashers made from this one
    /// ([`Self::same_kind`]: a manager's hash worker, its preparers) and
    /// taken for a whole chain ([`Self::chain`]); a chain that finds it taken
    /// hashes every block rather than wait.
    pub fn set_memo(&mut self, width: usize, entries: usize) {
        self.memo = HashMemo::new(width, entries).map(|m| Arc::new(Mutex::new(m)));
    }

    /// Bytes the memo holds once used (0 when off).
    #[must_use]
    pub fn memo_bytes(&self) -> usize {
        self.memo
            .as_deref()
            .map_or(0, |m| m.lock().map_or(0, |m| m.bytes()))
    }

    /// Blocks the memo answered, and blocks it was asked for and hashed, by
    /// every hasher sharing it (`(0, 0)` when off).
    #[must_use]
    pub fn memo_counts(&self) -> (u64, u64) {
        self.memo
            .as_deref()
            .map_or((0, 0), |m| m.lock().map_or((0, 0), |m| (m.hits, m.misses)))
    }

    /// Forgets the memo's blocks (it stays on).
    pub fn clear_memo(&mut self) {
        if let Some(Ok(mut m)) = self.memo.as_deref().map(Mutex::lock) {
            m.clear();
        }
    }

    /// Hashes a chain of blocks with `f`, the memo taken once for all of them
    /// when `memo` (blocks of sampled tokens, seldom seen before, would only
    /// cost it a miss and an entry each: `false`).
    pub fn chain<R>(&mut self, memo: bool, f: impl FnOnce(&mut ChainHasher<'_>) -> R) -> R {
        let shared = if memo { self.memo.take() } else { None };
        let out = {
            let lock = shared.as_deref().and_then(|m| m.try_lock().ok());
            f(&mut ChainHasher {
                hasher: self,
                memo: lock,
            })
        };
        if shared.is_some() {
            self.memo = shared;
        }
        out
    }

    /// Keeps only the first `bytes` bytes of every block hash (1..=32; 0 keeps
    /// all). A deliberately weak hash, for exercising collision handling.
    pub fn set_truncation(&mut self, bytes: u8) {
        self.truncate = bytes.min(32);
    }

    /// The strong chained digest of a block's context for hit verification:
    /// SHA-256 over the previous digest, the block's tokens and its extra keys.
    /// Independent of the configured block hash (and of its truncation).
    pub fn context_digest(
        &mut self,
        prev: &[u8; 32],
        tokens: &[u32],
        extra: &[ExtraKey],
    ) -> [u8; 32] {
        let buf = &mut self.buf;
        buf.clear();
        buf.extend_from_slice(prev);
        buf.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
        for t in tokens {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        encode_extra_native(buf, extra);
        sha256_bytes(buf)
    }

    /// The algorithm.
    #[must_use]
    pub fn algo(&self) -> HashAlgo {
        self.algo
    }

    /// The chain seed.
    #[must_use]
    pub fn none_hash(&self) -> BlockHash {
        self.none_hash
    }

    /// Hash of one full block: `H((parent or NONE_HASH, tokens, extra_keys or None))`.
    pub fn hash_block(
        &mut self,
        parent: Option<&BlockHash>,
        tokens: &[u32],
        extra: &[ExtraKey],
    ) -> BlockHash {
        if self.memo.is_none() {
            return self.hash_block_in(parent, tokens, extra, None);
        }
        self.chain(true, |c| c.hash(parent, tokens, extra))
    }

    /// [`Self::hash_block`] through `memo` when given.
    fn hash_block_in(
        &mut self,
        parent: Option<&BlockHash>,
        tokens: &[u32],
        extra: &[ExtraKey],
        memo: Option<&mut HashMemo>,
    ) -> BlockHash {
        let parent = parent.unwrap_or(&self.none_hash);
        if self.algo == HashAlgo::Sha256Cbor && self.truncate == 0 && extra.is_empty() {
            // The memo's answer, or where to record the digest computed here.
            let record = match memo {
                Some(memo)
                    if tokens.len() == memo.width()
                        && let Ok(p) = <&[u8; 32]>::try_from(parent.as_bytes()) =>
                {
                    match memo.lookup(p, tokens) {
                        Ok(bytes) => {
                            memo.hits += 1;
                            return BlockHash { bytes, len: 32 };
                        }
                        Err(slot) => {
                            memo.misses += 1;
                            Some((memo, slot, p))
                        }
                    }
                }
                _ => None,
            };
            if let Some(h) = sha256_cbor_direct(parent, tokens) {
                if let Some((memo, slot, p)) = record {
                    memo.store(slot, p, tokens, &h.bytes);
                }
                return h;
            }
        }
        let buf = &mut self.buf;
        buf.clear();
        match self.algo {
            HashAlgo::Sha256Cbor | HashAlgo::XxhashCbor => {
                buf.push(0x83);
                cbor_bytes(buf, parent.as_bytes());
                encode_tokens_cbor(buf, tokens);
                encode_extra_cbor(buf, extra);
            }
            HashAlgo::Xxh3Native => {
                buf.reserve(tokens.len() * 4 + 48);
                buf.extend_from_slice(parent.as_bytes());
                buf.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
                for t in tokens {
                    buf.extend_from_slice(&t.to_le_bytes());
                }
                encode_extra_native(buf, extra);
            }
        }
        let h = self.algo.digest(buf);
        match self.truncate {
            0 => h,
            n => BlockHash::from_slice(&h.as_bytes()[..usize::from(n).min(h.as_bytes().len())])
                .unwrap_or(h),
        }
    }

    /// Hash with arbitrary CBOR extra keys (`None` = CBOR null), for the CBOR
    /// algorithms. Used to check the hash function against vLLM's vectors.
    /// `xxh3_native` accepts only `None` (it has no generic key form).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument): extra keys for `xxh3_native`, or unencodable values.
    pub fn hash_block_generic(
        &mut self,
        parent: Option<&BlockHash>,
        tokens: &[u32],
        extra: Option<&CborValue>,
    ) -> Result<BlockHash> {
        if self.algo == HashAlgo::Xxh3Native {
            return match extra {
                None => Ok(self.hash_block(parent, tokens, &[])),
                Some(_) => Err(invalid("xxh3_native takes typed extra keys only")),
            };
        }
        let parent = parent.unwrap_or(&self.none_hash);
        let buf = &mut self.buf;
        buf.clear();
        buf.push(0x83);
        cbor_bytes(buf, parent.as_bytes());
        encode_tokens_cbor(buf, tokens);
        match extra {
            None => buf.push(CBOR_NULL),
            Some(v) => v.encode(buf)?,
        }
        Ok(self.algo.digest(buf))
    }
}

/// A [`BlockHasher`] hashing a chain ([`BlockHasher::chain`]), holding the
/// memo (when on and free) for all of its blocks.
#[derive(Debug)]
pub struct ChainHasher<'a> {
    hasher: &'a mut BlockHasher,
    memo: Option<MutexGuard<'a, HashMemo>>,
}

impl ChainHasher<'_> {
    /// [`BlockHasher::hash_block`], through the memo held.
    #[inline]
    pub fn hash(
        &mut self,
        parent: Option<&BlockHash>,
        tokens: &[u32],
        extra: &[ExtraKey],
    ) -> BlockHash {
        self.hasher
            .hash_block_in(parent, tokens, extra, self.memo.as_deref_mut())
    }

    /// Starts loading the memo entry of a later block of the chain (its
    /// tokens), so the chain does not wait for it.
    #[inline]
    pub fn prefetch(&self, tokens: &[u32]) {
        if let Some(m) = &self.memo {
            m.prefetch(tokens);
        }
    }

    /// [`BlockHasher::context_digest`].
    pub fn context_digest(
        &mut self,
        prev: &[u8; 32],
        tokens: &[u32],
        extra: &[ExtraKey],
    ) -> [u8; 32] {
        self.hasher.context_digest(prev, tokens, extra)
    }
}
