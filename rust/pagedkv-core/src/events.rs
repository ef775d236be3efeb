//! KV-cache events with vLLM 0.33's fields (`vllm/distributed/kv_events.py`).

use crate::hash::BlockHash;

/// The token id standing for vLLM's `-1` placeholder (multimodal positions in
/// an engine's token lists); events publish it as `-1`.
pub const PLACEHOLDER_TOKEN: u32 = u32::MAX;

/// One extra key as published in events: vLLM untags the hashing keys (bare `LoRA`
/// name, `(identifier, offset)` for multimodal items, bare salt, bare digest).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EventExtraKey {
    /// The request's `LoRA` adapter name.
    LoraName(String),
    /// A multimodal item: its identifier and offset from the block start.
    Mm(String, i64),
    /// The request's cache salt (first block only).
    CacheSalt(String),
    /// SHA-256 of the block's prompt-embedding bytes.
    PromptEmbeds([u8; 32]),
}

/// `BlockStored`: full blocks newly entered into the prefix cache by one call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockStored {
    /// Hashes of the stored blocks, in order.
    pub block_hashes: Vec<BlockHash>,
    /// Hash of the block before the first stored one (`None` at the start).
    pub parent_block_hash: Option<BlockHash>,
    /// Token ids of the blocks' span.
    pub token_ids: Vec<u32>,
    /// Tokens per stored block.
    pub block_size: u32,
    /// The request's `LoRA` id, if any.
    pub lora_id: Option<i64>,
    /// The request's `LoRA` name, if any.
    pub lora_name: Option<String>,
    /// One entry per stored block (`None` for a block without keys); `None`
    /// overall when no block was stored.
    pub extra_keys: Option<Vec<Option<Vec<EventExtraKey>>>>,
    /// The KV-cache group the blocks belong to.
    pub group_idx: u32,
    /// vLLM's spec-kind annotation (`"full_attention"`, `"sliding_window"`, ...).
    pub kv_cache_spec_kind: Option<&'static str>,
    /// The group's sliding window, for sliding-window groups.
    pub kv_cache_spec_sliding_window: Option<u32>,
    /// The session of the request that stored the blocks, if it named one.
    pub session_id: Option<String>,
    /// With lookahead hashing: per stored block, the tokens after it that its
    /// hash covers.
    pub lookahead_token_ids: Option<Vec<Vec<u32>>>,
}

/// A KV-cache event.
#[derive(Clone, Debug, PartialEq, Eq)]
// Stored events dominate the stream; boxing them would add an allocation each.
#[allow(clippy::large_enum_variant)]
pub enum KvEvent {
    /// Blocks entered the prefix cache.
    BlockStored(BlockStored),
    /// One evicted block (vLLM emits one event per block).
    BlockRemoved {
        /// The evicted block's hash.
        block_hashes: Vec<BlockHash>,
        /// Its KV-cache group.
        group_idx: u32,
    },
    /// The prefix cache was reset.
    AllBlocksCleared,
}
