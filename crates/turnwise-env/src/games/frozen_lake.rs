//! FrozenLake: walk from the start to the goal on a grid of ice without falling into a hole.
//!
//! Deterministic (not slippery). Maps are generated from a seed with a safe path guaranteed by
//! construction: a random monotone lattice path from start to goal is kept free of holes before
//! the other cells become holes with probability [`FrozenLakeConfig::hole_prob`].

use std::collections::VecDeque;

use serde_json::json;
use turnwise_core::control::SplitMix64;

use super::{Direction, bad_config, param_f64, param_usize, parse_action, step_in};
use crate::env::{EnvError, Environment, Observation, StepInfo, StepResult, Task};

const NAME: &str = "FrozenLake";

/// Settings of a [`FrozenLake`] environment; a task's `params` (`size`, `hole_prob`,
/// `max_steps`) override them per episode.
#[derive(Debug, Clone, PartialEq)]
pub struct FrozenLakeConfig {
    /// Side length of the square grid (2..=32). Default 4.
    pub size: usize,
    /// Probability that a cell off the guaranteed path is a hole, in `[0, 1)`. Default 0.2.
    pub hole_prob: f64,
    /// Steps (valid or not) before the episode is cut. Default 20.
    pub max_steps: usize,
}

impl Default for FrozenLakeConfig {
    fn default() -> Self {
        Self {
            size: 4,
            hole_prob: 0.2,
            max_steps: 20,
        }
    }
}

impl FrozenLakeConfig {
    fn validate(&self) -> Result<(), EnvError> {
        if !(2..=32).contains(&self.size) {
            return Err(bad_config(
                NAME,
                "size",
                format!("must be in 2..=32, got {}", self.size),
            ));
        }
        if !(0.0..1.0).contains(&self.hole_prob) {
            return Err(bad_config(
                NAME,
                "hole_prob",
                format!("must be in [0, 1), got {}", self.hole_prob),
            ));
        }
        if self.max_steps == 0 {
            return Err(bad_config(NAME, "max_steps", "must be at least 1".into()));
        }
        Ok(())
    }

    fn for_task(&self, task: &Task) -> Result<Self, EnvError> {
        let config = Self {
            size: param_usize(task, NAME, "size")?.unwrap_or(self.size),
            hole_prob: param_f64(task, NAME, "hole_prob")?.unwrap_or(self.hole_prob),
            max_steps: param_usize(task, NAME, "max_steps")?.unwrap_or(self.max_steps),
        };
        config.validate()?;
        Ok(config)
    }
}

/// One cell of a lake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LakeCell {
    /// Safe ice.
    Frozen,
    /// A hole: stepping in ends the episode with reward 0.
    Hole,
    /// The goal: stepping in ends the episode with reward 1.
    Goal,
}

/// A generated lake: grid, start and goal.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FrozenLakeMap {
    size: usize,
    cells: Vec<LakeCell>,
    start: (usize, usize),
    goal: (usize, usize),
}

impl FrozenLakeMap {
    /// Generates the map of `seed` under `config` (same inputs, same map).
    ///
    /// # Panics
    /// Panics if `config.size < 2` (validated configs never are).
    pub fn generate(seed: u64, config: &FrozenLakeConfig) -> Self {
        let n = config.size;
        assert!(n >= 2, "FrozenLake size must be at least 2");
        let mut rng = SplitMix64::new(seed ^ 0xF0_2E11_A4E5);
        let start = (rng.below(n), rng.below(n));
        // The goal is at least half the grid's width away (Manhattan), so episodes need moves.
        let min_dist = (n / 2).max(1);
        let goal = loop {
            let g = (rng.below(n), rng.below(n));
            if start.0.abs_diff(g.0) + start.1.abs_diff(g.1) >= min_dist {
                break g;
            }
        };
        // A random monotone path: the needed vertical and horizontal moves, shuffled.
        let vertical = if goal.0 >= start.0 {
            Direction::Down
        } else {
            Direction::Up
        };
        let horizontal = if goal.1 >= start.1 {
            Direction::Right
        } else {
            Direction::Left
        };
        let mut moves: Vec<Direction> = std::iter::repeat_n(vertical, start.0.abs_diff(goal.0))
            .chain(std::iter::repeat_n(horizontal, start.1.abs_diff(goal.1)))
            .collect();
        for i in (1..moves.len()).rev() {
            moves.swap(i, rng.below(i + 1));
        }
        let mut safe = vec![false; n * n];
        let mut pos = start;
        safe[pos.0 * n + pos.1] = true;
        for d in moves {
            pos = step_in(pos, d, n, n).expect("monotone path stays on the grid");
            safe[pos.0 * n + pos.1] = true;
        }
        debug_assert_eq!(pos, goal);
        let cells = (0..n * n)
            .map(|i| {
                let hole = rng.next_f64() < config.hole_prob;
                if i == goal.0 * n + goal.1 {
                    LakeCell::Goal
                } else if !safe[i] && hole {
                    LakeCell::Hole
                } else {
                    LakeCell::Frozen
                }
            })
            .collect();
        Self {
            size: n,
            cells,
            start,
            goal,
        }
    }

    /// Side length of the grid.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Start cell `(row, col)`.
    pub fn start(&self) -> (usize, usize) {
        self.start
    }

    /// Goal cell `(row, col)`.
    pub fn goal(&self) -> (usize, usize) {
        self.goal
    }

    /// The cell at `(row, col)`.
    ///
    /// # Panics
    /// Panics if the position is off the grid.
    pub fn cell(&self, pos: (usize, usize)) -> LakeCell {
        assert!(
            pos.0 < self.size && pos.1 < self.size,
            "{pos:?} off the grid"
        );
        self.cells[pos.0 * self.size + pos.1]
    }

    /// Where a move from `pos` lands (walls of the grid block: the position stays).
    pub fn next_position(&self, pos: (usize, usize), d: Direction) -> (usize, usize) {
        step_in(pos, d, self.size, self.size).unwrap_or(pos)
    }

    /// A shortest safe move sequence from `from` to the goal (breadth-first search), or `None`
    /// if the goal cannot be reached (never for generated maps from their start).
    pub fn shortest_path(&self, from: (usize, usize)) -> Option<Vec<Direction>> {
        let n = self.size;
        let mut parent: Vec<Option<(usize, Direction)>> = vec![None; n * n];
        let mut seen = vec![false; n * n];
        let idx = |p: (usize, usize)| p.0 * n + p.1;
        let mut queue = VecDeque::from([from]);
        seen[idx(from)] = true;
        while let Some(pos) = queue.pop_front() {
            if pos == self.goal {
                let mut path = Vec::new();
                let mut cur = idx(pos);
                while let Some((prev, d)) = parent[cur] {
                    path.push(d);
                    cur = prev;
                }
                path.reverse();
                return Some(path);
            }
            if self.cell(pos) == LakeCell::Hole {
                continue;
            }
            for d in Direction::ALL {
                if let Some(next) = step_in(pos, d, n, n)
                    && !seen[idx(next)]
                    && self.cell(next) != LakeCell::Hole
                {
                    seen[idx(next)] = true;
                    parent[idx(next)] = Some((idx(pos), d));
                    queue.push_back(next);
                }
            }
        }
        None
    }

    /// Renders the grid with the player at `player`, followed by the legend.
    pub fn render(&self, player: (usize, usize)) -> String {
        let n = self.size;
        let mut out = String::with_capacity(n * n * 2 + 200);
        for r in 0..n {
            for c in 0..n {
                let symbol = match (self.cells[r * n + c], (r, c) == player) {
                    (LakeCell::Frozen, false) => '_',
                    (LakeCell::Hole, false) => 'O',
                    (LakeCell::Goal, false) => 'G',
                    (LakeCell::Frozen, true) => 'P',
                    (LakeCell::Hole, true) => 'X',
                    (LakeCell::Goal, true) => '√',
                };
                if c > 0 {
                    out.push(' ');
                }
                out.push(symbol);
            }
            out.push('\n');
        }
        out.push_str(
            "Legend: P = you, _ = frozen ice (safe), O = hole, G = goal, \
             X = you fell into a hole, √ = you reached the goal.\n\
             Actions: up, down, left, right (up = one row towards the top).",
        );
        out
    }
}

/// The FrozenLake environment (see the module docs). Reward 1 on reaching the goal, 0 otherwise;
/// falling into a hole or exhausting `max_steps` ends the episode.
#[derive(Debug, Clone, Default)]
pub struct FrozenLake {
    config: FrozenLakeConfig,
    episode: Option<LakeEpisode>,
}

#[derive(Debug, Clone)]
struct LakeEpisode {
    map: FrozenLakeMap,
    max_steps: usize,
    player: (usize, usize),
    steps: usize,
    done: bool,
}

impl FrozenLake {
    /// A FrozenLake environment with these defaults.
    pub fn new(config: FrozenLakeConfig) -> Result<Self, EnvError> {
        config.validate()?;
        Ok(Self {
            config,
            episode: None,
        })
    }

    /// The current map, after a reset.
    pub fn map(&self) -> Option<&FrozenLakeMap> {
        self.episode.as_ref().map(|e| &e.map)
    }

    /// The player's position `(row, col)`, after a reset.
    pub fn player(&self) -> Option<(usize, usize)> {
        self.episode.as_ref().map(|e| e.player)
    }

    /// A shortest safe move sequence from the current position to the goal.
    pub fn solve(&self) -> Option<Vec<Direction>> {
        let e = self.episode.as_ref()?;
        e.map.shortest_path(e.player)
    }
}

impl Environment for FrozenLake {
    fn reset(&mut self, task: &Task) -> Result<Observation, EnvError> {
        let config = self.config.for_task(task)?;
        let map = FrozenLakeMap::generate(task.seed, &config);
        let player = map.start;
        let text = map.render(player);
        self.episode = Some(LakeEpisode {
            map,
            max_steps: config.max_steps,
            player,
            steps: 0,
            done: false,
        });
        Ok(Observation::new(text))
    }

    fn step(&mut self, action_text: &str) -> Result<StepResult, EnvError> {
        let e = self.episode.as_mut().ok_or_else(|| EnvError::NotReset {
            env: NAME.to_owned(),
        })?;
        if e.done {
            return Err(EnvError::EpisodeOver {
                env: NAME.to_owned(),
            });
        }
        let parsed = parse_action(action_text);
        e.steps += 1;
        let mut info = StepInfo {
            valid_action: parsed.direction.is_some(),
            format_ok: parsed.format_ok,
            action: parsed.direction.map(|d| d.as_str().to_owned()),
            feedback: parsed.problem.clone(),
            ..StepInfo::default()
        };
        let mut reward = 0.0;
        if let Some(d) = parsed.direction {
            let next = e.map.next_position(e.player, d);
            if next == e.player {
                info.feedback = Some(format!("moving {d} is blocked by the edge of the lake"));
            }
            e.player = next;
            match e.map.cell(next) {
                LakeCell::Goal => {
                    reward = 1.0;
                    info.won = true;
                    e.done = true;
                    info.feedback = Some("you reached the goal".into());
                }
                LakeCell::Hole => {
                    e.done = true;
                    info.feedback = Some("you fell into a hole".into());
                }
                LakeCell::Frozen => {}
            }
        }
        if !e.done && e.steps >= e.max_steps {
            e.done = true;
            info.truncated = true;
        }
        info.extra.insert("steps".into(), json!(e.steps));
        Ok(StepResult {
            observation: Observation::new(e.map.render(e.player)),
            reward,
            done: e.done,
            info,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_path_is_hole_free_and_goal_is_far_enough() {
        for seed in 0..200 {
            let config = FrozenLakeConfig {
                size: 2 + (seed as usize % 7),
                hole_prob: 0.6,
                max_steps: 10,
            };
            let map = FrozenLakeMap::generate(seed, &config);
            let path = map.shortest_path(map.start()).expect("solvable");
            let dist = map.start.0.abs_diff(map.goal.0) + map.start.1.abs_diff(map.goal.1);
            assert_eq!(path.len(), dist, "monotone path is shortest (seed {seed})");
            assert!(dist >= (config.size / 2).max(1));
        }
    }

    #[test]
    fn task_params_override_and_are_validated() {
        let mut env = FrozenLake::default();
        let mut task = Task::with_seed("t", 1);
        task.params.insert("size".into(), json!(6));
        env.reset(&task).unwrap();
        assert_eq!(env.map().unwrap().size(), 6);
        task.params.insert("size".into(), json!(1));
        let err = env.reset(&task).unwrap_err().to_string();
        assert!(err.contains("size"), "{err}");
        task.params.insert("size".into(), json!("big"));
        let err = env.reset(&task).unwrap_err().to_string();
        assert!(err.contains("params.size"), "{err}");
    }
}
