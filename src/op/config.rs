//! Typed tuning of the CUDA kernels: which implementation runs each direction, whether the
//! WY kernel overlaps the state scan, and the value tiles. Everything is automatic by default;
//! a field set here forces one choice (an error where it does not fit the shape or the device).
//! The CPU kernels ignore it.

/// Which CUDA implementation runs one direction of the op.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum KernelPath {
    /// The chunked (WY) kernels where they fit the shape, dtype and device, else the fused ones.
    #[default]
    Auto,
    /// The one-kernel fused path (any dtype, any shape that fits its shared memory).
    Fused,
    /// The chunked bf16 kernels; an error where they do not fit.
    Chunked,
}

/// Value columns per thread block, forced per kernel family; `None` lets the planner pick from
/// the shape and the device's multiprocessor count.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct TileConfig {
    /// The fused forward kernel: 8, 16, 32 or 64.
    pub fused_forward: Option<usize>,
    /// The fused backward kernel: 8, 16, 32 or 64.
    pub fused_backward: Option<usize>,
    /// The chunked forward scan: 16, 32 or 64.
    pub forward_scan: Option<usize>,
    /// The backward's rerun of the forward states: 16, 32, 64, or 128 at `K <= 128`.
    pub states_scan: Option<usize>,
    /// The backward's state-gradient scan: 16, 32, 64, or 128 at `K <= 128`.
    pub dh_scan: Option<usize>,
}

/// How the chunked bf16 op splits long sequences into segments that its scans run side by
/// side. Forward: each segment from `[0 | I_K]` on value columns widened by `K` (its output
/// `[o⁰ | Q̃]` and its transition `[ΔS | M]`), then the segments' incoming states by a short
/// fold `S_{j+1} = ΔS_j + M_j S_j` and the output `o = o⁰ + Q̃ S_j`, as a context-parallel
/// rank does. Backward (where the forward kept the WY factors,
/// [`crate::SaveIntermediates::WyFactors`]): the states rerun from each segment's incoming
/// state, the state-gradient scan widened the same way from each segment's end, a reverse fold
/// of the end-state gradients and a correction of the chunk rows. This shortens the scans'
/// chains of dependent chunk steps where their blocks would leave most multiprocessors idle
/// (few heads, long sequences), at twice the scans' columns.
///
/// The default, `Auto`, splits where one wave of the widened scan's blocks holds four segments
/// or more per sequence (B·H ≤ 8 at K = V = 128 on 132 multiprocessors), three of at least
/// 8192 tokens (B·H 9–11), or two of at least 8192 tokens where the unsplit scan would run
/// its narrowest tiles (B·H 12–14): there the split measured 1.2–3.6x faster than the unsplit
/// op (`docs/cuda.md`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Segments {
    /// Split where one wave of the widened scan's blocks can hold at least four segments per
    /// sequence of at least 2048 tokens each (up to 16), or two or three of at least 8192
    /// tokens where those pay.
    #[default]
    Auto,
    /// Never split.
    Off,
    /// Split each sequence into this many segments of equal length, rounded up to 64 tokens
    /// (fewer where a sequence is shorter); 1 never splits, 0 is an error.
    Count(usize),
}

/// Kernel choices of the CUDA op ([`crate::GdpOptions::kernels`]); `Default` is automatic
/// everywhere and is what the benchmarks measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KernelConfig {
    /// The forward's implementation.
    pub forward: KernelPath,
    /// The backward's implementation.
    pub backward: KernelPath,
    /// Context parallelism's summaries: `Auto` / `Chunked` run a rank in one widened pass on
    /// the chunked bf16 kernels where they fit; `Fused` takes the fused summary kernels.
    pub summaries: KernelPath,
    /// Run the WY kernel beside the state scan that waits for its chunks, where the scan leaves
    /// most multiprocessors idle (bit-identical results either way).
    pub overlap: bool,
    /// Run the kernels that can run side by side on a second stream of the device; `false`
    /// queues everything on the device's stream (bit-identical results either way).
    pub side_streams: bool,
    /// Whether the chunked bf16 forward splits long sequences into segments scanned side by
    /// side (results equal the unsplit forward's within the op's tolerances).
    pub segments: Segments,
    /// Forced value tiles.
    pub tiles: TileConfig,
    /// Caps the shared memory one block may use, in bytes, below the device's opt-in limit:
    /// the planners then take narrower tiles or the fused kernels, as on a GPU with less shared
    /// memory (the tests force every fallback this way). `None`: the device's limit.
    pub shared_memory_limit: Option<usize>,
}

impl Default for KernelConfig {
    fn default() -> Self {
        Self {
            forward: KernelPath::Auto,
            backward: KernelPath::Auto,
            summaries: KernelPath::Auto,
            overlap: true,
            side_streams: true,
            segments: Segments::Auto,
            tiles: TileConfig::default(),
            shared_memory_limit: None,
        }
    }
}
