//! Opt-in block metrics of a pool: counters and the activity log a residency
//! collector samples (vLLM's pool reports to its `KVCacheMetricsCollector` at the
//! same points).

use super::BlockId;

/// What happened to a block, as vLLM's pool reports it to its metrics collector.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum BlockActivityKind {
    /// Popped from the free queue for a request (`on_block_allocated`).
    Allocated = 0,
    /// Taken as a prefix hit (`on_block_accessed`).
    Accessed = 1,
    /// Seen by the eviction of its cached content (`on_block_evicted`); vLLM
    /// reports every block it considers, cached or not.
    Evicted = 2,
    /// The prefix cache was reset (`reset`); the block is the null block.
    Reset = 3,
}

/// One entry of the pool's block activity log.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockActivity {
    /// What happened.
    pub kind: BlockActivityKind,
    /// To which block.
    pub block: BlockId,
}

/// Cumulative block counters of a pool built
/// [`BlockPool::with_metrics`](super::BlockPool::with_metrics).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockPoolStats {
    /// Blocks popped from the free queue for requests.
    pub blocks_allocated: u64,
    /// Prefix-hit blocks taken by requests.
    pub blocks_accessed: u64,
    /// Cached blocks that lost their cache entry to an eviction (a reuse of the
    /// block, or `evict_blocks`).
    pub blocks_evicted: u64,
    /// Successful prefix-cache resets.
    pub cache_resets: u64,
}

/// Opt-in metrics of a pool: counters, and the activity a residency collector
/// samples (vLLM's pool calls its `KVCacheMetricsCollector` at the same points).
#[derive(Debug, Default)]
pub(super) struct PoolMetrics {
    pub(super) stats: BlockPoolStats,
    /// Drained by [`BlockPool::take_block_activity`](super::BlockPool::take_block_activity).
    pub(super) activity: Vec<BlockActivity>,
    /// The most entries `activity` keeps (0: the default).
    pub(super) cap: usize,
    /// Entries dropped, oldest first, to keep `activity` under its cap.
    pub(super) dropped: u64,
}

impl PoolMetrics {
    pub(super) fn log(&mut self, kind: BlockActivityKind, block: BlockId) {
        let cap = if self.cap == 0 {
            crate::spec::PENDING_ACTIVITY_DEFAULT as usize
        } else {
            self.cap
        };
        self.dropped += super::drop_oldest(&mut self.activity, cap);
        self.activity.push(BlockActivity { kind, block });
    }
}
