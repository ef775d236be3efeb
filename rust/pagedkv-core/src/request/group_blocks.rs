//! One request's blocks in one KV-cache group (`GroupBlocks`), the state the
//! request holds per group and its group manager reads and changes.

use crate::pool::BlockId;
use rustc_hash::FxHashMap;

/// One request's blocks in one KV-cache group. What a decode step reads (the
/// blocks, the cached count, a pending partial hit) is its first cache line.
/// Its fields are the group managers' (`crate::single_type`) to read and
/// change; the rest of the crate reads them through the accessors.
#[derive(Clone, Debug, Default)]
#[repr(C, align(64))]
pub(crate) struct GroupBlocks {
    pub(crate) blocks: Vec<BlockId>,
    /// Number of leading blocks already cached; `Some` once the request is
    /// running in this group (vLLM's `num_cached_block` entry).
    pub(crate) num_cached: Option<usize>,
    /// A prefix hit ending inside a block: `(index, shared block)`, copied on
    /// write into a private block at the next allocation (vLLM's
    /// `_partial_hit_reqs`).
    pub(crate) partial_hit: Option<(usize, BlockId)>,
    /// Mamba "align": blocks were allocated since admission.
    pub(crate) mamba_allocated: bool,
    /// Mamba "align": index of the previous step's state block.
    pub(crate) mamba_last_state: Option<usize>,
    /// Mamba "align": blocks before this index were already retired.
    pub(crate) mamba_retired: usize,
    /// Mamba "align": the prefill checkpoint this step reserved, `(position,
    /// column)` (vLLM's `_checkpoints`).
    pub(crate) checkpoint: Option<(u64, usize)>,
    /// Mamba "align": the request registered its own prompt boundary inside a
    /// block it keeps writing, `(block, boundary tokens)`.
    pub(crate) producer_tail: Option<(BlockId, u64)>,
    /// HiSparse resident: the residency overlay (page -> block read now;
    /// `single_type::hisparse::Overlay`).
    pub(crate) overlay: Option<FxHashMap<usize, BlockId>>,
    /// HiSparse hot: the request needs its hot region.
    pub(crate) hot_required: bool,
}

// What a decode step reads of a group's blocks stays in its first cache line.
const _: () = {
    use std::mem::{align_of, offset_of, size_of};
    assert!(align_of::<GroupBlocks>() == 64);
    assert!(offset_of!(GroupBlocks, blocks) + size_of::<Vec<BlockId>>() <= 64);
    assert!(offset_of!(GroupBlocks, num_cached) + size_of::<Option<usize>>() <= 64);
    assert!(offset_of!(GroupBlocks, partial_hit) + size_of::<Option<(usize, BlockId)>>() <= 64);
};

/// Block ids a request's table reserves room for beyond those it holds when it
/// grows: a decode that needs this many more blocks appends them without a
/// reallocation.
const BLOCK_HEADROOM: usize = 64;

impl GroupBlocks {
    /// Appends newly allocated blocks, reserving [`BLOCK_HEADROOM`] more when the
    /// table has to grow (steady-state decode then never reallocates it).
    pub(crate) fn extend_blocks(&mut self, ids: &[BlockId]) {
        if self.blocks.len() + ids.len() > self.blocks.capacity() {
            self.blocks.reserve(ids.len() + BLOCK_HEADROOM);
        }
        self.blocks.extend_from_slice(ids);
    }

    /// The block ids, by position (null blocks pad released positions).
    pub(crate) fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Leading blocks already cached; `Some` once the request runs in the group.
    pub(crate) fn num_cached(&self) -> Option<usize> {
        self.num_cached
    }

    /// The pending copy-on-write of a prefix hit ending inside a block.
    pub(crate) fn partial_hit(&self) -> Option<(usize, BlockId)> {
        self.partial_hit
    }

    /// Mamba "align": the prefill checkpoint reserved this step.
    pub(crate) fn checkpoint(&self) -> Option<(u64, usize)> {
        self.checkpoint
    }
}
