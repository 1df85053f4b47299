//! A small random mutator for the stable fuzz pass (`tests/fuzz_pass.rs`): byte flips,
//! insertions, deletions, duplications, dictionary tokens and splices of two corpus inputs,
//! from a seeded xorshift generator so a failing pass can be replayed by its seed.

/// A xorshift64* generator.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed` (any value; 0 is mapped to a fixed non-zero state).
    pub fn new(seed: u64) -> Self {
        Self(if seed == 0 {
            0x9E37_79B9_7F4A_7C15
        } else {
            seed
        })
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// `input` mutated 1 to 8 times; `dict` gives tokens to insert, `other` an input to splice
/// from; the result is at most `max_len` bytes.
pub fn mutate(
    rng: &mut Rng,
    input: &[u8],
    other: &[u8],
    dict: &[&[u8]],
    max_len: usize,
) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..1 + rng.below(8) {
        let len = out.len();
        match rng.below(8) {
            0 if len > 0 => {
                let i = rng.below(len);
                out[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                out[i] = rng.next_u64() as u8;
            }
            2 => {
                let i = rng.below(len + 1);
                const SPECIAL: &[u8] = b"\0\n\r\"\\{}[]<>:,0-1.e ";
                let b = if rng.below(2) == 0 {
                    SPECIAL[rng.below(SPECIAL.len())]
                } else {
                    rng.next_u64() as u8
                };
                out.insert(i, b);
            }
            3 if len > 0 => {
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(16));
                out.drain(i..i + n);
            }
            4 if len > 0 => {
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(32));
                let piece = out[i..i + n].to_vec();
                let at = rng.below(out.len() + 1);
                out.splice(at..at, piece);
            }
            5 if !dict.is_empty() => {
                let token = dict[rng.below(dict.len())];
                let at = rng.below(len + 1);
                out.splice(at..at, token.iter().copied());
            }
            6 if !other.is_empty() => {
                let i = rng.below(other.len());
                let n = 1 + rng.below((other.len() - i).min(64));
                let at = rng.below(len + 1);
                out.splice(at..at, other[i..i + n].iter().copied());
            }
            7 if len > 0 => out.truncate(rng.below(len)),
            _ => out.push(rng.next_u64() as u8),
        }
    }
    out.truncate(max_len);
    out
}
