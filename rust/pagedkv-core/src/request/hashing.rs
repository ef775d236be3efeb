//! A request's block hashes, hashed in place as its blocks fill (through the
//! hash memo for prompt blocks) or taken from a live request that began alike,
//! and the extra keys (`LoRA`, multimodal items, cache salt, prompt embeddings)
//! each block's hash covers.

use super::{HASH_HEADROOM, Request};
use crate::events::EventExtraKey;
use crate::hash::{BlockHasher, ExtraKey};

/// Blocks ahead of the one being hashed whose memo entry is prefetched.
const MEMO_AHEAD: usize = 8;
/// Blocks of two prompts compared at once when one takes the other's hashes.
const SHARED_RUN: usize = 16;

impl Request {
    /// vLLM 0.33's extra keys of the block `[start, end)`, in order: `LoRA`,
    /// multimodal items overlapping the block, cache salt (block 0), embeddings.
    pub fn extra_keys<'a>(&'a self, start: usize, end: usize, out: &mut Vec<ExtraKey<'a>>) {
        out.clear();
        if let Some(l) = &self.lora {
            out.push(ExtraKey::Lora {
                name: &l.name,
                path: l.path.as_deref(),
            });
        }
        if !self.mm.is_empty() {
            let (s, e) = (start as u64, end as u64);
            let first = self.mm.partition_point(|f| f.offset + f.length <= s);
            for f in &self.mm[first..] {
                if f.offset >= e {
                    break;
                }
                out.push(ExtraKey::Mm {
                    identifier: &f.identifier,
                    offset: f.offset as i64 - start as i64,
                });
            }
        }
        if start == 0
            && let Some(salt) = &self.cache_salt
        {
            out.push(ExtraKey::CacheSalt(salt));
        }
        if let Some(d) = &self.embed_digests {
            let empty = EMPTY_SHA256;
            let j = start / (end - start).max(1);
            out.push(ExtraKey::PromptEmbeds(*d.get(j).unwrap_or(&empty)));
        }
    }

    /// Event form of a block's extra keys (vLLM's `to_event_extra_keys`).
    pub fn event_extra_keys(&self, start: usize, end: usize) -> Option<Vec<EventExtraKey>> {
        let mut keys = Vec::new();
        self.extra_keys(start, end, &mut keys);
        if keys.is_empty() {
            return None;
        }
        Some(
            keys.iter()
                .map(|k| match *k {
                    ExtraKey::Lora { name, .. } => EventExtraKey::LoraName(name.to_owned()),
                    ExtraKey::Mm { identifier, offset } => {
                        EventExtraKey::Mm(identifier.to_owned(), offset)
                    }
                    ExtraKey::CacheSalt(s) => EventExtraKey::CacheSalt(s.to_owned()),
                    ExtraKey::PromptEmbeds(d) => EventExtraKey::PromptEmbeds(d),
                })
                .collect(),
        )
    }

    /// Hashes every newly full hash block. Allocates nothing in the common case:
    /// the hashes go straight into the request's vector (whose capacity covers
    /// [`HASH_HEADROOM`] blocks past the prompt), and the extra-key list stays
    /// empty for requests without a `LoRA` adapter, salt or multimodal items.
    pub fn update_hashes(&mut self, hasher: &mut BlockHasher, hash_block_size: usize) {
        self.hash_new_blocks(hasher, hash_block_size, true);
    }

    /// Whether its block hashes follow from its tokens alone (under the
    /// manager's hasher): no block has extra keys (no `LoRA` adapter, salt,
    /// multimodal item or prompt embeddings), no context digests are kept,
    /// and none are being computed elsewhere.
    pub(crate) fn hashes_follow_tokens(&self) -> bool {
        self.lora.is_none()
            && self.cache_salt.is_none()
            && self.mm.is_empty()
            && self.embed_digests.is_none()
            && !self.verify
            && self.pending.is_none()
    }

    /// Takes from `src` the hashes of the leading hash blocks the two share
    /// (as many whole blocks as their tokens agree on from the start and
    /// `src` has hashed): a block's hash follows from the tokens up to its
    /// end, so they are the hashes this request's blocks would get. Both must
    /// be requests of one manager whose hashes follow their tokens
    /// ([`Self::hashes_follow_tokens`]), this one without hashes yet. Returns
    /// the blocks taken.
    pub(crate) fn take_shared_hashes(&mut self, src: &Self, hash_block_size: usize) -> usize {
        debug_assert!(self.hash_vec.is_empty() && self.hashes_follow_tokens());
        debug_assert!(src.hashes_follow_tokens());
        let bs = hash_block_size;
        let limit = src.hash_vec.len().min(self.tokens.len() / bs);
        let (a, b) = (&self.tokens[..limit * bs], &src.tokens[..limit * bs]);
        let mut n = 0;
        // Whole runs of blocks compared at once (one `memcmp` each), the run
        // that differs block by block.
        while n < limit {
            let end = (n + SHARED_RUN).min(limit);
            if a[n * bs..end * bs] == b[n * bs..end * bs] {
                n = end;
                continue;
            }
            while a[n * bs..(n + 1) * bs] == b[n * bs..(n + 1) * bs] {
                n += 1;
            }
            break;
        }
        if n > 0 {
            let full = self.tokens.len() / bs;
            self.hash_vec.reserve(full + HASH_HEADROOM);
            self.hash_vec.extend_from_slice(&src.hash_vec[..n]);
        }
        n
    }

    /// [`Self::update_hashes`] for blocks filled by sampled tokens: not
    /// through the hash memo.
    pub(super) fn update_sampled_hashes(
        &mut self,
        hasher: &mut BlockHasher,
        hash_block_size: usize,
    ) {
        self.hash_new_blocks(hasher, hash_block_size, false);
    }

    fn hash_new_blocks(&mut self, hasher: &mut BlockHasher, hash_block_size: usize, memo: bool) {
        if self.pending.is_some() {
            self.settle(Some(&mut *hasher), hash_block_size);
        }
        if self.hash_vec.len() + 1 > self.hash_vec.capacity() {
            // Room for what is full now and the next HASH_HEADROOM blocks.
            let full = self.tokens.len() / hash_block_size;
            self.hash_vec
                .reserve(full.saturating_sub(self.hash_vec.len()) + HASH_HEADROOM);
        }
        // Moved out for the loop: the keys borrow the request, the hashes grow.
        let mut chain = std::mem::take(&mut self.hash_vec);
        let mut contexts = std::mem::take(&mut self.ctx_vec);
        let mut keys: Vec<ExtraKey<'_>> = Vec::new();
        let mut start = chain.len() * hash_block_size;
        if start + hash_block_size <= self.tokens.len() {
            let mut parent = chain.last().copied();
            let mut ctx = contexts.last().copied().unwrap_or([0; 32]);
            hasher.chain(memo, |hasher| {
                while start + hash_block_size <= self.tokens.len() {
                    let end = start + hash_block_size;
                    // The memo entry of a block a few ahead, loading while this
                    // one is hashed or looked up.
                    if let Some(later) = self.tokens.get(
                        end + MEMO_AHEAD * hash_block_size
                            ..end + (MEMO_AHEAD + 1) * hash_block_size,
                    ) {
                        hasher.prefetch(later);
                    }
                    self.extra_keys(start, end, &mut keys);
                    let h = hasher.hash(parent.as_ref(), &self.tokens[start..end], &keys);
                    chain.push(h);
                    if self.verify {
                        ctx = hasher.context_digest(&ctx, &self.tokens[start..end], &keys);
                        contexts.push(ctx);
                    }
                    parent = Some(h);
                    start = end;
                }
            });
        }
        drop(keys);
        self.hash_vec = chain;
        self.ctx_vec = contexts;
    }
}

/// `sha256(b"")`: vLLM hashes an empty embedding slice for blocks past the prompt.
pub(super) const EMPTY_SHA256: [u8; 32] = [
    0xe3, 0xb0, 0xc4, 0x42, 0x98, 0xfc, 0x1c, 0x14, 0x9a, 0xfb, 0xf4, 0xc8, 0x99, 0x6f, 0xb9, 0x24,
    0x27, 0xae, 0x41, 0xe4, 0x64, 0x9b, 0x93, 0x4c, 0xa4, 0x95, 0x99, 0x1b, 0x78, 0x52, 0xb8, 0x55,
];
