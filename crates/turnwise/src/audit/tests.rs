//! The replay oracle on scripted policies whose probabilities are known: a planted decisive
//! turn, and the exact advantage by enumeration.

use anyhow::Result;
use turnwise_core::control::SplitMix64;

use super::replay::{ReplaySettings, Replayer, TurnReplay, play, rank_turns, replay};
use crate::rollout::turn_seed;

/// A scripted stochastic policy in a deterministic world: at each turn it draws action `a` with
/// probability `probs[a]` (from its seed and the turn); the episode ends after `max_turns`
/// turns or when `ends(actions)`, with return `ret(actions)`.
struct Scripted {
    probs: Vec<f64>,
    max_turns: usize,
    ends: fn(&[usize]) -> bool,
    ret: fn(&[usize]) -> f64,
}

#[derive(Debug, Clone)]
struct State {
    actions: Vec<usize>,
    seed: u64,
    done: bool,
}

impl Scripted {
    fn start(&self, seed: u64) -> State {
        State {
            actions: Vec::new(),
            seed,
            done: false,
        }
    }

    fn terminal(&self, actions: &[usize]) -> bool {
        actions.len() >= self.max_turns || (self.ends)(actions)
    }

    /// `V(h)`: the expected return from history `h` under the policy, by enumeration.
    fn value(&self, h: &[usize]) -> f64 {
        (0..self.probs.len())
            .map(|a| self.probs[a] * self.q(h, a))
            .sum()
    }

    /// `Q(h, a)`, by enumeration.
    fn q(&self, h: &[usize], a: usize) -> f64 {
        let mut next = h.to_vec();
        next.push(a);
        if self.terminal(&next) {
            (self.ret)(&next)
        } else {
            self.value(&next)
        }
    }
}

impl Replayer for Scripted {
    type State = State;

    fn fork(&self, state: &State, seed: u64) -> Result<State> {
        Ok(State {
            seed,
            ..state.clone()
        })
    }

    fn step(&self, states: &mut [&mut State]) -> Result<()> {
        for s in states.iter_mut() {
            anyhow::ensure!(!s.done, "stepped a finished episode");
            let u = SplitMix64::new(turn_seed(s.seed, s.actions.len())).next_f64();
            let mut acc = 0.0;
            let mut a = self.probs.len() - 1;
            for (i, p) in self.probs.iter().enumerate() {
                acc += p;
                if u < acc {
                    a = i;
                    break;
                }
            }
            s.actions.push(a);
            s.done = self.terminal(&s.actions);
        }
        Ok(())
    }

    fn is_done(&self, state: &State) -> bool {
        state.done
    }

    fn outcome(&self, state: State) -> Result<f64> {
        anyhow::ensure!(state.done, "the outcome of an unfinished episode");
        Ok((self.ret)(&state.actions))
    }
}

/// Plays `n` episodes and replays every turn; returns the finished histories and the replays.
fn audit(
    world: &Scripted,
    n: usize,
    settings: &ReplaySettings,
) -> (Vec<Vec<usize>>, Vec<f64>, Vec<Vec<TurnReplay>>) {
    let starts = (0..n)
        .map(|i| world.start(turn_seed(settings.seed ^ 0x5eed, i)))
        .collect();
    let played = play(world, starts, &vec![true; n]).unwrap();
    let histories: Vec<Vec<usize>> = played.iter().map(|p| p.finished.actions.clone()).collect();
    let taken: Vec<f64> = histories.iter().map(|h| (world.ret)(h)).collect();
    let befores: Vec<&[State]> = played.iter().map(|p| p.before.as_slice()).collect();
    for (b, h) in befores.iter().zip(&histories) {
        assert_eq!(b.len(), h.len(), "one state before each turn");
    }
    let replays = replay(world, &befores, &taken, settings, &mut |_, _| {}).unwrap();
    (histories, taken, replays)
}

/// Done-when (issue 52): in a world where exactly one turn decides the outcome (turn 1 of 3:
/// the return is the action drawn there, 0 or 1 with probability 1/2; turns 0 and 2 change
/// nothing), the audit ranks that turn first in every episode. The episode's outcome broadcast
/// to every turn (what the audit would say if the replay were replaced by the outcome) ranks
/// the turns by their order instead, so it cannot pass: checked below as well.
#[test]
fn the_replay_ranks_the_one_decisive_turn_first_in_every_episode() {
    let world = Scripted {
        probs: vec![0.5, 0.5],
        max_turns: 3,
        ends: |_| false,
        ret: |a| a[1] as f64,
    };
    let settings = ReplaySettings {
        alternatives: 32,
        rollouts: 32,
        seed: 3,
        chunk: 64,
    };
    let (_, taken, replays) = audit(&world, 12, &settings);
    for (e, reps) in replays.iter().enumerate() {
        let credit: Vec<f64> = reps.iter().map(|r| r.advantage).collect();
        assert_eq!(credit.len(), 3);
        assert_eq!(
            rank_turns(&credit)[0],
            1,
            "episode {e}: the replay advantages {credit:?} do not rank the decisive turn 1 first"
        );
        assert!(
            reps[1].decisive,
            "episode {e}: turn 1 is not found decisive"
        );
        // After the decisive turn nothing changes the return: exactly zero, no error.
        assert_eq!((reps[2].advantage, reps[2].se), (0.0, 0.0));
        assert!(!reps[2].decisive);
    }
    // The outcome broadcast gives every turn of an episode the same credit: it never singles
    // out turn 1.
    for t in &taken {
        assert_ne!(rank_turns(&[*t; 3])[0], 1);
    }
}

/// A world with early endings and uneven probabilities, whose exact advantages enumerate:
/// action 2 ends the episode (an answer: return 1 after an action 0, else 0.2), three turns at
/// most (then the share of actions 1, halved).
fn enumerable() -> Scripted {
    Scripted {
        probs: vec![0.2, 0.5, 0.3],
        max_turns: 3,
        ends: |a| a.last() == Some(&2),
        ret: |a| {
            if a.last() == Some(&2) {
                if a.contains(&0) { 1.0 } else { 0.2 }
            } else {
                0.5 * a.iter().filter(|&&x| x == 1).count() as f64 / 3.0
            }
        },
    }
}

/// Done-when (issue 52): the replay advantage is unbiased for `Q(s_t, a_t) − V(s_t)`,
/// enumerated exactly: most turns lie within 3 standard errors of their exact value, the mean
/// error over 300 episodes is within 3 of its standard errors of 0, and with many alternatives
/// and continuations each turn's estimate is close to its exact value.
#[test]
fn the_replay_advantage_matches_the_enumerated_exact_value() {
    let world = enumerable();
    let settings = ReplaySettings {
        alternatives: 8,
        rollouts: 8,
        seed: 11,
        chunk: 128,
    };
    let (histories, _, replays) = audit(&world, 300, &settings);
    let mut errors = Vec::new();
    let mut within = 0usize;
    for (h, reps) in histories.iter().zip(&replays) {
        for r in reps {
            let prefix = &h[..r.turn];
            let exact = world.q(prefix, h[r.turn]) - world.value(prefix);
            let err = r.advantage - exact;
            within += usize::from(err.abs() <= 3.0 * r.se + 1e-12);
            errors.push(err);
        }
    }
    let n = errors.len() as f64;
    assert!(n > 400.0, "only {n} turns");
    let share = within as f64 / n;
    assert!(
        share > 0.9,
        "only {share:.3} of turns within 3 SE of the exact value"
    );
    let (mean, sd) = super::replay::mean_sd(&errors);
    let se = sd / n.sqrt();
    assert!(
        mean.abs() < 3.0 * se,
        "mean error {mean:.4} is {:.1} of its standard errors ({se:.4}) from 0",
        mean.abs() / se
    );
    // Convergence: K = M = 200 pins each turn down.
    let big = ReplaySettings {
        alternatives: 200,
        rollouts: 200,
        seed: 5,
        chunk: 4096,
    };
    let (histories, _, replays) = audit(&world, 6, &big);
    for (h, reps) in histories.iter().zip(&replays) {
        for r in reps {
            let prefix = &h[..r.turn];
            let exact = world.q(prefix, h[r.turn]) - world.value(prefix);
            assert!(
                (r.advantage - exact).abs() < 0.06,
                "history {h:?} turn {}: {} against exact {exact}",
                r.turn,
                r.advantage
            );
        }
    }
}

/// The standard error is the two means' and the decisive flag reads it.
#[test]
fn turn_replay_figures() {
    let r = TurnReplay::new(0, vec![1.0, 1.0], vec![vec![0.0, 0.0], vec![1.0, 0.0]]);
    assert_eq!((r.q_taken, r.v, r.advantage), (1.0, 0.25, 0.75));
    // sd of the alternatives' means (0, 0.5) is √0.125; over √2.
    assert!((r.se - (0.125f64 / 2.0).sqrt()).abs() < 1e-12);
    assert!(r.decisive);
    let tie = TurnReplay::new(1, vec![0.0; 3], vec![vec![0.0; 3]; 2]);
    assert!(!tie.decisive && tie.se == 0.0);
}

/// The replay's default chunk keeps the live continuations' key-value caches near
/// [`super::LIVE_KV_BUDGET`]: SmolLM2-135M's (30 layers × 3 KV heads × 64, f32) at 712 tokens
/// is 32.8 MB an episode, so 65 at once instead of 256 (13.6 GB peak measured with 256); a
/// small model keeps the cap of 256, a huge context the floor of 8.
#[test]
fn the_replay_chunk_fits_the_kv_budget() {
    let mut m = turnwise_model::model::ModelConfig::tiny_qwen2(100);
    m.num_hidden_layers = 30;
    m.num_key_value_heads = 3;
    m.head_dim = 64;
    let per_episode = 2 * 30 * 3 * 64 * 4 * 712;
    let chunk = super::live_budget_chunk(&m, 712, 4);
    assert_eq!(chunk as u64, super::LIVE_KV_BUDGET / per_episode);
    assert_eq!(chunk, 65);
    assert!(chunk as u64 * per_episode <= super::LIVE_KV_BUDGET);
    // Half the bytes (bf16), twice as many.
    assert_eq!(super::live_budget_chunk(&m, 712, 2), 130);
    let tiny = turnwise_model::model::ModelConfig::tiny_qwen2(100);
    assert_eq!(super::live_budget_chunk(&tiny, 712, 4), 256);
    assert_eq!(super::live_budget_chunk(&m, 1 << 20, 4), 8);
}
