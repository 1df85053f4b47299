//! A small, seedable, serialisable random number generator (xoshiro256**).
//!
//! Everything random in the crate (weight initialisation, sampling) draws from [`TurnRng`], so a
//! run is repeatable from its seed and its exact state can be checkpointed and restored.

use serde::{Deserialize, Serialize};

/// xoshiro256** generator whose full state is four `u64` words.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TurnRng {
    s: [u64; 4],
}

fn splitmix64(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl TurnRng {
    /// A generator seeded from one `u64` (expanded with SplitMix64).
    pub fn seed_from_u64(seed: u64) -> Self {
        let mut x = seed;
        let s = [
            splitmix64(&mut x),
            splitmix64(&mut x),
            splitmix64(&mut x),
            splitmix64(&mut x),
        ];
        Self { s }
    }

    /// Restores a generator from [`TurnRng::state`].
    pub fn from_state(state: [u64; 4]) -> Self {
        if state == [0; 4] {
            // The all-zero state is a fixed point of xoshiro; map it to a valid one.
            return Self::seed_from_u64(0);
        }
        Self { s: state }
    }

    /// The full internal state.
    pub fn state(&self) -> [u64; 4] {
        self.s
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Standard normal draw (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.next_f64(); // (0, 1]
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// An independent generator derived from this one's seed stream and an index (e.g. a row).
    pub fn fork(&mut self, index: u64) -> Self {
        let mut x = self.next_u64() ^ index.wrapping_mul(0xD6E8_FEB8_6659_FD93);
        Self::from_state([
            splitmix64(&mut x),
            splitmix64(&mut x),
            splitmix64(&mut x),
            splitmix64(&mut x),
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeatable_and_restorable() {
        let mut a = TurnRng::seed_from_u64(7);
        let mut b = TurnRng::seed_from_u64(7);
        for _ in 0..10 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        let state = a.state();
        let x: Vec<u64> = (0..5).map(|_| a.next_u64()).collect();
        let mut c = TurnRng::from_state(state);
        let y: Vec<u64> = (0..5).map(|_| c.next_u64()).collect();
        assert_eq!(x, y);
        let n = 20_000;
        let mean = (0..n).map(|_| b.normal()).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.05, "{mean}");
        let u = (0..n).map(|_| b.next_f64()).sum::<f64>() / n as f64;
        assert!((u - 0.5).abs() < 0.02, "{u}");
    }
}
