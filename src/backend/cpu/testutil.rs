//! Helpers for the layer tests: a tiny deterministic RNG and a finite-difference gradient check.

/// xorshift64 giving floats in [-1, 1); enough for test data.
pub struct TestRng(pub u64);

impl TestRng {
    pub fn next_f32(&mut self) -> f32 {
        let mut x = self.0 ^ 0x9E37_79B9_7F4A_7C15;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next_f32()).collect()
    }
}

pub fn dot(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
}

/// Assert `|a - b| <= atol + rtol * |b|` elementwise.
pub fn assert_close(a: &[f32], b: &[f32], atol: f32, rtol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: length");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= atol + rtol * y.abs(), "{what}[{i}]: {x} vs {y}");
    }
}

/// Compare an analytic gradient with central differences of `loss` around `x`.
/// Tolerance: the loss closures run the f32 forward kernels, so a difference quotient with
/// step h = 1e-2 carries about 1e-5 / h = 1e-3 of rounding noise plus O(h^2) truncation error.
pub fn check_grad(x: &[f32], grad: &[f32], loss: impl Fn(&[f32]) -> f64, what: &str) {
    assert_eq!(x.len(), grad.len(), "{what}: length");
    let h = 1e-2f32;
    let mut xp = x.to_vec();
    for i in 0..x.len() {
        let orig = xp[i];
        xp[i] = orig + h;
        let hi = xp[i];
        let lp = loss(&xp);
        xp[i] = orig - h;
        let lo = xp[i];
        let lm = loss(&xp);
        xp[i] = orig;
        let num = (lp - lm) / (hi - lo) as f64;
        let ana = grad[i] as f64;
        assert!((num - ana).abs() <= 2e-3 + 1e-2 * num.abs(), "{what}[{i}]: analytic {ana} vs numeric {num}");
    }
}
