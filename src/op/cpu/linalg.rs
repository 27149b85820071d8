//! Small dense linear algebra on row-major f32 buffers: a checked front end to the `gemm`
//! crate (the GEMM candle's own CPU matmul uses) and the unit-lower-triangular inverse of the
//! WY representation.

/// A read-only matrix view: element `(i, j)` is `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub struct MatRef<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl<'a> MatRef<'a> {
    /// Row-major `rows × cols` view of the first `rows * cols` elements of `data`.
    pub fn new(data: &'a [f32], rows: usize, cols: usize) -> Self {
        assert!(data.len() >= rows * cols, "matrix view out of bounds");
        Self {
            data,
            rows,
            cols,
            rs: cols,
            cs: 1,
        }
    }

    /// `rows × cols` view with rows `rs` elements apart, starting at `data[0]`.
    pub fn strided(data: &'a [f32], rows: usize, cols: usize, rs: usize) -> Self {
        assert!(
            rows == 0 || cols == 0 || data.len() >= (rows - 1) * rs + cols,
            "matrix view out of bounds"
        );
        Self {
            data,
            rows,
            cols,
            rs,
            cs: 1,
        }
    }

    /// The transposed view (no copy).
    pub fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }
}

/// `c = alpha · c + beta · a · b` (`alpha` ignored when `accumulate` is false), with `c` a
/// row-major `a.rows × b.cols` buffer.
pub fn matmul(c: &mut [f32], a: MatRef, b: MatRef, accumulate: bool, alpha: f32, beta: f32) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(k, b.rows, "matmul inner dimensions differ");
    assert!(c.len() >= m * n, "matmul output out of bounds");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if accumulate {
            c[..m * n].iter_mut().for_each(|x| *x *= alpha);
        } else {
            c[..m * n].fill(0.0);
        }
        return;
    }
    // SAFETY: every view was bounds-checked on construction (`MatRef::new` asserts the row-major
    // extent; transposition only swaps strides), `c` holds `m * n` elements, and `c` is a
    // `&mut` borrow so it cannot alias `a` or `b`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            alpha,
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// Writes `(I + A)⁻¹` into `inv` (`c × c`, row-major), where `A` is the strictly lower part of
/// `a` (its diagonal and upper part are ignored). Forward substitution row by row:
/// `inv_i = e_i − Σ_{m<i} A_im · inv_m`.
pub fn unit_lower_inverse(a: &[f32], inv: &mut [f32], c: usize) {
    inv[..c * c].fill(0.0);
    for i in 0..c {
        let (done, rest) = inv.split_at_mut(i * c);
        let row = &mut rest[..c];
        for m in 0..i {
            let coef = a[i * c + m];
            if coef != 0.0 {
                let src = &done[m * c..m * c + m + 1];
                for (r, s) in row[..=m].iter_mut().zip(src) {
                    *r -= coef * s;
                }
            }
        }
        row[i] = 1.0;
    }
}

/// Dot product of two equal-length slices.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matmul_with_transposes() {
        let a = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]; // 2x3
        let b = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]; // 3x2
        let mut c = [0.0; 4];
        matmul(
            &mut c,
            MatRef::new(&a, 2, 3),
            MatRef::new(&b, 3, 2),
            false,
            0.0,
            1.0,
        );
        assert_eq!(c, [4.0, 5.0, 10.0, 11.0]);
        // aᵀ a = 3x3
        let mut d = [0.0; 9];
        let av = MatRef::new(&a, 2, 3);
        matmul(&mut d, av.t(), av, false, 0.0, 1.0);
        assert_eq!(d, [17.0, 22.0, 27.0, 22.0, 29.0, 36.0, 27.0, 36.0, 45.0]);
        matmul(
            &mut c,
            MatRef::new(&a, 2, 3),
            MatRef::new(&b, 3, 2),
            true,
            2.0,
            -1.0,
        );
        assert_eq!(c, [4.0, 5.0, 10.0, 11.0]);
    }

    #[test]
    fn inverse_of_unit_lower() {
        let c = 5;
        let mut a = vec![0.0f32; c * c];
        for i in 0..c {
            for j in 0..i {
                a[i * c + j] = 0.3 * (i as f32) - 0.2 * (j as f32) + 0.1;
            }
            a[i * c + i] = 123.0; // ignored
        }
        let mut inv = vec![0.0; c * c];
        unit_lower_inverse(&a, &mut inv, c);
        for i in 0..c {
            for j in 0..c {
                let mut s = inv[i * c + j];
                for m in 0..i {
                    s += a[i * c + m] * inv[m * c + j];
                }
                let want = if i == j { 1.0 } else { 0.0 };
                assert!((s - want).abs() < 1e-5, "({i},{j}) {s}");
            }
        }
    }
}
