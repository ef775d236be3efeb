//! The pool's structural invariants, checked on demand: the free queue's links
//! and count (both lists and their tags under SLRU / ARC, the protected share,
//! ARC's target and ghost bounds), reference counts against their holders, the prefix map against
//! the keys blocks carry.

use super::{BlockPool, NIL, NULL_BLOCK};
use crate::error::{Error, Result};

impl BlockPool {
    // ---- invariants -------------------------------------------------------

    /// Checks the pool's structural invariants; `expected_refs` (if given) are the
    /// reference counts implied by the holders of blocks.
    ///
    /// # Errors
    /// A description of the first violated invariant.
    pub fn check_invariants(&self, expected_refs: Option<&[u32]>) -> Result<()> {
        self.first_violation(expected_refs)
            .map_err(Error::InvariantViolation)
    }

    fn first_violation(&self, expected_refs: Option<&[u32]>) -> std::result::Result<(), String> {
        let n = self.blocks.len();
        let mut seen = vec![false; n];
        let mut cur = self.head;
        let mut prev = NIL;
        let mut count = 0u32;
        while cur != NIL {
            let i = cur as usize;
            if i >= n {
                return Err(format!("free queue links to out-of-range block {cur}"));
            }
            if cur == NULL_BLOCK {
                return Err("null block is in the free queue".into());
            }
            if seen[i] {
                return Err(format!("block {cur} is in the free queue twice"));
            }
            seen[i] = true;
            if self.blocks[i].prev != prev {
                return Err(format!("block {cur} has a broken prev link"));
            }
            if self.blocks[i].ref_cnt != 0 {
                return Err(format!(
                    "block {cur} is free with ref_cnt {}",
                    self.blocks[i].ref_cnt
                ));
            }
            count += 1;
            prev = cur;
            cur = self.blocks[i].next;
        }
        if prev != self.tail {
            return Err("free queue tail is wrong".into());
        }
        count += self.check_segments(&mut seen)?;
        if count != self.num_free {
            return Err(format!(
                "free count {} but queue holds {count}",
                self.num_free
            ));
        }
        for (i, b) in self.blocks.iter().enumerate().skip(1) {
            if b.ref_cnt == 0 && !seen[i] {
                return Err(format!("block {i} has ref_cnt 0 but is not free"));
            }
            if let Some(exp) = expected_refs
                && exp[i] != b.ref_cnt
            {
                return Err(format!(
                    "block {i} has ref_cnt {} but {} holders",
                    b.ref_cnt, exp[i]
                ));
            }
        }
        if self.blocks[0].key != NIL {
            return Err("null block is cached".into());
        }
        self.map.check()?;
        let mut listed = 0usize;
        for (key, ids) in self.map.iter() {
            for id in ids {
                listed += 1;
                let extra = self.secondary.get(&id).is_some_and(|v| v.contains(&key));
                if self.block_key(id) != Some(key) && !extra {
                    return Err(format!(
                        "map lists block {id} under a key it does not carry"
                    ));
                }
            }
        }
        let carrying = self.blocks.iter().filter(|b| b.key != NIL).count()
            + self.secondary.values().map(Vec::len).sum::<usize>();
        if carrying != listed {
            return Err(format!(
                "{carrying} blocks carry keys but the map lists {listed}"
            ));
        }
        Ok(())
    }
}
