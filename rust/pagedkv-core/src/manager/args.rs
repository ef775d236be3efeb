//! The argument and result types of the manager's calls: a lookup's hit
//! (`ComputedBlocks`), `allocate_slots`' arguments (`AllocateArgs`) and the
//! batch allocation's result (`BatchAllocation`).

use crate::pool::BlockId;

/// Result of [`KvCacheManager::get_computed_blocks`](crate::KvCacheManager::get_computed_blocks): the prefix-cache hit of a
/// request, valid until blocks are evicted (it is re-validated when used).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ComputedBlocks {
    /// Hit blocks per group (null blocks pad skipped positions).
    pub block_ids: Vec<Vec<BlockId>>,
    /// Tokens covered by the hit.
    pub num_computed_tokens: u64,
    /// vLLM's `shared_prefix_boundary` (0 unless a sparse-retention group lags).
    pub shared_prefix_boundary: u64,
    /// Tokens past the device hit whose KV the host tier holds (0 without
    /// one): taken by passing them as `num_external_computed_tokens` at
    /// admission ([`KvCacheManager::take_transfer_plan`](crate::KvCacheManager::take_transfer_plan) then loads them).
    pub num_host_tokens: u64,
    pub(super) request_uid: u64,
    pub(super) manager_uid: u64,
    pub(super) epoch: u64,
}

impl ComputedBlocks {
    /// Whether every group's hit is empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.block_ids.iter().all(Vec::is_empty)
    }
}

/// Arguments of [`KvCacheManager::allocate_slots`](crate::KvCacheManager::allocate_slots) besides the request and hit
/// (vLLM's meaning for each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocateArgs {
    /// Tokens to compute this step (prefill chunk or decode tokens).
    pub num_new_tokens: u64,
    /// Tokens whose KV the request already has (held blocks).
    pub num_computed_tokens: u64,
    /// Tokens of the prefix hit adopted now (at most the hit's length).
    pub num_new_computed_tokens: u64,
    /// Speculative tokens to reserve slots for beyond the new tokens.
    pub num_lookahead_tokens: u64,
    /// Tokens whose KV an external connector supplies.
    pub num_external_computed_tokens: u64,
    /// Allocate now, publish blocks to the prefix cache later (`cache_blocks`).
    pub delay_cache_blocks: bool,
    /// Encoder-output tokens (cross-attention groups allocate for these).
    pub num_encoder_tokens: u64,
    /// Admit only if blocks for the whole request fit (vLLM's admission gate).
    pub full_sequence_must_fit: bool,
    /// Free blocks to leave untouched for other use.
    pub reserved_blocks: u64,
    /// Other requests are scheduled this step (the watermark applies).
    pub has_scheduled_reqs: bool,
    /// Tokens of in-flight steps (async scheduling) counted in the computed
    /// tokens: blocks they may still read are not released as skipped.
    pub num_in_flight_tokens: u64,
    /// vLLM's answers where pagedkv's own API is stricter: a request that can
    /// never fit gets `Ok(None)` instead of [`Error::CannotFit`](crate::Error::CannotFit), and computed
    /// tokens may exceed the blocks the request holds (an engine that set them
    /// itself, e.g. a disaggregated decode worker; the blocks are allocated) or
    /// its known tokens (async scheduling counts in-flight output tokens as
    /// computed before they are appended).
    pub vllm_lenient: bool,
    /// Groups (bit `g` for group `g`) whose blocks for external tokens an async
    /// load writes after this step: they are not listed for zeroing, which
    /// would race the load (vLLM's `skip_zeroing_group_ids`).
    pub skip_zeroing_groups: u64,
    /// Blocks the engine-managed groups ([`crate::AttentionKind::EngineManaged`])
    /// take from the pool in this step, counted with the manager's own in the
    /// step's capacity check (vLLM adds up every group's need before any
    /// allocates).
    pub engine_managed_blocks: u64,
    /// The same for the whole request, counted in the `full_sequence_must_fit`
    /// check.
    pub engine_managed_full_blocks: u64,
    /// Allocate fresh blocks only for the groups before this one; the engine's
    /// managed groups between take theirs from the pool, then
    /// [`KvCacheManager::finish_allocation`](crate::KvCacheManager::finish_allocation) allocates for the rest and caches
    /// (vLLM allocates group by group, so a core group after an engine-managed
    /// one gets its blocks after that group's). `None`: every group at once.
    pub split_at_group: Option<usize>,
}

impl AllocateArgs {
    /// Only the counts of a step (new, computed and lookahead tokens) differ
    /// from [`Self::step`]'s defaults: nothing adopted, loaded, reserved,
    /// delayed or in flight.
    #[must_use]
    pub fn is_plain_step(&self) -> bool {
        !self.delay_cache_blocks && self.is_plain_step_if_caching()
    }

    /// A running request's step: `num_new_tokens` after `num_computed_tokens`.
    #[must_use]
    pub fn step(num_new_tokens: u64, num_computed_tokens: u64) -> Self {
        Self {
            num_new_tokens,
            num_computed_tokens,
            num_new_computed_tokens: 0,
            num_lookahead_tokens: 0,
            num_external_computed_tokens: 0,
            delay_cache_blocks: false,
            num_encoder_tokens: 0,
            full_sequence_must_fit: false,
            reserved_blocks: 0,
            has_scheduled_reqs: true,
            num_in_flight_tokens: 0,
            vllm_lenient: false,
            skip_zeroing_groups: 0,
            engine_managed_blocks: 0,
            engine_managed_full_blocks: 0,
            split_at_group: None,
        }
    }

    /// `num_new_computed_tokens` as given, or when the caller gave none, the
    /// tokens of the hit it passes (0 without one): a lookup is adopted whole.
    #[must_use]
    pub fn num_new_computed_tokens_or_hit(given: Option<u64>, hit: Option<&ComputedBlocks>) -> u64 {
        given.unwrap_or_else(|| hit.map_or(0, |h| h.num_computed_tokens))
    }
}

/// Output of [`KvCacheManager::allocate_slots_batch`](crate::KvCacheManager::allocate_slots_batch): per group, the new block
/// ids of every admitted request concatenated, with `offsets[g][i]..offsets[g][i+1]`
/// the span of request `i`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BatchAllocation {
    /// Requests served (a prefix of the batch).
    pub num_allocated: usize,
    /// Per group, the new block ids of the served requests, concatenated.
    pub block_ids: Vec<Vec<BlockId>>,
    /// Per group, `num_allocated + 1` offsets into `block_ids`.
    pub offsets: Vec<Vec<u32>>,
}
