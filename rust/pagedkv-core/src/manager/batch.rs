//! Batch calls: one crossing serves every running request of a decode step,
//! with the same result as the single calls made in order.

use super::validate::LEAN_STEP;
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
    /// As [`Self::allocate_slots_batch_refs`]: the first entry in order that is
    /// unknown, named twice or invalid.
    pub fn allocate_slots_batch_tracked(
        &mut self,
        refs: RequestRefs<'_>,
        num_new_tokens: &[u64],
        num_lookahead_tokens: u64,
        out: &mut BatchAllocation,
    ) -> Result<()> {
        self.allocate_slots_batch_step(
            &BatchStep {
                num_lookahead_tokens,
                ..BatchStep::new(refs, num_new_tokens, None)
            },
            out,
        )
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
        self.allocate_slots_batch_step(
            &BatchStep {
                num_lookahead_tokens,
                ..BatchStep::new(refs, num_new_tokens, Some(num_computed_tokens))
            },
            out,
        )
    }

    /// The batch call in full ([`BatchStep`]): the tokens sampled since the
    /// requests' last step appended, then each request allocated in order until
    /// the first that does not fit. The same result as
    /// [`Self::append_token_ids_batch_refs`] followed by
    /// [`Self::allocate_slots_batch_refs`], in one pass over the requests'
    /// state instead of two.
    ///
    /// # Errors
    /// Lengths that differ, an unknown request, a token past `max_model_len`
    /// or any invalid count: checked for every entry before anything changes.
    pub fn allocate_slots_batch_step(
        &mut self,
        step: &BatchStep<'_>,
        out: &mut BatchAllocation,
    ) -> Result<()> {
        let n = step.refs.len();
        check_lengths(
            n,
            step.num_new_tokens.len(),
            step.num_computed_tokens.map_or(n, <[u64]>::len),
        )?;
        if step.append_token_ids.is_some_and(|t| t.len() != n) {
            return Err(invalid(
                "request ids and appended token ids differ in length",
            ));
        }
        self.check_no_pending_split()?;
        let mut slots = std::mem::take(&mut self.scratch_slots);
        let mut counts = std::mem::take(&mut self.scratch_counts);
        let mut fast = std::mem::take(&mut self.scratch_fast);
        let done = self
            .check_batch(step, &mut slots, &mut counts, &mut fast)
            .and_then(|()| {
                let computed = step.num_computed_tokens.unwrap_or(&counts);
                self.allocate_checked(&slots, computed, &fast, step, out)
            });
        self.scratch_slots = slots;
        self.scratch_counts = counts;
        self.scratch_fast = fast;
        done
    }

    /// Checks every entry of a batch before anything changes, in one pass:
    /// resolves its request (into `slots`), refuses a request named twice (its
    /// second step would be checked against the state the first leaves),
    /// takes its computed tokens (into `counts` when the manager tracks them)
    /// and checks its step ([`Self::check_batch_entry`], into `fast`).
    fn check_batch(
        &mut self,
        step: &BatchStep<'_>,
        slots: &mut Vec<u32>,
        counts: &mut Vec<u64>,
        fast: &mut Vec<u64>,
    ) -> Result<()> {
        let n = step.refs.len();
        slots.clear();
        slots.reserve(n);
        counts.clear();
        if step.num_computed_tokens.is_none() {
            counts.reserve(n);
        }
        fast.clear();
        fast.reserve(n);
        self.batch_stamp = self.batch_stamp.wrapping_add(1);
        if self.batch_stamp == 0 {
            self.batch_marks.fill(0);
            self.batch_stamp = 1;
        }
        let stamp = self.batch_stamp;
        let free_at_start = i64::from(self.coord.pool().num_free_blocks());
        let mut bound = None;
        for i in 0..n {
            let slot = match step.refs {
                RequestRefs::Ids(ids) => self.table.slot(ids[i])?,
                RequestRefs::Handles(hs) => self.table.slot_of_handle(hs[i])?,
            };
            let k = slot as usize;
            if k >= self.batch_marks.len() {
                self.batch_marks.resize(k + 1, 0);
            }
            if self.batch_marks[k] == stamp {
                return Err(invalid(format!(
                    "request {:?} is named twice in the batch",
                    self.table.get(slot).id
                )));
            }
            self.batch_marks[k] = stamp;
            slots.push(slot);
            let computed = if let Some(c) = step.num_computed_tokens {
                c[i]
            } else {
                let c = self.table.get(slot).scheduled_through;
                counts.push(c);
                c
            };
            let appending = step
                .append_token_ids
                .map_or(0, |t| u64::from(t[i].is_some()));
            fast.push(self.check_batch_entry(
                slot,
                [step.num_new_tokens[i], computed, step.num_lookahead_tokens],
                appending,
                free_at_start,
                &mut bound,
            )?);
        }
        Ok(())
    }

    /// The batch call once every entry was checked (`fast` from
    /// [`Self::check_batch`]), in one pass: each request's sampled token
    /// appended, then its step made, in order until the first step that does
    /// not fit; the tokens of the requests after it are still appended. (A
    /// request's step reads only its own tokens, so this is the result of
    /// every append first, then every step.)
    fn allocate_checked(
        &mut self,
        slots: &[u32],
        num_computed_tokens: &[u64],
        fast: &[u64],
        step: &BatchStep<'_>,
        out: &mut BatchAllocation,
    ) -> Result<()> {
        let (num_new_tokens, num_lookahead_tokens) =
            (step.num_new_tokens, step.num_lookahead_tokens);
        let n = self.coord.groups().len();
        out.num_allocated = 0;
        out.block_ids.resize(n, Vec::new());
        out.offsets.resize(n, Vec::new());
        for g in 0..n {
            out.block_ids[g].clear();
            out.offsets[g].clear();
            out.offsets[g].push(0);
        }
        let hbs = self.hash_block_size;
        let hashing = self.hashing();
        let mut stopped = false;
        for (i, ((&slot, &f), &computed)) in
            slots.iter().zip(fast).zip(num_computed_tokens).enumerate()
        {
            if let Some(Some(t)) = step.append_token_ids.map(|t| t[i]) {
                let hasher = hashing.then_some(&mut self.hasher);
                self.table.get_mut(slot).push_token(t, hasher, hbs);
            }
            if stopped {
                continue;
            }
            if f < LEAN_STEP {
                // A running request's step that needs nothing (decided above);
                // its offsets are written with the next step that allocates.
                let req = self.table.get_mut(slot);
                req.num_computed_at_step = computed;
                req.scheduled_through = f;
                out.num_allocated += 1;
                continue;
            }
            let new = num_new_tokens[i];
            // Validated above, before anything changed.
            let counts = [new, computed, num_lookahead_tokens];
            let done = if f == LEAN_STEP {
                self.allocate_lean(slot, counts)
            } else {
                self.decode_step_needs_nothing(slot, counts)
            };
            if !done {
                let args = AllocateArgs {
                    num_lookahead_tokens,
                    ..AllocateArgs::step(new, computed)
                };
                if !self.allocate_general(slot, &args, None)? {
                    stopped = true;
                    continue;
                }
            }
            for (g, new) in self.coord.new_blocks().iter().enumerate() {
                let (ids, offsets) = (&mut out.block_ids[g], &mut out.offsets[g]);
                // The steps since the last that allocated took nothing here.
                offsets.resize(i + 1, ids.len() as u32);
                ids.extend_from_slice(new);
                offsets.push(ids.len() as u32);
            }
            out.num_allocated += 1;
        }
        for (ids, offsets) in out.block_ids.iter().zip(&mut out.offsets) {
            offsets.resize(out.num_allocated + 1, ids.len() as u32);
        }
        Ok(())
    }
}

/// One batch call of a step ([`KvCacheManager::allocate_slots_batch_step`]).
#[derive(Clone, Copy, Debug)]
pub struct BatchStep<'a> {
    /// The requests, in the order they are allocated.
    pub refs: RequestRefs<'a>,
    /// Tokens each request computes this step.
    pub num_new_tokens: &'a [u64],
    /// Tokens each has computed; `None`: what its last allocated step
    /// scheduled through, as the manager tracks it.
    pub num_computed_tokens: Option<&'a [u64]>,
    /// Speculative tokens to reserve slots for, for every request.
    pub num_lookahead_tokens: u64,
    /// The token each request sampled since its last step (`None` for one
    /// that sampled none, e.g. a prefill chunk), appended before anything is
    /// allocated: the step's `append_token_ids_batch` in the same crossing.
    pub append_token_ids: Option<&'a [Option<u32>]>,
}

impl<'a> BatchStep<'a> {
    /// A step of these requests and counts: no lookahead, nothing appended.
    #[must_use]
    pub fn new(
        refs: RequestRefs<'a>,
        num_new_tokens: &'a [u64],
        num_computed_tokens: Option<&'a [u64]>,
    ) -> Self {
        Self {
            refs,
            num_new_tokens,
            num_computed_tokens,
            num_lookahead_tokens: 0,
            append_token_ids: None,
        }
    }
}

/// Refuses a batch whose per-request counts do not match its requests.
fn check_lengths(requests: usize, new: usize, computed: usize) -> Result<()> {
    if requests != new || requests != computed {
        return Err(invalid("request ids and token counts differ in length"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ManagerConfig, RequestSpec};

    fn manager(cfg: ManagerConfig) -> KvCacheManager {
        KvCacheManager::new(cfg).unwrap_or_else(|e| panic!("{e}"))
    }

    fn limits(m: &KvCacheManager, id: &str) -> (u64, u64) {
        let slot = m.table.slot(id).unwrap_or_else(|e| panic!("{e}"));
        m.table.get(slot).step_limits()
    }

    /// A decode step reads a request's limits instead of its groups: set by
    /// every allocation to what the groups allow (the slots its blocks hold,
    /// the tokens below its next block to publish), forgotten when the
    /// blocks change elsewhere, and never set for a layout whose steps are
    /// not plain (a sliding window beside full attention).
    #[test]
    fn step_limits_follow_the_blocks() {
        let mut m = manager(ManagerConfig::full_attention(64, 16, 1024));
        let spec = RequestSpec {
            prompt_token_ids: (0..40).collect(),
            ..RequestSpec::default()
        };
        let h = m.add_request("r", spec).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(limits(&m, "r"), (0, 0), "no blocks yet");
        let admitted = m.allocate_slots("r", &AllocateArgs::step(40, 0), None);
        assert!(admitted.unwrap_or_else(|e| panic!("{e}")).is_some());
        // Three blocks hold 48 slots; two are cached, the third fills at 48.
        assert_eq!(limits(&m, "r"), (48, 48));
        let mut out = BatchAllocation::default();
        let mut seen = Vec::new();
        for (computed, t) in (40u64..).zip(0..10u32) {
            let (sampled, handles, done) = ([Some(1000 + t)], [h], [computed]);
            let step = BatchStep {
                append_token_ids: Some(&sampled),
                ..BatchStep::new(RequestRefs::Handles(&handles), &[1], Some(&done))
            };
            m.allocate_slots_batch_step(&step, &mut out)
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(out.num_allocated, 1);
            seen.push(limits(&m, "r"));
        }
        // Steps that need nothing keep the limits; the step computing the
        // 48th token fills and caches the third block, which moves the cached
        // limit, and the next one takes a fourth block.
        let mut want = vec![(48, 48); 7];
        want.extend([(48, 64), (64, 64), (64, 64)]);
        assert_eq!(seen, want);
        m.free("r").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(limits(&m, "r"), (0, 0), "blocks gone");

        let mut cfg = ManagerConfig::full_attention(64, 16, 1024);
        let window = crate::GroupSpec::new(crate::AttentionKind::SlidingWindow { window: 32 }, 16);
        cfg.groups.push(window);
        let mut m = manager(cfg);
        let spec = RequestSpec {
            prompt_token_ids: (0..40).collect(),
            ..RequestSpec::default()
        };
        m.add_request("r", spec).unwrap_or_else(|e| panic!("{e}"));
        let admitted = m.allocate_slots("r", &AllocateArgs::step(40, 0), None);
        assert!(admitted.unwrap_or_else(|e| panic!("{e}")).is_some());
        assert_eq!(
            limits(&m, "r"),
            (0, 0),
            "hybrid steps take the general path"
        );
    }
}
