//! The host tier's configuration, a step's transfer plan, failed loads and
//! the tier's totals.

use crate::offload::{DiskConfig, PolicyKind};
use crate::pool::BlockId;

/// When the device's chunks are written to the host tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WritePolicy {
    /// As soon as a request has computed and cached a full chunk (vLLM's
    /// offloading connector; `SGLang` `HiCache`'s `write_through`).
    #[default]
    WriteThrough,
    /// Only once the chunk's blocks are free and among the next `window`
    /// blocks the pool would evict (`SGLang` `HiCache`'s `write_back`): a prefix
    /// evicted from the device lands in the host tier, one still used on the
    /// device costs no copy. A written-back chunk's blocks return to the free
    /// queue's tail when the copy completes (as vLLM's lazy CPU offload does).
    WriteBack {
        /// Blocks at the free queue's head looked at each plan (at least the
        /// blocks a step allocates, or some are evicted unwritten).
        window: u32,
    },
}

impl WritePolicy {
    /// `"write_through"` or `"write_back"` (with its window in blocks).
    ///
    /// # Errors
    /// `InvalidArgument` for another name.
    pub fn from_name(name: &str, window: u32) -> crate::error::Result<Self> {
        match name {
            "write_through" => Ok(Self::WriteThrough),
            "write_back" => Ok(Self::WriteBack { window }),
            other => Err(crate::error::invalid(format!(
                "unknown write policy {other:?}: supported are 'write_through' and 'write_back'"
            ))),
        }
    }
}

/// How the manager's host tier is built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OffloadConfig {
    /// Chunk slots in host memory (at least 1).
    pub num_chunks: u64,
    /// GPU blocks per chunk (at least 1).
    pub blocks_per_chunk: u32,
    /// The tier's eviction policy.
    pub policy: PolicyKind,
    /// A chunk is stored only once offered this many times (vLLM's
    /// `store_threshold`; below 2: every chunk).
    pub store_threshold: u64,
    /// Record the tier's `BlockStored` / `BlockRemoved` events (medium `CPU`).
    pub enable_events: bool,
    /// Bytes one block of every group occupies in host memory (for the byte
    /// counts of [`OffloadStats`]; 0: not counted).
    pub bytes_per_block: u64,
    /// When chunks are written to the tier.
    pub write_policy: WritePolicy,
    /// A disk tier below host memory (`chunk_bytes`: one group's chunk):
    /// every chunk stored in host memory is written through to it, and a
    /// prefix found there is read back into host memory before it is loaded.
    pub disk: Option<DiskConfig>,
}

impl OffloadConfig {
    /// `num_chunks` chunks of one block, LRU, every chunk stored, no events.
    #[must_use]
    pub fn new(num_chunks: u64) -> Self {
        Self {
            num_chunks,
            blocks_per_chunk: 1,
            policy: PolicyKind::Lru,
            store_threshold: 1,
            enable_events: false,
            bytes_per_block: 0,
            write_policy: WritePolicy::WriteThrough,
            disk: None,
        }
    }
}

/// One copy job's blocks in one group: `device_blocks[i]` and
/// `host_blocks[i]` are the two ends of one block copy (host block `b` is
/// block `b % blocks_per_chunk` of tier slot `b / blocks_per_chunk`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transfer {
    /// The job, reported back to [`KvCacheManager::complete_transfers`].
    pub job: u64,
    /// The request the job is for.
    pub request_id: String,
    /// The KV-cache group.
    pub group: u32,
    /// Device block ids.
    pub device_blocks: Vec<BlockId>,
    /// Host block indices.
    pub host_blocks: Vec<u64>,
}

/// A copy between host memory and the disk tier: one group's chunk, at
/// `host_blocks` in host memory. Done by
/// [`KvCacheManager::read_disk_chunk`] / [`KvCacheManager::write_disk_chunk`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskTransfer {
    /// The job.
    pub job: u64,
    /// The KV-cache group.
    pub group: u32,
    /// Host block indices (the chunk's blocks, in order).
    pub host_blocks: Vec<u64>,
    /// A read's load (host → device) that copies the chunk on: when the read
    /// fails, the load fails too.
    pub load_job: Option<u64>,
}

/// A step's copies ([`KvCacheManager::take_transfer_plan`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TransferPlan {
    /// Disk → host, to finish before the loads that copy them on.
    pub disk_reads: Vec<DiskTransfer>,
    /// Host → device, to finish before the step's forward pass reads them.
    pub loads: Vec<Transfer>,
    /// Device → host, to start once the step's forward pass wrote them.
    pub stores: Vec<Transfer>,
    /// Host → disk (chunks stored in host memory, written through).
    pub disk_writes: Vec<DiskTransfer>,
}

/// A failed load of a request still known ([`KvCacheManager::complete_transfers`]):
/// its KV past `num_valid_tokens` was not loaded and must be recomputed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FailedLoad {
    /// The request.
    pub request_id: String,
    /// Tokens whose KV the request holds (its device hit).
    pub num_valid_tokens: u64,
}

/// The host tier's running totals, never reset.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OffloadStats {
    /// Lookups that looked past the device hit.
    pub queries: u64,
    /// Lookups that found a host hit.
    pub hits: u64,
    /// Tokens of the host hits found.
    pub hit_tokens: u64,
    /// Load jobs planned, completed, failed, cancelled before being taken.
    pub loads: u64,
    /// Load jobs completed.
    pub loads_completed: u64,
    /// Load jobs that failed.
    pub loads_failed: u64,
    /// Load jobs cancelled (request freed before the plan was taken).
    pub loads_cancelled: u64,
    /// Store jobs planned.
    pub stores: u64,
    /// Store jobs completed.
    pub stores_completed: u64,
    /// Store jobs that failed.
    pub stores_failed: u64,
    /// Blocks loaded (completed loads).
    pub blocks_loaded: u64,
    /// Blocks stored (completed stores).
    pub blocks_stored: u64,
    /// Bytes loaded (`blocks_loaded * bytes_per_block`).
    pub bytes_loaded: u64,
    /// Bytes stored.
    pub bytes_stored: u64,
    /// Chunks the tier evicted to make room.
    pub evictions: u64,
    /// Store offers the tier refused for want of evictable chunks.
    pub stores_refused: u64,
    /// Completions of jobs whose request was freed or preempted meanwhile.
    pub completions_after_free: u64,
    /// Write-back: freed chunks evicted from the device (or recached) before
    /// they could be written to the tier.
    pub write_backs_missed: u64,
    /// Chunks of host hits found on disk (read back into host memory).
    pub disk_hits: u64,
    /// Disk reads that returned the chunk.
    pub disk_reads_completed: u64,
    /// Disk reads that failed (corrupt, truncated or gone; abandoned): the
    /// load they fed failed too.
    pub disk_reads_failed: u64,
    /// Chunks written through to disk.
    pub disk_writes_completed: u64,
    /// Disk writes the disk refused (full) or the engine abandoned.
    pub disk_writes_failed: u64,
}

impl OffloadStats {
    /// A load's (`load`) or a store's completion, `ok` or failed, of `blocks`
    /// blocks and `bytes` bytes.
    pub(super) fn record_completion(&mut self, load: bool, ok: bool, blocks: u64, bytes: u64) {
        let (done, failed, moved, moved_bytes) = if load {
            (
                &mut self.loads_completed,
                &mut self.loads_failed,
                &mut self.blocks_loaded,
                &mut self.bytes_loaded,
            )
        } else {
            (
                &mut self.stores_completed,
                &mut self.stores_failed,
                &mut self.blocks_stored,
                &mut self.bytes_stored,
            )
        };
        if ok {
            *done += 1;
            *moved += blocks;
            *moved_bytes += bytes;
        } else {
            *failed += 1;
        }
    }

    /// Every total with its name.
    #[must_use]
    pub fn named(&self) -> [(&'static str, u64); 23] {
        [
            ("queries", self.queries),
            ("hits", self.hits),
            ("hit_tokens", self.hit_tokens),
            ("loads", self.loads),
            ("loads_completed", self.loads_completed),
            ("loads_failed", self.loads_failed),
            ("loads_cancelled", self.loads_cancelled),
            ("stores", self.stores),
            ("stores_completed", self.stores_completed),
            ("stores_failed", self.stores_failed),
            ("blocks_loaded", self.blocks_loaded),
            ("blocks_stored", self.blocks_stored),
            ("bytes_loaded", self.bytes_loaded),
            ("bytes_stored", self.bytes_stored),
            ("evictions", self.evictions),
            ("stores_refused", self.stores_refused),
            ("completions_after_free", self.completions_after_free),
            ("write_backs_missed", self.write_backs_missed),
            ("disk_hits", self.disk_hits),
            ("disk_reads_completed", self.disk_reads_completed),
            ("disk_reads_failed", self.disk_reads_failed),
            ("disk_writes_completed", self.disk_writes_completed),
            ("disk_writes_failed", self.disk_writes_failed),
        ]
    }
}
