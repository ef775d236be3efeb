//! The pool's KV event queue (capped, oldest dropped first) and its metrics
//! read-outs (block counters, the activity log).

use super::{BlockActivity, BlockPool, BlockPoolStats, drop_oldest};
use crate::events::KvEvent;

impl BlockPool {
    // ---- events -----------------------------------------------------------

    /// Whether events are recorded.
    #[must_use]
    pub fn events_enabled(&self) -> bool {
        self.events_enabled
    }

    /// Records an event (no-op when events are off).
    pub fn push_event(&mut self, ev: KvEvent) {
        if self.events_enabled {
            self.record_event(ev);
        }
    }

    /// Queues an event, dropping the oldest quarter when the queue is full.
    pub(super) fn record_event(&mut self, ev: KvEvent) {
        self.dropped_events += drop_oldest(&mut self.events, self.max_pending_events);
        self.events.push(ev);
    }

    /// Caps the undrained events and block activity entries (each at least 1).
    #[must_use]
    pub fn with_pending_caps(mut self, events: u64, activity: u64) -> Self {
        self.max_pending_events = usize::try_from(events).unwrap_or(usize::MAX).max(1);
        if let Some(m) = self.metrics.as_deref_mut() {
            m.cap = usize::try_from(activity).unwrap_or(usize::MAX).max(1);
        }
        self
    }

    /// Events dropped (oldest first) because they were not drained in time.
    #[must_use]
    pub fn num_dropped_events(&self) -> u64 {
        self.dropped_events
    }

    /// Block activity entries dropped (oldest first) because they were not
    /// drained in time.
    #[must_use]
    pub fn num_dropped_block_activity(&self) -> u64 {
        self.metrics.as_ref().map_or(0, |m| m.dropped)
    }

    /// Events recorded and not yet drained.
    #[must_use]
    pub fn num_pending_events(&self) -> usize {
        self.events.len()
    }

    /// Drains the recorded events.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    // ---- metrics ----------------------------------------------------------

    /// The block counters; `None` unless built [`BlockPool::with_metrics`].
    #[must_use]
    pub fn stats(&self) -> Option<BlockPoolStats> {
        self.metrics.as_ref().map(|m| m.stats)
    }

    /// Drains the block activity log, oldest first (empty without metrics). It
    /// keeps at most its cap undrained, like the event queue.
    pub fn take_block_activity(&mut self) -> Vec<BlockActivity> {
        self.metrics
            .as_deref_mut()
            .map(|m| std::mem::take(&mut m.activity))
            .unwrap_or_default()
    }
}
