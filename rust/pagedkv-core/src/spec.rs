//! KV-cache group specs and the manager's configuration.

use crate::error::{Error, Result};
use crate::hash::HashAlgo;

/// The attention type of a KV-cache group, with the fields its manager needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AttentionKind {
    /// Full (causal) attention: every block stays needed until the request ends.
    FullAttention,
    /// Multi-head latent attention: managed exactly like full attention.
    MlaAttention,
}

impl AttentionKind {
    /// vLLM's `KVCacheSpecKind` value, used to annotate `BlockStored` events.
    #[must_use]
    pub fn spec_kind(&self) -> &'static str {
        match self {
            Self::FullAttention => "full_attention",
            Self::MlaAttention => "mla_attention",
        }
    }

    /// The sliding window published in events (`None` for other types).
    #[must_use]
    pub fn sliding_window(&self) -> Option<u32> {
        None
    }

    /// Whether the group is managed by vLLM's `FullAttentionManager`.
    #[must_use]
    pub fn is_full_attention(&self) -> bool {
        matches!(self, Self::FullAttention | Self::MlaAttention)
    }
}

/// One KV-cache group as the manager sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupSpec {
    pub kind: AttentionKind,
    /// Tokens per block.
    pub block_size: u32,
}

/// Everything a [`crate::KvCacheManager`] is built from.
#[derive(Clone, Debug)]
pub struct ManagerConfig {
    /// Blocks in the pool, the null block included.
    pub num_blocks: u32,
    pub groups: Vec<GroupSpec>,
    pub max_model_len: u64,
    pub enable_caching: bool,
    pub hash_algo: HashAlgo,
    /// Seed of `NONE_HASH` (vLLM reads `PYTHONHASHSEED`). `None`: vLLM's fixed
    /// default for `sha256_cbor`; a random per-manager seed for the
    /// non-cryptographic algorithms.
    pub hash_seed: Option<String>,
    /// Hash granularity in tokens; must divide every group's block size.
    /// `None`: the smallest group block size.
    pub hash_block_size: Option<u32>,
    /// EAGLE / MTP: drop the last matched block of every hit.
    pub use_eagle: bool,
    pub log_stats: bool,
    pub enable_kv_cache_events: bool,
    /// Fraction of `num_blocks` kept free when admitting waiting requests.
    pub watermark: f64,
}

impl ManagerConfig {
    /// A single full-attention group with defaults everywhere else.
    #[must_use]
    pub fn full_attention(num_blocks: u32, block_size: u32, max_model_len: u64) -> Self {
        Self {
            num_blocks,
            groups: vec![GroupSpec {
                kind: AttentionKind::FullAttention,
                block_size,
            }],
            max_model_len,
            enable_caching: true,
            hash_algo: HashAlgo::Sha256Cbor,
            hash_seed: None,
            hash_block_size: None,
            use_eagle: false,
            log_stats: false,
            enable_kv_cache_events: false,
            watermark: 0.0,
        }
    }

    pub(crate) fn validate(&self) -> Result<u32> {
        let bad = |m: String| Err(Error::InvalidConfig(m));
        if self.num_blocks == 0 {
            return bad("num_blocks must be at least 1 (block 0 is the null block)".into());
        }
        if self.num_blocks == u32::MAX {
            return bad("num_blocks must be below 2^32 - 1".into());
        }
        if self.groups.is_empty() {
            return bad("at least one KV-cache group is required".into());
        }
        if self.max_model_len == 0 {
            return bad("max_model_len must be positive".into());
        }
        if !(self.watermark >= 0.0 && self.watermark.is_finite()) {
            return bad(format!(
                "watermark must be a non-negative number, got {}",
                self.watermark
            ));
        }
        for (i, g) in self.groups.iter().enumerate() {
            if g.block_size == 0 {
                return bad(format!("group {i}: block_size must be positive"));
            }
        }
        let min_bs = self.groups.iter().map(|g| g.block_size).min().unwrap_or(1);
        let hbs = self.hash_block_size.unwrap_or(min_bs);
        if hbs == 0 {
            return bad("hash_block_size must be positive".into());
        }
        if let Some(g) = self.groups.iter().find(|g| g.block_size % hbs != 0) {
            return bad(format!(
                "hash_block_size {hbs} must divide every group's block size (found {})",
                g.block_size
            ));
        }
        if self.enable_caching && self.groups.len() > 1 {
            let first = &self.groups[0];
            if self.groups.iter().any(|g| g != first) {
                return bad(
                    "prefix caching over groups of different specs needs the hybrid \
                     coordinator, which this build does not provide"
                        .into(),
                );
            }
        }
        Ok(hbs)
    }
}
