//! The tier's slots: chunk ids handed out fresh first (0, 1, 2, ...), then freed
//! ones last-in first-out, and one chunk's state (vLLM 0.33 `ChunkStatus`).

/// One resident chunk: its slot and how many transfers read it; `-1` while its
/// write is in flight (not yet readable).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Transfers reading the chunk; `-1`: its store has not completed.
    pub ref_cnt: i32,
    /// The slot in the tier's buffer.
    pub slot: u64,
}

impl Chunk {
    /// A chunk whose store was just prepared.
    #[must_use]
    pub fn pending(slot: u64) -> Self {
        Self { ref_cnt: -1, slot }
    }

    /// Whether the chunk can be read (its store completed).
    #[must_use]
    pub fn is_ready(&self) -> bool {
        self.ref_cnt >= 0
    }
}

/// Slot allocation: `num_chunks` slots, fresh ones first, then the free list popped
/// from its end.
#[derive(Clone, Debug)]
pub struct Slots {
    num_chunks: u64,
    num_allocated: u64,
    free: Vec<u64>,
}

impl Slots {
    /// `num_chunks` slots, none handed out.
    pub fn new(num_chunks: u64) -> Self {
        Self {
            num_chunks,
            num_allocated: 0,
            free: Vec::new(),
        }
    }

    /// Slots in the tier.
    pub fn capacity(&self) -> u64 {
        self.num_chunks
    }

    /// Slots ever handed out since the last reset (fresh ones used).
    pub fn num_allocated(&self) -> u64 {
        self.num_allocated
    }

    /// Freed slots waiting for reuse.
    pub fn num_freed(&self) -> usize {
        self.free.len()
    }

    /// Slots that can be handed out now.
    pub fn num_free(&self) -> u64 {
        self.free.len() as u64 + self.num_chunks - self.num_allocated
    }

    /// Hands out `n` slots (the caller checked `n <= num_free()`).
    pub fn allocate(&mut self, n: usize) -> Vec<u64> {
        debug_assert!(n as u64 <= self.num_free());
        let fresh = (n as u64).min(self.num_chunks - self.num_allocated);
        let mut out: Vec<u64> = (self.num_allocated..self.num_allocated + fresh).collect();
        self.num_allocated += fresh;
        for _ in fresh as usize..n {
            out.push(self.free.pop().expect("caller checked the free count"));
        }
        out
    }

    /// Returns a slot.
    pub fn free(&mut self, slot: u64) {
        self.free.push(slot);
    }

    /// Every slot free again, fresh order restarted.
    pub fn reset(&mut self) {
        self.free.clear();
        self.num_allocated = 0;
    }

    /// The free list, oldest first (for checks).
    pub fn freed(&self) -> &[u64] {
        &self.free
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_first_then_lifo() {
        let mut s = Slots::new(4);
        assert_eq!(s.allocate(3), vec![0, 1, 2]);
        s.free(1);
        s.free(0);
        assert_eq!(s.num_free(), 3);
        assert_eq!(s.allocate(3), vec![3, 0, 1]);
        assert_eq!(s.num_free(), 0);
        s.reset();
        assert_eq!(s.allocate(1), vec![0]);
    }
}
