//! Prefix-cache statistics, counted as vLLM counts them.

/// vLLM's `PrefixCacheStats`: `queries` are tokens looked up (the request's whole
/// length at admission), `hits` tokens served from the cache; requests that were
/// preempted before count in the `preempted_*` trio instead.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// `reset_prefix_cache` succeeded since the last snapshot.
    pub reset: bool,
    /// Requests admitted after a lookup (never preempted before).
    pub requests: u64,
    /// Tokens those requests looked up.
    pub queries: u64,
    /// Tokens served from the cache.
    pub hits: u64,
    /// Admitted requests that had been preempted before.
    pub preempted_requests: u64,
    /// Tokens they looked up.
    pub preempted_queries: u64,
    /// Tokens they were served from the cache.
    pub preempted_hits: u64,
}

impl PrefixCacheStats {
    /// Adds one admitted request's lookup.
    pub fn record(&mut self, num_tokens: u64, num_hits: u64, preempted: bool) {
        if preempted {
            self.preempted_requests += 1;
            self.preempted_queries += num_tokens;
            self.preempted_hits += num_hits;
        } else {
            self.requests += 1;
            self.queries += num_tokens;
            self.hits += num_hits;
        }
    }

    /// `hits / queries` over non-preempted requests (0 without queries).
    #[must_use]
    pub fn hit_rate(&self) -> f64 {
        if self.queries == 0 {
            0.0
        } else {
            self.hits as f64 / self.queries as f64
        }
    }
}
