//! The replay oracle: the causal effect of each turn's action, measured by executing it.
//!
//! For an episode the policy played, at every agent turn `t` (the state `s_t` before it: the
//! context's tokens with their keys and values, and the environment's state):
//!
//! 1. **Alternatives.** `K` turns are sampled afresh from `s_t` (forks of the exact state with
//!    new seeds, the policy's own sampling settings), and the environment steps on each.
//! 2. **Continuations.** From the state after the taken turn, and from the state after each
//!    alternative, `M` continuations are rolled to the episode's end with the same policy.
//! 3. **Replay advantage.** `Q̂(s_t, a_t)` is the mean return of the taken turn's `M`
//!    continuations, `q̂_k` the mean return of alternative `k`'s, and
//!    `Â_t = Q̂(s_t, a_t) − (1/K) Σ_k q̂_k`, an unbiased estimate of `Q(s_t, a_t) − V(s_t)`
//!    under the policy (the alternatives are draws of `a ~ π(·|s_t)`, each `q̂_k` an unbiased
//!    estimate of `Q(s_t, a)`).
//! 4. **Its standard error.** The two means are independent:
//!    `SE² = sd(taken)² / M + sd(q̂_1..q̂_K)² / K` (sample standard deviations). A turn is
//!    *decisive* when `|Â_t| > 2 SE` (when every return agreed, `SE = 0` and any non-zero
//!    `Â_t` is decisive).
//!
//! A state after which the episode is over has one return: its continuations are that return
//! `M` times and cost nothing. Everything is batched: all alternatives of all turns of all
//! episodes take one step together, and the continuations run in chunks of live states that
//! step together ([`Replayer::step`]), so a model's rollouts share their prefixes' keys and
//! values and batch their decoding. Cost: `Σ_episodes Σ_turns (K + 1) · M` rollouts at most.
//!
//! [`Replayer`] is what the oracle needs of a policy and an environment; the model's is
//! [`super::ModelReplayer`], and the tests script their own with known probabilities.

use anyhow::Result;
use serde::Serialize;

/// What the replay oracle needs of a policy acting in an environment.
pub trait Replayer {
    /// An episode in progress: everything its next turn is sampled from and acts on.
    type State;
    /// A copy of `state` whose later turns are sampled from `seed`: the same context (its
    /// cached keys and values shared), the environment in the same state.
    fn fork(&self, state: &Self::State, seed: u64) -> Result<Self::State>;
    /// Samples the next turn of every state (none is done) and applies it, in one batch.
    fn step(&self, states: &mut [&mut Self::State]) -> Result<()>;
    /// Whether the episode is over.
    fn is_done(&self, state: &Self::State) -> bool;
    /// The return of a finished episode.
    fn outcome(&self, state: Self::State) -> Result<f64>;
}

/// Settings of a replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplaySettings {
    /// Alternative turns sampled at each turn (`K`, at least 2 for a standard error).
    pub alternatives: usize,
    /// Continuations rolled from each turn (`M`, at least 2 for a standard error).
    pub rollouts: usize,
    /// Seed of the forks' sampling.
    pub seed: u64,
    /// Most states stepped together while rolling continuations.
    pub chunk: usize,
}

impl ReplaySettings {
    /// Checks `K ≥ 2`, `M ≥ 2`, `chunk ≥ 1`.
    pub fn validate(&self) -> Result<()> {
        anyhow::ensure!(
            self.alternatives >= 2,
            "--alternatives must be at least 2 (the standard error of the alternatives' mean \
             needs two), got {}",
            self.alternatives
        );
        anyhow::ensure!(
            self.rollouts >= 2,
            "--rollouts must be at least 2 (the standard error of a turn's mean return needs \
             two), got {}",
            self.rollouts
        );
        anyhow::ensure!(self.chunk >= 1, "the replay chunk must be at least 1");
        Ok(())
    }

    /// Rollouts of an audit of `turns` turns in all, at most: `turns · (K + 1) · M`.
    pub fn cost(&self, turns: usize) -> usize {
        turns * (self.alternatives + 1) * self.rollouts
    }
}

/// The replay of one agent turn.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TurnReplay {
    /// The turn's index in its episode (its depth, from 0).
    pub turn: usize,
    /// Returns of the taken turn's `M` continuations.
    pub taken: Vec<f64>,
    /// Per alternative, the returns of its `M` continuations.
    pub alternatives: Vec<Vec<f64>>,
    /// `Q̂(s_t, a_t)`: the mean of `taken`.
    pub q_taken: f64,
    /// `V̂(s_t)`: the mean over the alternatives of their mean returns.
    pub v: f64,
    /// The replay advantage `Q̂(s_t, a_t) − V̂(s_t)`.
    pub advantage: f64,
    /// Its standard error.
    pub se: f64,
    /// `|advantage| > 2 · se` (or non-zero with a zero standard error).
    pub decisive: bool,
}

/// Mean and sample (unbiased) standard deviation (0 below two values).
pub fn mean_sd(xs: &[f64]) -> (f64, f64) {
    let n = xs.len();
    if n == 0 {
        return (0.0, 0.0);
    }
    let mean = xs.iter().sum::<f64>() / n as f64;
    if n < 2 {
        return (mean, 0.0);
    }
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    (mean, var.sqrt())
}

impl TurnReplay {
    /// The replay of turn `turn` from its continuations' returns.
    pub fn new(turn: usize, taken: Vec<f64>, alternatives: Vec<Vec<f64>>) -> Self {
        let (q_taken, sd_taken) = mean_sd(&taken);
        let q: Vec<f64> = alternatives.iter().map(|a| mean_sd(a).0).collect();
        let (v, sd_alt) = mean_sd(&q);
        let se = (sd_taken.powi(2) / taken.len().max(1) as f64
            + sd_alt.powi(2) / q.len().max(1) as f64)
            .sqrt();
        let advantage = q_taken - v;
        let decisive = if se > 0.0 {
            advantage.abs() > 2.0 * se
        } else {
            advantage.abs() > 1e-12
        };
        Self {
            turn,
            taken,
            alternatives,
            q_taken,
            v,
            advantage,
            se,
            decisive,
        }
    }
}

/// An episode the policy played, kept for its replay: the state before each of its turns.
pub struct Played<S> {
    /// `before[t]`: the state before turn `t`.
    pub before: Vec<S>,
    /// The finished episode.
    pub finished: S,
}

/// A seed for fork `index` of kind `kind` (0 alternative, 1 taken continuation, 2 an
/// alternative's continuation) of turn `turn` of episode `episode`.
fn fork_seed(seed: u64, episode: usize, turn: usize, kind: u64, index: usize) -> u64 {
    let mut s = crate::rollout::turn_seed(seed ^ 0x6175_6469_7400_0000, episode);
    s = crate::rollout::turn_seed(s, turn);
    s = crate::rollout::turn_seed(s ^ kind, index);
    s
}

/// Plays every episode of `starts` to its end, all live ones stepping together; for the
/// episodes with `keep[i]`, keeps the state before each turn (a fork: the caller re-forks it
/// with its own seeds).
pub fn play<R: Replayer>(
    r: &R,
    starts: Vec<R::State>,
    keep: &[bool],
) -> Result<Vec<Played<R::State>>> {
    anyhow::ensure!(
        keep.len() == starts.len(),
        "{} keep flags for {} episodes",
        keep.len(),
        starts.len()
    );
    let mut states = starts;
    let mut before: Vec<Vec<R::State>> = states.iter().map(|_| Vec::new()).collect();
    loop {
        for (i, s) in states.iter().enumerate() {
            if keep[i] && !r.is_done(s) {
                before[i].push(r.fork(s, 0)?);
            }
        }
        let mut live: Vec<&mut R::State> = states.iter_mut().filter(|s| !r.is_done(s)).collect();
        if live.is_empty() {
            break;
        }
        r.step(&mut live)?;
    }
    Ok(states
        .into_iter()
        .zip(before)
        .map(|(finished, before)| Played { before, finished })
        .collect())
}

/// Rolls every state to its end, `chunk` live states at a time, and returns their returns in
/// order. `progress` is called with the number finished so far.
pub fn roll_out<R: Replayer>(
    r: &R,
    states: Vec<R::State>,
    chunk: usize,
    progress: &mut dyn FnMut(usize),
) -> Result<Vec<f64>> {
    let mut out = Vec::with_capacity(states.len());
    let mut it = states.into_iter().peekable();
    while it.peek().is_some() {
        let mut batch: Vec<R::State> = it.by_ref().take(chunk.max(1)).collect();
        loop {
            let mut live: Vec<&mut R::State> = batch.iter_mut().filter(|s| !r.is_done(s)).collect();
            if live.is_empty() {
                break;
            }
            r.step(&mut live)?;
        }
        for s in batch {
            out.push(r.outcome(s)?);
        }
        progress(out.len());
    }
    Ok(out)
}

/// A source of continuations: the state they fork from, or the return of a finished one.
enum Source<'a, S> {
    Live(&'a S),
    Over(f64),
}

/// The replay of every turn of every played episode (`played[e].before`, and `taken[e]`, the
/// return of episode `e`) under `settings`: one [`TurnReplay`] per turn, per episode.
/// `progress` gets `(rollouts finished, rollouts to run)`.
pub fn replay<R: Replayer>(
    r: &R,
    played: &[&[R::State]],
    taken: &[f64],
    settings: &ReplaySettings,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<Vec<TurnReplay>>> {
    settings.validate()?;
    anyhow::ensure!(
        played.len() == taken.len(),
        "{} returns for {} played episodes",
        taken.len(),
        played.len()
    );
    let (k, m) = (settings.alternatives, settings.rollouts);
    // 1. The alternatives: K forks of every turn's state, one step all together.
    let mut alts: Vec<R::State> = Vec::new();
    for (e, before) in played.iter().enumerate() {
        for (t, s) in before.iter().enumerate() {
            for j in 0..k {
                alts.push(r.fork(s, fork_seed(settings.seed, e, t, 0, j))?);
            }
        }
    }
    for chunk in alts.chunks_mut(settings.chunk.max(1)) {
        let mut refs: Vec<&mut R::State> = chunk.iter_mut().collect();
        r.step(&mut refs)?;
    }
    // Finished alternatives have their return now (forks of them would roll nothing).
    let mut alt_sources: Vec<Option<f64>> = Vec::with_capacity(alts.len());
    let mut alt_live: Vec<R::State> = Vec::new();
    for s in alts {
        if r.is_done(&s) {
            alt_sources.push(Some(r.outcome(s)?));
        } else {
            alt_sources.push(None);
            alt_live.push(s);
        }
    }
    // 2. The continuations' sources, in (episode, turn) order: the taken turn's (the state
    //    before the next turn, or the episode's return after its last), then each
    //    alternative's.
    let mut sources: Vec<(usize, usize, Source<'_, R::State>)> = Vec::new();
    let mut live_iter = alt_live.iter();
    let mut alt_index = 0usize;
    for (e, before) in played.iter().enumerate() {
        for t in 0..before.len() {
            let src = match before.get(t + 1) {
                Some(s) => Source::Live(s),
                None => Source::Over(taken[e]),
            };
            sources.push((e, t, src));
            for _ in 0..k {
                let src = match alt_sources[alt_index] {
                    Some(ret) => Source::Over(ret),
                    None => Source::Live(live_iter.next().ok_or_else(|| {
                        anyhow::anyhow!("replay bookkeeping: an alternative is missing")
                    })?),
                };
                alt_index += 1;
                sources.push((e, t, src));
            }
        }
    }
    // 3. Roll M continuations of every live source, in chunks.
    let total: usize = sources
        .iter()
        .filter(|(_, _, s)| matches!(s, Source::Live(_)))
        .count()
        * m;
    let mut forks: Vec<R::State> = Vec::with_capacity(total);
    for (n, (e, t, src)) in sources.iter().enumerate() {
        if let Source::Live(s) = src {
            for j in 0..m {
                forks.push(r.fork(s, fork_seed(settings.seed, *e, *t, 1 + n as u64, j))?);
            }
        }
    }
    let returns = roll_out(r, forks, settings.chunk, &mut |done| progress(done, total))?;
    // 4. Per turn: the taken returns, then K alternatives' returns.
    let mut returns = returns.into_iter();
    let mut next_m = |src: &Source<'_, R::State>| -> Result<Vec<f64>> {
        Ok(match src {
            Source::Over(ret) => vec![*ret; m],
            Source::Live(_) => {
                let v: Vec<f64> = returns.by_ref().take(m).collect();
                anyhow::ensure!(
                    v.len() == m,
                    "replay bookkeeping: a continuation is missing"
                );
                v
            }
        })
    };
    let mut out: Vec<Vec<TurnReplay>> = played.iter().map(|_| Vec::new()).collect();
    for group in sources.chunks(k + 1) {
        let (e, t, _) = group[0];
        let taken_returns = next_m(&group[0].2)?;
        let alt_returns = group[1..]
            .iter()
            .map(|(_, _, s)| next_m(s))
            .collect::<Result<Vec<_>>>()?;
        out[e].push(TurnReplay::new(t, taken_returns, alt_returns));
    }
    Ok(out)
}

/// Turn indices ranked by `|credit|`, largest first (ties keep turn order).
pub fn rank_turns(credit: &[f64]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..credit.len()).collect();
    idx.sort_by(|&a, &b| credit[b].abs().total_cmp(&credit[a].abs()));
    idx
}
