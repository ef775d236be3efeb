//! Write-back ([`WritePolicy::WriteBack`](super::WritePolicy)): a request's
//! full chunks are not offered to the host tier as it computes them; when it
//! releases its blocks (finished or preempted) its cached chunks become
//! candidates, and each transfer plan writes back the candidates whose blocks
//! have come within the window at the free queue's head (the blocks the pool
//! evicts next). A candidate whose blocks were evicted or recached first is
//! dropped and counted (`write_backs_missed`): its content is gone, never
//! written.
//!
//! Candidates are indexed by block (a block belongs to one candidate at a
//! time), so they never outnumber the pool's blocks.

use rustc_hash::FxHashMap;

use super::Transfer;
use crate::error::{Error, Result};
use crate::manager::KvCacheManager;
use crate::offload::OffloadKey;
use crate::pool::{BlockId, BlockPool};

/// The tier's request keys for write-back offers: one per plan, above every
/// request uid the manager hands out.
pub(super) const WRITE_BACK_UIDS: u64 = 1 << 63;

/// A freed chunk waiting to be written back.
#[derive(Clone, Debug)]
struct Candidate {
    /// The request that freed it (named in its transfer).
    request_id: String,
    /// The chunk's index in that request (its position for the tier's policy).
    index: usize,
    /// One key per group, in group order.
    keys: Vec<OffloadKey>,
    /// Per group, the chunk's device blocks.
    blocks: Vec<Vec<BlockId>>,
    /// Each block's cache stamp when it was freed (group by group).
    stamps: Vec<u64>,
}

impl Candidate {
    /// Whether every block still holds what it held when freed.
    fn intact(&self, pool: &BlockPool) -> bool {
        self.blocks
            .iter()
            .flatten()
            .zip(&self.stamps)
            .all(|(&b, &s)| pool.cache_stamp(b) == Some(s))
    }
}

/// The candidates of a write-back tier.
#[derive(Debug)]
pub(super) struct WriteBack {
    /// Blocks at the free queue's head looked at each plan.
    window: u32,
    chunks: FxHashMap<u64, Candidate>,
    by_block: FxHashMap<BlockId, u64>,
    next_id: u64,
    next_uid: u64,
}

impl WriteBack {
    pub(super) fn new(window: u32) -> Self {
        Self {
            window,
            chunks: FxHashMap::default(),
            by_block: FxHashMap::default(),
            next_id: 0,
            next_uid: WRITE_BACK_UIDS,
        }
    }

    fn remove(&mut self, id: u64) -> Option<Candidate> {
        let c = self.chunks.remove(&id)?;
        for b in c.blocks.iter().flatten() {
            if self.by_block.get(b) == Some(&id) {
                self.by_block.remove(b);
            }
        }
        Some(c)
    }

    /// Adds a candidate, replacing those sharing a block with it; returns how
    /// many replaced ones had lost their content (evicted unwritten).
    fn insert(&mut self, c: Candidate, pool: &BlockPool) -> u64 {
        let mut missed = 0;
        for b in c.blocks.iter().flatten() {
            if let Some(&old) = self.by_block.get(b)
                && let Some(gone) = self.remove(old)
            {
                missed += u64::from(!gone.intact(pool));
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        for &b in c.blocks.iter().flatten() {
            self.by_block.insert(b, id);
        }
        self.chunks.insert(id, c);
        missed
    }

    /// Candidates waiting.
    pub(super) fn len(&self) -> usize {
        self.chunks.len()
    }

    pub(super) fn check(&self, num_blocks: u32) -> Result<()> {
        let indexed: usize = self.chunks.values().map(|c| c.stamps.len()).sum();
        let bad = self.by_block.iter().any(|(b, id)| {
            *b >= num_blocks
                || !self
                    .chunks
                    .get(id)
                    .is_some_and(|c| c.blocks.iter().flatten().any(|x| x == b))
        });
        if bad || indexed != self.by_block.len() {
            return Err(Error::InvariantViolation(format!(
                "write-back: {} blocks indexed for {indexed} candidate blocks",
                self.by_block.len()
            )));
        }
        Ok(())
    }
}

impl KvCacheManager {
    /// A write-back tier: the request's cached full chunks become candidates
    /// as it releases its blocks.
    pub(super) fn write_back_record(&mut self, slot: u32) {
        let req = self.table.get(slot);
        let pool = self.coord.pool();
        let Some(off) = self.offload.as_deref_mut() else {
            return;
        };
        let Some(wb) = off.write_back.as_mut() else {
            return;
        };
        let Some(cached) = req.groups().iter().map(|g| g.num_cached).min().flatten() else {
            return;
        };
        let bpc = off.cfg.blocks_per_chunk as usize;
        let hpc = bpc * off.hashes_per_block;
        let storable = (cached / bpc).min(req.hashes().len() / hpc);
        let mut missed = 0;
        for c in 0..storable {
            let h = &req.hashes()[(c + 1) * hpc - 1];
            let blocks: Vec<Vec<BlockId>> = req
                .groups()
                .iter()
                .map(|g| g.blocks()[c * bpc..(c + 1) * bpc].to_vec())
                .collect();
            let stamps: Option<Vec<u64>> = blocks
                .iter()
                .flatten()
                .map(|&b| pool.cache_stamp(b))
                .collect();
            let Some(stamps) = stamps else {
                continue;
            };
            let keys = (0..off.num_groups as u32)
                .map(|g| OffloadKey::new(h.as_bytes(), g).expect("a block hash fits a key"))
                .collect();
            let cand = Candidate {
                request_id: req.id.clone(),
                index: c,
                keys,
                blocks,
                stamps,
            };
            missed += wb.insert(cand, pool);
        }
        off.stats.write_backs_missed += missed;
    }

    /// The write-back stores of this plan: every candidate with a block among
    /// the first `window` blocks of the free queue.
    pub(super) fn plan_write_backs(&mut self, out: &mut Vec<Transfer>) -> Result<()> {
        let pool = self.coord.pool();
        let off = self.offload.as_deref_mut().expect("checked by the caller");
        let Some(wb) = off.write_back.as_mut() else {
            return Ok(());
        };
        let mut due = Vec::new();
        for b in pool.free_queue_prefix(wb.window as usize) {
            if let Some(&id) = wb.by_block.get(&b)
                && !due.contains(&id)
            {
                due.push(id);
            }
        }
        if due.is_empty() {
            return Ok(());
        }
        let uid = wb.next_uid;
        wb.next_uid += 1;
        off.tier.on_new_request(uid);
        let bpc = u64::from(off.cfg.blocks_per_chunk);
        let mut to_touch = Vec::new();
        for id in due {
            let c = off
                .write_back
                .as_mut()
                .and_then(|wb| wb.remove(id))
                .expect("a due candidate is waiting");
            if !c.intact(pool) {
                off.stats.write_backs_missed += 1;
                continue;
            }
            let positions = vec![c.index as i64; c.keys.len()];
            let Some(stored) = off.tier.prepare_store(&c.keys, uid, &positions)? else {
                off.stats.stores_refused += 1;
                continue;
            };
            off.stats.evictions += stored.evicted.len() as u64;
            if stored.keys_to_store.is_empty() {
                continue;
            }
            let mut groups = Vec::new();
            for (key, &s) in stored.keys_to_store.iter().zip(&stored.slots) {
                let g = c
                    .keys
                    .iter()
                    .position(|k| k == key)
                    .expect("an offered key");
                let h: Vec<u64> = (0..bpc).map(|b| s * bpc + b).collect();
                groups.push((g as u32, c.blocks[g].clone(), h));
            }
            off.add_store_job(
                (u32::MAX, uid, &c.request_id),
                stored.keys_to_store,
                groups,
                (out, &mut to_touch),
            );
        }
        off.tier.on_request_finished(uid, &[], &[])?;
        off.tier.forget_request(uid);
        self.hold_blocks(&to_touch)
    }
}
