//! Reading the tier: pins for loads (a request's, or a lower tier's copy),
//! their release, and recency by touch.

use rustc_hash::FxHashMap;

use super::{OffloadKey, OffloadTier, ReqKey, check_positions};
use crate::error::{Result, invalid};

impl OffloadTier {
    /// Marks `keys` recently used (the last key of the list is the least recent).
    pub fn touch(&mut self, keys: &[OffloadKey]) {
        self.policy.touch(keys);
    }

    /// Pins readable chunks for loading; returns their slots.
    ///
    /// # Errors
    /// `InvalidArgument` (nothing changed) when a key is absent or its store
    /// has not completed, positions do not match the keys, or the request
    /// already ended and a key is new to it.
    ///
    pub fn prepare_load(
        &mut self,
        keys: &[OffloadKey],
        req: ReqKey,
        positions: &[i64],
    ) -> Result<Vec<u64>> {
        check_positions(keys, positions)?;
        self.check_readable(keys)?;
        self.check_open(req, keys)?;
        let out = self.pin(keys);
        self.record_load(req, keys, positions);
        Ok(out)
    }

    /// Pins readable chunks for a copy that is not a request's access (a lower
    /// tier reading this one, vLLM's `prepare_read`): no recency, no access
    /// record. Released by [`Self::complete_load`].
    ///
    /// # Errors
    /// `InvalidArgument` (nothing changed) when a key is absent or its store
    /// has not completed.
    pub fn prepare_read(&mut self, keys: &[OffloadKey]) -> Result<Vec<u64>> {
        self.check_readable(keys)?;
        Ok(self.pin(keys))
    }

    fn check_readable(&self, keys: &[OffloadKey]) -> Result<()> {
        for key in keys {
            match self.policy.get(key) {
                None => return Err(invalid(format!("{key:?} is not in the tier"))),
                Some(c) if !c.is_ready() => {
                    return Err(invalid(format!("{key:?} is not ready for reading")));
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    /// Takes a reader on each chunk (checked readable); their slots.
    fn pin(&mut self, keys: &[OffloadKey]) -> Vec<u64> {
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            let chunk = self.policy.get_mut(key).expect("checked readable");
            chunk.ref_cnt += 1;
            out.push(chunk.slot);
            if chunk.ref_cnt == 1 {
                self.num_evictable -= 1;
                self.policy.mark_non_evictable(key);
            }
        }
        self.counters.chunks_loaded += keys.len() as u64;
        out
    }

    /// Unpins chunks whose load finished.
    ///
    /// # Errors
    /// `InvalidArgument` (nothing changed) for a key that is absent or has
    /// fewer loads in flight than it appears in `keys`.
    ///
    /// # Panics
    /// Never: every key is checked before any changes.
    pub fn complete_load(&mut self, keys: &[OffloadKey]) -> Result<()> {
        let mut pins: FxHashMap<OffloadKey, i32> = FxHashMap::default();
        for key in keys {
            let n = pins.entry(*key).or_insert(0);
            *n += 1;
            match self.policy.get(key) {
                None => {
                    return Err(invalid(format!(
                        "complete_load: {key:?} is not in the tier"
                    )));
                }
                Some(c) if c.ref_cnt < *n => {
                    return Err(invalid(format!(
                        "complete_load: {key:?} has no load in flight"
                    )));
                }
                Some(_) => {}
            }
        }
        for key in keys {
            let chunk = self.policy.get_mut(key).expect("checked above");
            chunk.ref_cnt -= 1;
            if chunk.ref_cnt == 0 {
                self.num_evictable += 1;
                self.policy.mark_evictable(key);
            }
        }
        Ok(())
    }
}
