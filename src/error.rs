//! Typed errors. Every public function of the crate validates its inputs and reports what it
//! expected and what it got; these errors convert into [`candle_core::Error`] so that they flow
//! through `?` in ordinary Candle code.

use candle_core::DType;

/// Everything that can go wrong in `candle-gdp` before or around a kernel launch.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GdpError {
    /// A tensor has the wrong number of dimensions.
    #[error("`{name}`: expected a rank-{expected} tensor {layout}, got shape {got:?}")]
    Rank {
        name: String,
        expected: usize,
        layout: &'static str,
        got: Vec<usize>,
    },
    /// A tensor has the right rank but a wrong size.
    #[error("`{name}`: expected shape {expected:?} {layout}, got {got:?}")]
    Shape {
        name: String,
        expected: Vec<usize>,
        layout: &'static str,
        got: Vec<usize>,
    },
    /// A tensor has a zero-sized dimension where at least one element is needed.
    #[error("`{name}`: every dimension must be at least 1, got shape {got:?}")]
    Empty { name: String, got: Vec<usize> },
    /// A tensor's dtype cannot be used where it was passed.
    #[error("`{name}`: expected {expected}, got {got:?}")]
    DType {
        name: String,
        expected: &'static str,
        got: DType,
    },
    /// Two tensors that must share a device do not.
    #[error("`{name}` is on {got} but `{reference}` is on {expected}")]
    Device {
        name: String,
        reference: String,
        expected: String,
        got: String,
    },
    /// The value-side heads are not a whole number of groups of the key heads.
    #[error("heads: {0}")]
    Heads(String),
    /// `cu_seqlens` is not a valid list of packed-sequence offsets.
    #[error("`cu_seqlens`: {0}")]
    CuSeqlens(String),
    /// An option has a value outside its domain.
    #[error("`{name}`: {reason}")]
    Option { name: String, reason: String },
    /// A feature combination this build does not support.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A context-parallel communicator failed (a peer errored, panicked, timed out or disagreed).
    #[error("communicator: {0}")]
    Comm(String),
    /// An environment variable of a multi-process launch (`RANK`, `WORLD_SIZE`, ...) is missing
    /// or malformed.
    #[error("environment variable `{var}`: {reason}")]
    Env { var: String, reason: String },
}

impl From<GdpError> for candle_core::Error {
    fn from(e: GdpError) -> Self {
        candle_core::Error::wrap(e)
    }
}

/// Result alias used inside the crate.
pub type Result<T> = std::result::Result<T, candle_core::Error>;
