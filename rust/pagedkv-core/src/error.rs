//! Misuse errors. Expected outcomes (no room, no hit) are values, not errors.

use std::fmt;

/// Why a call was refused. A refused call leaves the manager unchanged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Error {
    /// The request id is not known (never added, or removed).
    UnknownRequest(String),
    /// `add_request` with an id that is already known.
    DuplicateRequest(String),
    /// A count, id or option is out of range or inconsistent.
    InvalidArgument(String),
    /// A `get_computed_blocks` result no longer matches the cache (its blocks were
    /// evicted or reused), or belongs to another request or manager.
    StaleComputedBlocks(String),
    /// The request needs more blocks than the whole pool has: it can never fit.
    CannotFit(String),
    /// A configuration that cannot be built.
    InvalidConfig(String),
    /// The invariant checker found a violation.
    InvariantViolation(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UnknownRequest(id) => write!(f, "unknown request id {id:?}"),
            Self::DuplicateRequest(id) => write!(f, "request id {id:?} is already known"),
            Self::InvalidArgument(m)
            | Self::StaleComputedBlocks(m)
            | Self::CannotFit(m)
            | Self::InvalidConfig(m)
            | Self::InvariantViolation(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for Error {}

/// Result alias of the core.
pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidArgument(msg.into())
}
