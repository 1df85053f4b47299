//! A faithful port of the part of Python's `difflib.SequenceMatcher` that GiGPO's similarity
//! grouping uses (§3.7): `SequenceMatcher(None, a, b).ratio()` over the characters (Unicode code
//! points) of two strings, including the "autojunk" heuristic (for `len(b) ≥ 200`, elements of
//! `b` occurring more than `len(b) // 100 + 1` times are "popular" and are not used to seed
//! matches).

use std::collections::HashMap;
use std::hash::Hash;

/// Matcher of two sequences with `isjunk = None` and `autojunk = True` (Python defaults).
#[derive(Debug, Clone)]
pub struct SequenceMatcher<T> {
    a: Vec<T>,
    b: Vec<T>,
    /// Positions of every non-popular element in `b` (`self.b2j`).
    b2j: HashMap<T, Vec<usize>>,
}

impl<T: Eq + Hash + Clone> SequenceMatcher<T> {
    /// Builds the matcher (`SequenceMatcher(None, a, b)`, with `autojunk`).
    pub fn new(a: Vec<T>, b: Vec<T>) -> Self {
        Self::with_autojunk(a, b, true)
    }

    /// Builds the matcher with the autojunk heuristic on or off.
    pub fn with_autojunk(a: Vec<T>, b: Vec<T>, autojunk: bool) -> Self {
        let mut b2j: HashMap<T, Vec<usize>> = HashMap::new();
        for (i, x) in b.iter().enumerate() {
            b2j.entry(x.clone()).or_default().push(i);
        }
        let n = b.len();
        if autojunk && n >= 200 {
            let ntest = n / 100 + 1;
            b2j.retain(|_, idxs| idxs.len() <= ntest);
        }
        Self { a, b, b2j }
    }

    /// Longest matching block in `a[alo..ahi]` and `b[blo..bhi]` as `(i, j, size)`; ties go to
    /// the earliest start in `a`, then in `b` (Python's `find_longest_match`). With no junk the
    /// match is extended over popular elements on both sides.
    pub fn find_longest_match(
        &self,
        alo: usize,
        ahi: usize,
        blo: usize,
        bhi: usize,
    ) -> (usize, usize, usize) {
        let (a, b) = (&self.a, &self.b);
        let (mut besti, mut bestj, mut bestsize) = (alo, blo, 0usize);
        // j2len[j] = length of the longest match ending with a[i-1] and b[j].
        let mut j2len: HashMap<usize, usize> = HashMap::new();
        for (i, ai) in a.iter().enumerate().take(ahi).skip(alo) {
            let mut newj2len: HashMap<usize, usize> = HashMap::new();
            if let Some(js) = self.b2j.get(ai) {
                for &j in js {
                    if j < blo {
                        continue;
                    }
                    if j >= bhi {
                        break;
                    }
                    let k = j
                        .checked_sub(1)
                        .and_then(|p| j2len.get(&p))
                        .copied()
                        .unwrap_or(0)
                        + 1;
                    newj2len.insert(j, k);
                    if k > bestsize {
                        besti = i + 1 - k;
                        bestj = j + 1 - k;
                        bestsize = k;
                    }
                }
            }
            j2len = newj2len;
        }
        // `isbjunk` is always false here (no isjunk function), so only these two extensions
        // apply: they absorb popular elements adjacent to the best match.
        while besti > alo && bestj > blo && a[besti - 1] == b[bestj - 1] {
            besti -= 1;
            bestj -= 1;
            bestsize += 1;
        }
        while besti + bestsize < ahi
            && bestj + bestsize < bhi
            && a[besti + bestsize] == b[bestj + bestsize]
        {
            bestsize += 1;
        }
        (besti, bestj, bestsize)
    }

    /// All matching blocks `(i, j, size)`, sorted, without the final sentinel
    /// (`get_matching_blocks`, before adjacent blocks are merged; merging keeps the sum).
    pub fn matching_blocks(&self) -> Vec<(usize, usize, usize)> {
        let mut queue = vec![(0, self.a.len(), 0, self.b.len())];
        let mut blocks = Vec::new();
        while let Some((alo, ahi, blo, bhi)) = queue.pop() {
            let (i, j, k) = self.find_longest_match(alo, ahi, blo, bhi);
            if k > 0 {
                blocks.push((i, j, k));
                if alo < i && blo < j {
                    queue.push((alo, i, blo, j));
                }
                if i + k < ahi && j + k < bhi {
                    queue.push((i + k, ahi, j + k, bhi));
                }
            }
        }
        blocks.sort_unstable();
        blocks
    }

    /// `2·M / (len(a) + len(b))`, `M` = matched elements; 1.0 when both are empty.
    pub fn ratio(&self) -> f64 {
        let total = self.a.len() + self.b.len();
        if total == 0 {
            return 1.0;
        }
        let m: usize = self.matching_blocks().iter().map(|&(_, _, k)| k).sum();
        2.0 * m as f64 / total as f64
    }
}

/// `difflib.SequenceMatcher(None, a, b).ratio()` over the characters of two strings.
pub fn sequence_ratio(a: &str, b: &str) -> f64 {
    SequenceMatcher::new(a.chars().collect(), b.chars().collect()).ratio()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{TOL, assert_close};

    /// Expectations computed with CPython 3 `difflib` on this machine.
    #[test]
    fn ratios_match_python() {
        let cases: [(&str, &str, f64); 8] = [
            (
                "doc: Paris is capital of France",
                "doc: Paris is capital of France.",
                0.984126984127,
            ),
            ("abcd", "bcde", 0.75),
            ("", "", 1.0),
            ("abc", "", 0.0),
            (
                "private Thread currentThread;",
                "private volatile Thread currentThread;",
                0.865671641791,
            ),
            ("qabxcd", "abycdf", 0.666666666667),
            (
                "The quick brown fox",
                "The quick brown dog jumps",
                0.772727272727,
            ),
            ("café naïve — ok", "cafe naive - ok", 0.8),
        ];
        for (a, b, r) in cases {
            assert_close(
                sequence_ratio(a, b),
                r,
                1e-9,
                &format!("ratio({a:?}, {b:?})"),
            );
        }
    }

    #[test]
    fn spec_3_7_ratio() {
        let r = sequence_ratio(
            "doc: Paris is capital of France",
            "doc: Paris is capital of France.",
        );
        assert_close(r, 0.984127, TOL, "spec ratio");
    }

    /// `b` of length ≥ 200: autojunk drops popular characters (python: 0.010067114094 with
    /// autojunk, 0.815436241611 without; 0.014414414414 / 0.720720720721).
    #[test]
    fn autojunk_matches_python() {
        let a = "ab".repeat(150) + "xyz";
        let b = "ba".repeat(120) + "xyz" + &"a".repeat(50);
        assert_close(
            sequence_ratio(&a, &b),
            0.010067114094,
            1e-9,
            "long1 autojunk",
        );
        let no_junk =
            SequenceMatcher::with_autojunk(a.chars().collect(), b.chars().collect(), false);
        assert_close(no_junk.ratio(), 0.815436241611, 1e-9, "long1 no autojunk");
        let a = "the cat sat on the mat. ".repeat(12);
        let b = "the dog sat on the log. ".repeat(11) + "end";
        assert_close(
            sequence_ratio(&a, &b),
            0.014414414414,
            1e-9,
            "long2 autojunk",
        );
        let no_junk =
            SequenceMatcher::with_autojunk(a.chars().collect(), b.chars().collect(), false);
        assert_close(no_junk.ratio(), 0.720720720721, 1e-9, "long2 no autojunk");
    }
}
