//! Block hashing: the prefix-cache hash chain.
//!
//! A block hash is `H(parent or NONE_HASH, block token ids, extra keys)`. The two
//! vLLM-compatible algorithms serialise that triple as canonical CBOR (exactly what
//! `cbor2.dumps(obj, canonical=True)` writes) and digest it with SHA-256
//! (`sha256_cbor`, 32 bytes) or XXH3-128 (`xxhash_cbor`, 16 bytes, big-endian digest
//! as Python's `xxh3_128_digest`). `xxh3_native` is pagedkv's own opt-in fast hash:
//! XXH3-128 over the parent digest, the tokens as little-endian `u32` and a typed,
//! length-prefixed encoding of the extra keys — no CBOR, no per-token branching.

use sha2::block_api::compress256;

use crate::error::{Error, Result, invalid};
use xxhash_rust::xxh3::xxh3_128;

mod memo;
use memo::HashMemo;
use std::sync::{Arc, Mutex, MutexGuard};

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

/// A generic CBOR value, for hashing arbitrary extra-key shapes (function-level
/// vectors and callers reproducing older vLLM key formats).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CborValue {
    /// `None`.
    Null,
    /// A bool.
    Bool(bool),
    /// An integer (CBOR's range: -2**64 ..= 2**64 - 1).
    Int(i128),
    /// A text string.
    Text(String),
    /// A byte string.
    Bytes(Vec<u8>),
    /// An array (a Python tuple or list).
    Array(Vec<CborValue>),
}

fn cbor_head(buf: &mut Vec<u8>, major: u8, v: u64) {
    let m = major << 5;
    if v < 24 {
        buf.push(m | v as u8);
    } else if u8::try_from(v).is_ok() {
        buf.extend_from_slice(&[m | 0x18, v as u8]);
    } else if u16::try_from(v).is_ok() {
        buf.push(m | 0x19);
        buf.extend_from_slice(&(v as u16).to_be_bytes());
    } else if u32::try_from(v).is_ok() {
        buf.push(m | 0x1a);
        buf.extend_from_slice(&(v as u32).to_be_bytes());
    } else {
        buf.push(m | 0x1b);
        buf.extend_from_slice(&v.to_be_bytes());
    }
}

fn cbor_text(buf: &mut Vec<u8>, s: &str) {
    cbor_head(buf, 3, s.len() as u64);
    buf.extend_from_slice(s.as_bytes());
}

fn cbor_bytes(buf: &mut Vec<u8>, b: &[u8]) {
    cbor_head(buf, 2, b.len() as u64);
    buf.extend_from_slice(b);
}

fn cbor_int(buf: &mut Vec<u8>, v: i64) {
    if v >= 0 {
        cbor_head(buf, 0, v as u64);
    } else {
        cbor_head(buf, 1, (-1 - v) as u64);
    }
}

const CBOR_NULL: u8 = 0xf6;

impl CborValue {
    /// Appends the canonical CBOR encoding. Integers outside the 64-bit CBOR range
    /// are not representable without bignum tags and are rejected.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when an integer does not fit CBOR's major types 0/1.
    pub fn encode(&self, buf: &mut Vec<u8>) -> Result<()> {
        match self {
            Self::Null => buf.push(CBOR_NULL),
            Self::Bool(b) => buf.push(if *b { 0xf5 } else { 0xf4 }),
            Self::Int(v) => {
                if *v >= 0 {
                    let u =
                        u64::try_from(*v).map_err(|_| invalid(format!("integer {v} too large")))?;
                    cbor_head(buf, 0, u);
                } else {
                    let u = u64::try_from(-1 - *v)
                        .map_err(|_| invalid(format!("integer {v} too small")))?;
                    cbor_head(buf, 1, u);
                }
            }
            Self::Text(s) => cbor_text(buf, s),
            Self::Bytes(b) => cbor_bytes(buf, b),
            Self::Array(items) => {
                cbor_head(buf, 4, items.len() as u64);
                for it in items {
                    it.encode(buf)?;
                }
            }
        }
        Ok(())
    }
}

fn encode_extra_cbor(buf: &mut Vec<u8>, keys: &[ExtraKey]) {
    if keys.is_empty() {
        buf.push(CBOR_NULL);
        return;
    }
    cbor_head(buf, 4, keys.len() as u64);
    for k in keys {
        match k {
            ExtraKey::Lora { name, path } => {
                buf.push(0x83);
                cbor_text(buf, "lora");
                cbor_text(buf, name);
                match path {
                    Some(p) => cbor_text(buf, p),
                    None => buf.push(CBOR_NULL),
                }
            }
            ExtraKey::Mm { identifier, offset } => {
                buf.push(0x83);
                cbor_text(buf, "mm");
                cbor_text(buf, identifier);
                cbor_int(buf, *offset);
            }
            ExtraKey::CacheSalt(s) => {
                buf.push(0x82);
                cbor_text(buf, "cache_salt");
                cbor_text(buf, s);
            }
            ExtraKey::PromptEmbeds(d) => {
                buf.push(0x82);
                cbor_text(buf, "prompt_embeds");
                cbor_bytes(buf, d);
            }
        }
    }
}

fn native_str(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(&(s.len() as u32).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

fn encode_extra_native(buf: &mut Vec<u8>, keys: &[ExtraKey]) {
    buf.extend_from_slice(&(keys.len() as u32).to_le_bytes());
    for k in keys {
        match k {
            ExtraKey::Lora { name, path } => {
                buf.push(1);
                native_str(buf, name);
                match path {
                    Some(p) => {
                        buf.push(1);
                        native_str(buf, p);
                    }
                    None => buf.push(0),
                }
            }
            ExtraKey::Mm { identifier, offset } => {
                buf.push(2);
                native_str(buf, identifier);
                buf.extend_from_slice(&offset.to_le_bytes());
            }
            ExtraKey::CacheSalt(s) => {
                buf.push(3);
                native_str(buf, s);
            }
            ExtraKey::PromptEmbeds(d) => {
                buf.push(4);
                buf.extend_from_slice(d);
            }
        }
    }
}

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
    /// [`Error::InvalidArgument`]: extra keys for `xxh3_native`, or unencodable values.
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

/// Most tokens [`sha256_cbor_direct`] encodes on the stack.
const DIRECT_MAX_TOKENS: usize = 64;
/// Tokens whose block message always fits two SHA-256 blocks with its padding
/// (37 + 5 x 16 = 117 <= 119 bytes).
const TWO_BLOCK_MAX_TOKENS: usize = 16;

/// Writes `(parent, tokens, None)` as canonical CBOR at the start of `m`
/// (`[0x83, bytes(parent), array(tokens), null]`, shortest integer heads: the
/// bytes of the general encoder); returns the length. `m` holds at least
/// `38 + 5 * tokens.len()` bytes and `tokens.len() < 256`.
fn encode_block_cbor(m: &mut [u8], parent: &[u8; 32], tokens: &[u32]) -> usize {
    m[0] = 0x83;
    m[1] = 0x58;
    m[2] = 32;
    m[3..35].copy_from_slice(parent);
    let mut i = 35;
    if tokens.len() < 24 {
        m[i] = 0x80 | tokens.len() as u8;
        i += 1;
    } else {
        m[i] = 0x98;
        m[i + 1] = tokens.len() as u8;
        i += 2;
    }
    for &t in tokens {
        // One 8-byte store per token (the buffer has the slack), then advance by
        // the encoded length: 1, 2, 3 or 5 bytes.
        let (word, len) = match t {
            0..24 => (u64::from(t), 1),
            24..256 => (0x18 | u64::from(t) << 8, 2),
            256..65536 => (0x19 | u64::from(t >> 8) << 8 | u64::from(t & 0xff) << 16, 3),
            _ => (0x1a | u64::from(t.swap_bytes()) << 8, 5),
        };
        m[i..i + 8].copy_from_slice(&word.to_le_bytes());
        i += len;
    }
    m[i] = CBOR_NULL;
    i + 1
}

/// `sha256_cbor` of `(parent, tokens, None)`, the common block (no extra keys):
/// the canonical CBOR is written into a stack buffer and fed straight to the
/// compression function; a block of up to 16 tokens is encoded in place in the
/// two SHA-256 blocks it takes, padded there, and compressed in one call. None
/// when the block does not fit the buffer or the parent is not a 32-byte digest.
// Inlined into the hasher's one call site: out of line, its 33-byte result
// goes through memory and a chained block costs ~5 ns more.
#[allow(clippy::inline_always)]
#[inline(always)]
fn sha256_cbor_direct(parent: &BlockHash, tokens: &[u32]) -> Option<BlockHash> {
    let parent: &[u8; 32] = parent.as_bytes().try_into().ok()?;
    if tokens.len() <= TWO_BLOCK_MAX_TOKENS {
        // 117 bytes at most, + 8 of store slack, inside 128 (and the padding
        // store at `len` ends by 126). The message is encoded in the two
        // SHA-256 blocks themselves and compressed where it lies: a copy into
        // a block array would have to wait for the encoder's stores.
        let mut blocks = [[0u8; 64]; 2];
        let m = blocks.as_flattened_mut();
        let len = encode_block_cbor(m, parent, tokens);
        // The padding marker, and zeros over the up to 7 bytes the encoder's
        // slack stores left past the message, in one store.
        m[len..len + 8].copy_from_slice(&0x80u64.to_le_bytes());
        let n = if len < 56 { 1 } else { 2 };
        m[n * 64 - 8..n * 64].copy_from_slice(&((len as u64) * 8).to_be_bytes());
        let mut state = SHA256_H0;
        compress256(&mut state, &blocks[..n]);
        return Some(BlockHash {
            bytes: state_bytes(state),
            len: 32,
        });
    }
    if tokens.len() > DIRECT_MAX_TOKENS {
        return None;
    }
    let mut m = [0u8; 38 + 5 * DIRECT_MAX_TOKENS + 8];
    let len = encode_block_cbor(&mut m, parent, tokens);
    Some(BlockHash {
        bytes: sha256_bytes(&m[..len]),
        len: 32,
    })
}

fn encode_tokens_cbor(buf: &mut Vec<u8>, tokens: &[u32]) {
    cbor_head(buf, 4, tokens.len() as u64);
    buf.reserve(tokens.len() * 5);
    for &t in tokens {
        // Unsigned ints, shortest form (the same bytes as `cbor_head(buf, 0, t)`).
        match t {
            0..24 => buf.push(t as u8),
            24..256 => buf.extend_from_slice(&[24, t as u8]),
            256..65536 => {
                let b = (t as u16).to_be_bytes();
                buf.extend_from_slice(&[25, b[0], b[1]]);
            }
            _ => {
                let b = t.to_be_bytes();
                buf.extend_from_slice(&[26, b[0], b[1], b[2], b[3]]);
            }
        }
    }
}

/// SHA-256's initial state (FIPS 180-4, 5.3.3).
const SHA256_H0: [u32; 8] = [
    0x6a09_e667,
    0xbb67_ae85,
    0x3c6e_f372,
    0xa54f_f53a,
    0x510e_527f,
    0x9b05_688c,
    0x1f83_d9ab,
    0x5be0_cd19,
];

/// SHA-256 of raw bytes, straight through the compression function (SHA-NI
/// where the CPU has it): whole 64-byte blocks are read from `data` itself, the
/// tail and its padding from one stack buffer; no hasher object, no copies of
/// the message. A block's CBOR message (~86 bytes for 16 tokens) is two
/// compressions.
#[must_use]
pub fn sha256_bytes(data: &[u8]) -> [u8; 32] {
    let mut state = SHA256_H0;
    let (blocks, rem) = data.as_chunks::<64>();
    compress256(&mut state, blocks);
    let mut tail = [[0u8; 64]; 2];
    tail[0][..rem.len()].copy_from_slice(rem);
    tail[0][rem.len()] = 0x80;
    // The 64-bit message length in bits closes the last block; it needs 8 free
    // bytes after the 0x80 marker, or a second block.
    let n = if rem.len() < 56 { 1 } else { 2 };
    tail[n - 1][56..].copy_from_slice(&((data.len() as u64) * 8).to_be_bytes());
    compress256(&mut state, &tail[..n]);
    state_bytes(state)
}

/// The digest of a final SHA-256 state (its words big-endian).
fn state_bytes(state: [u32; 8]) -> [u8; 32] {
    let mut out = [0u8; 32];
    for (o, w) in out.chunks_exact_mut(4).zip(state) {
        o.copy_from_slice(&w.to_be_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
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
