//! What an allocation's result is, told apart for a caller that shows each
//! case its own way (no room, no new block, new blocks).

use crate::error::Result;
use crate::manager::{AllocateArgs, ComputedBlocks, KvCacheManager};
use crate::pool::BlockId;

/// The result of [`KvCacheManager::allocate_slots`], by case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Allocated<'a> {
    /// The blocks do not fit: nothing changed.
    NoRoom,
    /// The step fit and took no new block in any group (most decode steps).
    NoNewBlocks,
    /// The new block ids per group (some group took at least one).
    NewBlocks(&'a [Vec<BlockId>]),
}

impl<'a> Allocated<'a> {
    /// The case of an `allocate_slots` result.
    #[must_use]
    pub fn of(result: Option<&'a [Vec<BlockId>]>) -> Self {
        match result {
            None => Self::NoRoom,
            Some(g) if g.iter().all(Vec::is_empty) => Self::NoNewBlocks,
            Some(g) => Self::NewBlocks(g),
        }
    }
}

impl KvCacheManager {
    /// [`Self::allocate_slots`], its result by case.
    ///
    /// # Errors
    /// As [`Self::allocate_slots`].
    pub fn allocate_slots_outcome(
        &mut self,
        id: &str,
        args: &AllocateArgs,
        hit: Option<&ComputedBlocks>,
    ) -> Result<Allocated<'_>> {
        Ok(Allocated::of(self.allocate_slots(id, args, hit)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cases() {
        assert_eq!(Allocated::of(None), Allocated::NoRoom);
        let none = vec![Vec::new(), Vec::new()];
        assert_eq!(Allocated::of(Some(&none)), Allocated::NoNewBlocks);
        let some = vec![Vec::new(), vec![3]];
        assert_eq!(Allocated::of(Some(&some)), Allocated::NewBlocks(&some));
    }
}
