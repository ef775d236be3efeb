//! pagedkv-core: the KV-cache block manager of an LLM serving engine.
//!
//! It decides which GPU memory blocks each request holds, which prompt prefixes
//! are already cached and what to evict — vLLM 0.33's `KVCacheManager` semantics
//! (same block ids, same hit lengths, same events) in a pure-Rust core.
//!
//! ```
//! use pagedkv_core::{AllocateArgs, KvCacheManager, ManagerConfig, RequestSpec};
//!
//! let mut mgr = KvCacheManager::new(ManagerConfig::full_attention(11, 16, 4096)).unwrap();
//! let prompt: Vec<u32> = (0..55).collect();
//! mgr.add_request("r0", RequestSpec { prompt_token_ids: prompt.clone(), ..Default::default() }).unwrap();
//! let hit = mgr.get_computed_blocks("r0").unwrap();
//! assert_eq!(hit.num_computed_tokens, 0);
//! let new = mgr.allocate_slots("r0", &AllocateArgs::step(55, 0), Some(&hit)).unwrap();
//! assert_eq!(new.unwrap()[0], vec![1, 2, 3, 4]);
//!
//! // A second request sharing the first 48 tokens hits three cached blocks.
//! let mut p1 = prompt[..48].to_vec();
//! p1.extend([900, 901, 902, 903, 904]);
//! mgr.add_request("r1", RequestSpec { prompt_token_ids: p1, ..Default::default() }).unwrap();
//! let hit = mgr.get_computed_blocks("r1").unwrap();
//! assert_eq!(hit.block_ids[0], vec![1, 2, 3]);
//! let args = AllocateArgs { num_new_computed_tokens: 48, ..AllocateArgs::step(5, 0) };
//! assert_eq!(mgr.allocate_slots("r1", &args, Some(&hit)).unwrap().unwrap()[0], vec![5]);
//! mgr.check_invariants().unwrap();
//! ```
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod coordinator;
pub mod error;
pub mod events;
pub mod fork;
pub mod hash;
pub mod manager;
pub mod offload;
pub mod outcome;
pub mod pool;
pub mod prefix_index;
pub mod request;
pub mod request_table;
pub mod single_type;
pub mod spec;
pub mod stats;
pub mod sync;
mod verify;

pub use error::{Error, Result};
pub use events::{BlockStored, EventExtraKey, KvEvent, PLACEHOLDER_TOKEN};
pub use hash::{BlockHash, BlockHasher, CborValue, ExtraKey, HashAlgo};
pub use manager::{
    AllocateArgs, BatchAllocation, BatchStep, ComputedBlocks, ConnectorHit, DiskTransfer,
    EngineRequest, FailedLoad, KvCacheManager, OffloadConfig, OffloadStats, PreparedRequest,
    RequestHandle, RequestPreparer, RequestRefs, SyncAnchor, Transfer, TransferPlan, WritePolicy,
};
pub use pool::{BlockId, BlockPool, CacheKey, NULL_BLOCK};
pub use prefix_index::{PrefixIndex, PrefixMatch, ReplicaId};
pub use request::{Lora, MmFeature, OUTPUT_ROOM, RequestSpec};
pub use spec::{AttentionKind, Eviction, GroupSpec, MambaCacheMode, ManagerConfig};
pub use stats::PrefixCacheStats;
