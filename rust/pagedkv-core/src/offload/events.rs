//! The tier's events (vLLM 0.33 `OffloadingEvent`): keys stored in or removed
//! from a medium, in the order they happened.

use super::keys::OffloadKey;

/// Where a tier keeps its chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Medium {
    /// Host memory (vLLM's `Medium.CPU`).
    Cpu,
    /// Files on a local disk (vLLM's secondary `STORAGE` medium).
    Storage,
}

impl Medium {
    /// The medium's name on the wire.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Cpu => "CPU",
            Self::Storage => "STORAGE",
        }
    }
}

/// Keys stored (readable from now on) or removed from one medium.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OffloadEvent {
    /// The keys, in the order the call handled them.
    pub keys: Vec<OffloadKey>,
    /// The medium.
    pub medium: Medium,
    /// `true`: removed; `false`: stored.
    pub removed: bool,
    /// A failed store released the keys' slots: not an eviction anyone saw.
    pub metadata_only: bool,
}

/// One KV event a router reads (vLLM 0.33's offloading connector without
/// self-describing payloads): a stored chunk as its own `BlockStored` of one
/// hash; removals as one `BlockRemoved` per group in first-seen order; a
/// failed store's removal is not published.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TierKvEvent<'a> {
    /// `BlockStored(block_hashes=[hash], parent=None, token_ids=[], block_size=0)`.
    Stored {
        /// The chunk's block hash (its key without the group index).
        hash: &'a [u8],
        /// The key's group index.
        group_idx: u32,
        /// The medium.
        medium: Medium,
    },
    /// `BlockRemoved(block_hashes, medium, group_idx)`.
    Removed {
        /// The chunks' block hashes.
        hashes: Vec<&'a [u8]>,
        /// Their group index.
        group_idx: u32,
        /// The medium.
        medium: Medium,
    },
}

/// The KV events of a batch of tier events, as vLLM's connector publishes them.
#[must_use]
pub fn kv_events(events: &[OffloadEvent]) -> Vec<TierKvEvent<'_>> {
    let mut out = Vec::new();
    for e in events {
        if !e.removed {
            out.extend(e.keys.iter().map(|k| TierKvEvent::Stored {
                hash: k.block_hash(),
                group_idx: k.group_idx(),
                medium: e.medium,
            }));
            continue;
        }
        if e.metadata_only {
            continue;
        }
        let mut groups: Vec<(u32, Vec<&[u8]>)> = Vec::new();
        for k in &e.keys {
            let g = k.group_idx();
            match groups.iter_mut().find(|(gi, _)| *gi == g) {
                Some((_, hashes)) => hashes.push(k.block_hash()),
                None => groups.push((g, vec![k.block_hash()])),
            }
        }
        out.extend(
            groups
                .into_iter()
                .map(|(group_idx, hashes)| TierKvEvent::Removed {
                    hashes,
                    group_idx,
                    medium: e.medium,
                }),
        );
    }
    out
}
