//! KV-cache events with vLLM 0.33's fields (`vllm/distributed/kv_events.py`).

use crate::hash::BlockHash;

/// One extra key as published in events: vLLM untags the hashing keys (bare LoRA
/// name, `(identifier, offset)` for multimodal items, bare salt, bare digest).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EventExtraKey {
    LoraName(String),
    Mm(String, i64),
    CacheSalt(String),
    PromptEmbeds([u8; 32]),
}

/// `BlockStored`: full blocks newly entered into the prefix cache by one call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockStored {
    pub block_hashes: Vec<BlockHash>,
    pub parent_block_hash: Option<BlockHash>,
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub lora_id: Option<i64>,
    pub lora_name: Option<String>,
    /// One entry per stored block (`None` for a block without keys); `None`
    /// overall when no block was stored.
    pub extra_keys: Option<Vec<Option<Vec<EventExtraKey>>>>,
    pub group_idx: u32,
    /// vLLM's spec-kind annotation (`"full_attention"`, `"sliding_window"`, ...).
    pub kv_cache_spec_kind: Option<&'static str>,
    pub kv_cache_spec_sliding_window: Option<u32>,
}

/// A KV-cache event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    BlockStored(BlockStored),
    /// One evicted block (vLLM emits one event per block).
    BlockRemoved {
        block_hashes: Vec<BlockHash>,
        group_idx: u32,
    },
    AllBlocksCleared,
}
