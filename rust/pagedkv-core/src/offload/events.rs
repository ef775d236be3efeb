//! The tier's events (vLLM 0.33 `OffloadingEvent`): keys stored in or removed
//! from a medium, in the order they happened.

use super::keys::OffloadKey;

/// Where a tier keeps its chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Medium {
    /// Host memory (vLLM's `Medium.CPU`).
    Cpu,
    /// Files on a local disk (published as vLLM's `"DISK"` medium name).
    Disk,
}

impl Medium {
    /// The medium's name on the wire.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Cpu => "CPU",
            Self::Disk => "DISK",
        }
    }
}

/// Keys stored (readable from now on) or removed from one medium.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OffloadEvent {
    /// The keys, in the order the call handled them.
    pub keys: Vec<OffloadKey>,
    /// The medium.
    pub medium: Medium,
    /// `true`: removed; `false`: stored.
    pub removed: bool,
    /// A failed store released the keys' slots: not an eviction anyone saw.
    pub metadata_only: bool,
}
