//! Subnormal floats flushed to zero while a CPU kernel runs ([`FlushSubnormals`]).
//!
//! A chunk transition `M` of context parallelism (and the `Q̃` and `Mᵀ` built from it) decays with
//! the gates and has no inputs to keep it up, so its entries pass through the subnormal range on
//! their way to zero. On Intel cores every such operand takes a microcode assist: a CP rank's
//! forward took 4x the plain op's on a 16-core Xeon (H4, K = V = 64, 4096 tokens; `docs/cp.md`),
//! 1.5x on an AMD EPYC core, where they cost little. Values below `f32::MIN_POSITIVE` (1.2e-38) are
//! far under the f32 rounding of the `O(1)` values they are added to, so flushing them changes no
//! result beyond rounding.

/// Sets the x86-64 MXCSR flush-to-zero and denormals-are-zero bits for this thread while it
/// lives, and restores the previous bits when dropped (the rayon worker threads are shared with
/// the caller's own work). A no-op on other architectures.
pub struct FlushSubnormals {
    #[cfg(target_arch = "x86_64")]
    saved: u32,
}

#[cfg(target_arch = "x86_64")]
const FTZ_DAZ: u32 = (1 << 15) | (1 << 6);

impl FlushSubnormals {
    /// Flushes subnormals on this thread until the guard is dropped.
    #[allow(clippy::new_without_default)]
    pub fn new() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            let saved = read_mxcsr();
            write_mxcsr(saved | FTZ_DAZ);
            Self { saved }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Self {}
    }
}

impl Drop for FlushSubnormals {
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        write_mxcsr(self.saved);
    }
}

#[cfg(target_arch = "x86_64")]
fn read_mxcsr() -> u32 {
    let mut v: u32 = 0;
    // SAFETY: `stmxcsr` stores the 32-bit MXCSR register to the given, valid, writable
    // location; it has no other effect.
    unsafe { std::arch::asm!("stmxcsr [{}]", in(reg) &mut v, options(nostack)) };
    v
}

#[cfg(target_arch = "x86_64")]
fn write_mxcsr(v: u32) {
    // SAFETY: `ldmxcsr` loads MXCSR from a valid location; `v` is a value read by `stmxcsr`
    // with at most the FTZ and DAZ bits added, both defined bits, so no reserved bit is set.
    unsafe { std::arch::asm!("ldmxcsr [{}]", in(reg) &v, options(nostack, readonly)) };
}

#[cfg(test)]
mod tests {
    use super::FlushSubnormals;

    #[test]
    fn flushes_inside_and_restores_after() {
        let tiny = std::hint::black_box(f32::MIN_POSITIVE);
        let half = std::hint::black_box(0.5f32);
        assert!(
            tiny * half > 0.0,
            "subnormal result expected outside the guard"
        );
        {
            let _g = FlushSubnormals::new();
            let r = std::hint::black_box(tiny) * std::hint::black_box(half);
            if cfg!(target_arch = "x86_64") {
                assert_eq!(r, 0.0);
            }
        }
        assert!(tiny * half > 0.0, "the previous mode is restored");
    }
}
