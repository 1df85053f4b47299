//! Helpers shared by the unit tests.

/// Tolerance of the spec's numeric vectors (they are rounded to 6 decimals).
pub const TOL: f64 = 1e-6;

/// Asserts `|a - b| <= tol`, naming `what` on failure.
#[track_caller]
pub fn assert_close(a: f64, b: f64, tol: f64, what: &str) {
    assert!(
        (a - b).abs() <= tol,
        "{what}: got {a}, expected {b} (|diff| = {} > {tol})",
        (a - b).abs()
    );
}

/// Element-wise [`assert_close`] over two slices of equal length.
#[track_caller]
pub fn assert_all_close(a: &[f64], b: &[f64], tol: f64, what: &str) {
    assert_eq!(
        a.len(),
        b.len(),
        "{what}: length {} vs expected {}",
        a.len(),
        b.len()
    );
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_close(*x, *y, tol, &format!("{what}[{i}]"));
    }
}
