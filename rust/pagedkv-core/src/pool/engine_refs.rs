//! References an engine holds on pool blocks outside any request's table, and
//! blocks it unpins to the free queue's tail while watching them for reuse
//! (vLLM's `unpin_blocks`).

use super::{BlockId, BlockPool, NULL_BLOCK};
use crate::error::{Result, invalid};

impl BlockPool {
    /// Drops one reference from each block while its contents stay readable
    /// until the pool reuses it (vLLM's `unpin_blocks`): a block reaching 0
    /// joins the tail of the free queue, cached or not, so it is taken last,
    /// and the block is watched: [`Self::take_reused`] lists it once
    /// [`Self::get_new_blocks`] hands it out or a reset wipes the cache. The
    /// null block is skipped; each block must be referenced (the caller checks).
    pub fn unpin(&mut self, ids: &[BlockId]) {
        let mut last = std::mem::take(&mut self.scratch_last);
        last.clear();
        for &id in ids {
            if id == NULL_BLOCK {
                continue;
            }
            let b = &mut self.blocks[id as usize];
            debug_assert!(b.ref_cnt > 0, "unpin of a free block {id}");
            b.ref_cnt -= 1;
            self.watched.insert(id);
            if b.ref_cnt == 0 {
                last.push(id);
            }
        }
        if self.segments.is_some() {
            self.free_segmented(&[], &last);
        } else {
            self.append_n(&last);
        }
        self.scratch_last = last;
    }

    /// The watched blocks ([`Self::unpin`]) reused since the last call, in the
    /// order they were handed out; a reset lists every watched block. Left
    /// undrained, the list stays within
    /// [`PENDING_BLOCKS_PER_POOL_BLOCK`](super::PENDING_BLOCKS_PER_POOL_BLOCK)
    /// entries a block: a block reused again then keeps its first listing only
    /// (nothing is lost: its watcher learns it was reused).
    pub fn take_reused(&mut self) -> Vec<BlockId> {
        std::mem::take(&mut self.reused)
    }

    /// One more engine-held reference on `b` (the null block is skipped).
    pub(crate) fn engine_hold(&mut self, b: BlockId) {
        if b != NULL_BLOCK {
            *self.engine_refs.entry(b).or_insert(0) += 1;
        }
    }

    /// The references the engine holds on `b`.
    #[must_use]
    pub(crate) fn engine_refs_of(&self, b: BlockId) -> u32 {
        self.engine_refs.get(&b).copied().unwrap_or(0)
    }

    /// Drops one engine-held reference on `b`; `false` (nothing changed) when
    /// the engine holds none.
    pub(crate) fn engine_release_one(&mut self, b: BlockId) -> bool {
        match self.engine_refs.get_mut(&b) {
            Some(1) => {
                self.engine_refs.remove(&b);
                true
            }
            Some(n) => {
                *n -= 1;
                true
            }
            None => false,
        }
    }

    /// Every engine-held reference, per block.
    pub(crate) fn engine_refs(&self) -> impl Iterator<Item = (BlockId, u32)> + '_ {
        self.engine_refs.iter().map(|(&b, &n)| (b, n))
    }

    /// Drops the engine's references on `ids` (as often as each is listed;
    /// null blocks skipped), or refuses with nothing changed when it holds
    /// fewer. Ref counts are the caller's to drop.
    pub(crate) fn engine_release(&mut self, ids: &[BlockId], verb: &str) -> Result<()> {
        let mut want: rustc_hash::FxHashMap<BlockId, u32> = rustc_hash::FxHashMap::default();
        for &b in ids {
            if b != NULL_BLOCK {
                *want.entry(b).or_insert(0) += 1;
            }
        }
        if let Some((&b, &n)) = want
            .iter()
            .find(|&(b, &n)| self.engine_refs.get(b).is_none_or(|&held| held < n))
        {
            return Err(invalid(format!(
                "block {b} is {verb} {n} time(s) but the engine holds only {} reference(s) \
                 (from pop_blocks_for_free, get_new_blocks or touch_blocks)",
                self.engine_refs_of(b)
            )));
        }
        for (b, n) in want {
            let held = self.engine_refs.get_mut(&b).map_or(0, |h| {
                *h -= n;
                *h
            });
            if held == 0 {
                self.engine_refs.remove(&b);
            }
        }
        Ok(())
    }

    /// Whether any block is watched or reported reused and not yet taken.
    #[must_use]
    pub fn watches_blocks(&self) -> bool {
        !self.watched.is_empty() || !self.reused.is_empty()
    }
}
