//! Batch calls: one crossing serves every running request of a decode step,
//! with the same result as the single calls made in order.

use super::{AllocateArgs, BatchAllocation, KvCacheManager};
use crate::error::{Result, invalid};
use crate::request_table::RequestRefs;

impl KvCacheManager {
    /// Appends one sampled token to each of many requests (one crossing per
    /// step). All ids are checked before any token is appended.
    ///
    /// # Errors
    /// Unknown request or lengths that differ.
    pub fn append_token_ids_batch(&mut self, ids: &[&str], tokens: &[u32]) -> Result<()> {
        self.append_token_ids_batch_refs(RequestRefs::Ids(ids), tokens)
    }

    /// [`Self::append_token_ids_batch`] with requests named by ids or handles.
    ///
    /// # Errors
    /// Unknown request or lengths that differ.
    pub fn append_token_ids_batch_refs(
        &mut self,
        refs: RequestRefs<'_>,
        tokens: &[u32],
    ) -> Result<()> {
        if refs.len() != tokens.len() {
            return Err(invalid("request ids and token ids differ in length"));
        }
        let mut slots = std::mem::take(&mut self.scratch_slots);
        if let Err(e) = self.table.resolve(refs, &mut slots) {
            self.scratch_slots = slots;
            return Err(e);
        }
        if let Some(e) = slots
            .iter()
            .find_map(|&slot| self.check_room(slot, 1).err())
        {
            self.scratch_slots = slots;
            return Err(e);
        }
        let hbs = self.hash_block_size;
        let hashing = self.hashing();
        for (&slot, &t) in slots.iter().zip(tokens) {
            let hasher = hashing.then_some(&mut self.hasher);
            self.table.get_mut(slot).push_token(t, hasher, hbs);
        }
        self.scratch_slots = slots;
        Ok(())
    }

    /// One decode step for many running requests in one call: the same result as
    /// calling `allocate_slots` for each in order until the first that does not fit.
    ///
    /// # Errors
    /// Any invalid entry (checked for all entries before anything changes).
    pub fn allocate_slots_batch(
        &mut self,
        ids: &[&str],
        num_new_tokens: &[u64],
        num_computed_tokens: &[u64],
        num_lookahead_tokens: u64,
        out: &mut BatchAllocation,
    ) -> Result<()> {
        self.allocate_slots_batch_refs(
            RequestRefs::Ids(ids),
            num_new_tokens,
            num_computed_tokens,
            num_lookahead_tokens,
            out,
        )
    }

    /// [`Self::allocate_slots_batch_refs`] with each request's computed tokens
    /// taken from the manager: what its last allocated step scheduled through
    /// (computed tokens plus the tokens scheduled), as a decode step after the
    /// engine ran every scheduled token. The caller passes no counts.
    ///
    /// # Errors
    /// As [`Self::allocate_slots_batch_refs`] (an unknown request first).
    pub fn allocate_slots_batch_tracked(
        &mut self,
        refs: RequestRefs<'_>,
        num_new_tokens: &[u64],
        num_lookahead_tokens: u64,
        out: &mut BatchAllocation,
    ) -> Result<()> {
        check_lengths(refs.len(), num_new_tokens.len(), refs.len())?;
        let mut slots = std::mem::take(&mut self.scratch_slots);
        let mut counts = std::mem::take(&mut self.scratch_counts);
        let done = self.table.resolve(refs, &mut slots).and_then(|()| {
            counts.clear();
            counts.extend(slots.iter().map(|&s| self.table.get(s).scheduled_through));
            self.allocate_resolved(&slots, num_new_tokens, &counts, num_lookahead_tokens, out)
        });
        self.scratch_slots = slots;
        self.scratch_counts = counts;
        done
    }

    /// [`Self::allocate_slots_batch`] with requests named by ids or handles.
    ///
    /// # Errors
    /// Any invalid entry (checked for all entries before anything changes).
    pub fn allocate_slots_batch_refs(
        &mut self,
        refs: RequestRefs<'_>,
        num_new_tokens: &[u64],
        num_computed_tokens: &[u64],
        num_lookahead_tokens: u64,
        out: &mut BatchAllocation,
    ) -> Result<()> {
        check_lengths(refs.len(), num_new_tokens.len(), num_computed_tokens.len())?;
        let mut slots = std::mem::take(&mut self.scratch_slots);
        let done = self.table.resolve(refs, &mut slots).and_then(|()| {
            self.allocate_resolved(
                &slots,
                num_new_tokens,
                num_computed_tokens,
                num_lookahead_tokens,
                out,
            )
        });
        self.scratch_slots = slots;
        done
    }

    /// The batch allocation of resolved request slots (counts of the same
    /// length): every entry validated before anything changes, then allocated
    /// in order until the first that does not fit.
    fn allocate_resolved(
        &mut self,
        slots: &[u32],
        num_new_tokens: &[u64],
        num_computed_tokens: &[u64],
        num_lookahead_tokens: u64,
        out: &mut BatchAllocation,
    ) -> Result<()> {
        self.validate_batch(
            slots,
            num_new_tokens,
            num_computed_tokens,
            num_lookahead_tokens,
        )?;
        let n = self.coord.groups().len();
        out.num_allocated = 0;
        out.block_ids.resize(n, Vec::new());
        out.offsets.resize(n, Vec::new());
        for g in 0..n {
            out.block_ids[g].clear();
            out.offsets[g].clear();
            out.offsets[g].push(0);
        }
        for (i, &slot) in slots.iter().enumerate() {
            let (new, computed) = (num_new_tokens[i], num_computed_tokens[i]);
            // Validated above, before anything changed.
            if !self.decode_step_needs_nothing(slot, new, computed, num_lookahead_tokens) {
                let args = AllocateArgs {
                    num_lookahead_tokens,
                    ..AllocateArgs::step(new, computed)
                };
                if !self.allocate_general(slot, &args, None)? {
                    break;
                }
            }
            for (g, new) in self.coord.new_blocks().iter().enumerate() {
                out.block_ids[g].extend_from_slice(new);
                out.offsets[g].push(out.block_ids[g].len() as u32);
            }
            out.num_allocated += 1;
        }
        Ok(())
    }
}

/// Refuses a batch whose per-request counts do not match its requests.
fn check_lengths(requests: usize, new: usize, computed: usize) -> Result<()> {
    if requests != new || requests != computed {
        return Err(invalid("request ids and token counts differ in length"));
    }
    Ok(())
}
