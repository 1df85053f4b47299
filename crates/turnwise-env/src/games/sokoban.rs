//! Sokoban: push every box onto a target.
//!
//! Rooms are generated from a seed the way gym-sokoban does it: carve a connected floor by a
//! random walk inside the outer wall, put the boxes on their targets (the solved state), then
//! play *backwards* (moves and box pulls) from there. Every pull is the reverse of a push, so the
//! reached state is solvable by construction. Each of several reverse walks proposes its last state
//! among those whose boxes are farthest from the targets (so the player has often walked away); the proposal with the longest shortest solution
//! (breadth-first search) becomes the room.

use std::collections::{HashMap, VecDeque};

use serde_json::json;
use turnwise_core::control::SplitMix64;

use super::{Direction, bad_config, param_usize, parse_action, step_in};
use crate::env::{EnvError, Environment, Observation, StepInfo, StepResult, Task};

const NAME: &str = "Sokoban";

/// Reverse-play walks per generated room (the hardest proposal is kept).
const REVERSE_WALKS: usize = 8;

/// BFS state budget when ranking proposals by solution length.
const GENERATION_SEARCH_LIMIT: usize = 200_000;

/// Settings of a [`Sokoban`] environment; a task's `params` (`width`, `height`, `num_boxes`,
/// `max_steps`) override them per episode.
#[derive(Debug, Clone, PartialEq)]
pub struct SokobanConfig {
    /// Room width including the outer wall (5..=16). Default 6.
    pub width: usize,
    /// Room height including the outer wall (5..=16). Default 6.
    pub height: usize,
    /// Number of boxes (and targets), at least 1. Default 1.
    pub num_boxes: usize,
    /// Steps (valid or not) before the episode is cut. Default 40.
    pub max_steps: usize,
    /// Moves of each reverse-play walk scrambling the solved room. Default 100.
    pub reverse_steps: usize,
    /// Shaping reward for pushing a box onto a target (and its negative for pushing one off).
    /// Default 0 (off): the only reward is +1 when solved.
    pub box_reward: f64,
}

impl Default for SokobanConfig {
    fn default() -> Self {
        Self {
            width: 6,
            height: 6,
            num_boxes: 1,
            max_steps: 40,
            reverse_steps: 100,
            box_reward: 0.0,
        }
    }
}

impl SokobanConfig {
    fn interior(&self) -> usize {
        (self.width.saturating_sub(2)) * (self.height.saturating_sub(2))
    }

    fn validate(&self) -> Result<(), EnvError> {
        for (field, v) in [("width", self.width), ("height", self.height)] {
            if !(5..=16).contains(&v) {
                return Err(bad_config(
                    NAME,
                    field,
                    format!("must be in 5..=16 (outer wall included), got {v}"),
                ));
            }
        }
        if self.num_boxes == 0 || 3 * (self.num_boxes + 1) > self.interior() {
            return Err(bad_config(
                NAME,
                "num_boxes",
                format!(
                    "must be in 1..={} for a {}x{} room, got {}",
                    self.interior() / 3 - 1,
                    self.width,
                    self.height,
                    self.num_boxes
                ),
            ));
        }
        if self.max_steps == 0 {
            return Err(bad_config(NAME, "max_steps", "must be at least 1".into()));
        }
        if self.reverse_steps == 0 {
            return Err(bad_config(
                NAME,
                "reverse_steps",
                "must be at least 1".into(),
            ));
        }
        if !self.box_reward.is_finite() {
            return Err(bad_config(NAME, "box_reward", "must be finite".into()));
        }
        Ok(())
    }

    fn for_task(&self, task: &Task) -> Result<Self, EnvError> {
        let config = Self {
            width: param_usize(task, NAME, "width")?.unwrap_or(self.width),
            height: param_usize(task, NAME, "height")?.unwrap_or(self.height),
            num_boxes: param_usize(task, NAME, "num_boxes")?.unwrap_or(self.num_boxes),
            max_steps: param_usize(task, NAME, "max_steps")?.unwrap_or(self.max_steps),
            ..self.clone()
        };
        config.validate()?;
        Ok(config)
    }
}

/// A Sokoban position: room layout, targets, boxes and player.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SokobanState {
    width: usize,
    height: usize,
    /// `true` where the cell is a wall.
    walls: Vec<bool>,
    /// Sorted cell indices of the targets.
    targets: Vec<usize>,
    /// Sorted cell indices of the boxes.
    boxes: Vec<usize>,
    /// Cell index of the player.
    player: usize,
}

/// What a move did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MoveOutcome {
    Blocked,
    Walked,
    Pushed { onto_target: bool, off_target: bool },
}

impl SokobanState {
    /// Generates the room of `seed` under `config` (same inputs, same room), or an error if the
    /// config is unusable.
    pub fn generate(seed: u64, config: &SokobanConfig) -> Result<Self, EnvError> {
        config.validate()?;
        let mut rng = SplitMix64::new(seed ^ 0x50_C0BA_4E00);
        for _ in 0..1000 {
            if let Some(state) = Self::try_generate(&mut rng, config) {
                return Ok(state);
            }
        }
        Err(bad_config(
            NAME,
            "num_boxes",
            format!(
                "could not generate a {}x{} room with {} boxes in 1000 attempts",
                config.width, config.height, config.num_boxes
            ),
        ))
    }

    fn try_generate(rng: &mut SplitMix64, config: &SokobanConfig) -> Option<Self> {
        let (w, h) = (config.width, config.height);
        let mut walls = vec![true; w * h];
        // Carve a connected floor with a random walk over the interior (gym-sokoban style).
        let interior = config.interior();
        let want_floor = (interior * 3 / 5).max(3 * (config.num_boxes + 1));
        let mut pos = (1 + rng.below(h - 2), 1 + rng.below(w - 2));
        walls[pos.0 * w + pos.1] = false;
        let mut floor = 1;
        let mut guard = 0;
        while floor < want_floor && guard < 100_000 {
            guard += 1;
            let d = Direction::ALL[rng.below(4)];
            let Some(next) = step_in(pos, d, h, w) else {
                continue;
            };
            if next.0 == 0 || next.1 == 0 || next.0 == h - 1 || next.1 == w - 1 {
                continue;
            }
            pos = next;
            if walls[pos.0 * w + pos.1] {
                walls[pos.0 * w + pos.1] = false;
                floor += 1;
            }
        }
        let mut free: Vec<usize> = (0..w * h).filter(|&i| !walls[i]).collect();
        // Pick targets and the player among distinct floor cells (partial Fisher-Yates).
        let picks = config.num_boxes + 1;
        if free.len() < picks {
            return None;
        }
        for i in 0..picks {
            let j = i + rng.below(free.len() - i);
            free.swap(i, j);
        }
        let mut targets: Vec<usize> = free[..config.num_boxes].to_vec();
        targets.sort_unstable();
        let solved = Self {
            width: w,
            height: h,
            walls,
            boxes: targets.clone(),
            targets,
            player: free[config.num_boxes],
        };

        // Reverse play: several random walks from the solved room, pulling a box that is behind
        // the player with probability 0.7. Each walk proposes its latest state with the boxes
        // farthest from the targets; among those, the one with the longest BFS solution wins.
        let mut candidates: Vec<(usize, Self)> = Vec::with_capacity(REVERSE_WALKS);
        for _ in 0..REVERSE_WALKS {
            let mut state = solved.clone();
            let mut best: Option<(usize, Self)> = None;
            for _ in 0..config.reverse_steps {
                let d = Direction::ALL[rng.below(4)];
                let pull = rng.next_f64() < 0.7;
                state.reverse_move(d, pull);
                if !state.is_solved() {
                    let score = state.displacement();
                    if best.as_ref().is_none_or(|(s, _)| score >= *s) {
                        best = Some((score, state.clone()));
                    }
                }
            }
            candidates.extend(best);
        }
        candidates
            .into_iter()
            .map(|(displacement, s)| {
                let moves = s.solve(GENERATION_SEARCH_LIMIT).map_or(0, |p| p.len());
                ((moves, displacement), s)
            })
            .fold(None::<((usize, usize), Self)>, |acc, c| match acc {
                Some(a) if a.0 >= c.0 => Some(a),
                _ => Some(c),
            })
            .map(|(_, s)| s)
    }

    /// Sum over boxes of the Manhattan distance to the nearest target.
    fn displacement(&self) -> usize {
        self.boxes
            .iter()
            .map(|&b| {
                self.targets
                    .iter()
                    .map(|&t| self.distance(b, t))
                    .min()
                    .unwrap_or(0)
            })
            .sum()
    }

    fn distance(&self, a: usize, b: usize) -> usize {
        let (ar, ac) = (a / self.width, a % self.width);
        let (br, bc) = (b / self.width, b % self.width);
        ar.abs_diff(br) + ac.abs_diff(bc)
    }

    /// The neighbour of cell `i` in direction `d`, if on the grid.
    fn neighbour(&self, i: usize, d: Direction) -> Option<usize> {
        step_in((i / self.width, i % self.width), d, self.height, self.width)
            .map(|(r, c)| r * self.width + c)
    }

    fn is_free(&self, i: usize) -> bool {
        !self.walls[i] && self.boxes.binary_search(&i).is_err()
    }

    /// One reverse move: the player steps in `d` (if free); with `pull`, a box on the cell
    /// opposite to `d` follows into the player's old cell.
    fn reverse_move(&mut self, d: Direction, pull: bool) {
        let Some(next) = self.neighbour(self.player, d) else {
            return;
        };
        if !self.is_free(next) {
            return;
        }
        let opposite = match d {
            Direction::Up => Direction::Down,
            Direction::Down => Direction::Up,
            Direction::Left => Direction::Right,
            Direction::Right => Direction::Left,
        };
        let old = self.player;
        self.player = next;
        if pull
            && let Some(behind) = self.neighbour(old, opposite)
            && let Ok(k) = self.boxes.binary_search(&behind)
        {
            self.boxes[k] = old;
            self.boxes.sort_unstable();
        }
    }

    /// Applies a forward move (walk or push); walls and blocked boxes stop it.
    fn apply(&mut self, d: Direction) -> MoveOutcome {
        let Some(next) = self.neighbour(self.player, d) else {
            return MoveOutcome::Blocked;
        };
        if self.walls[next] {
            return MoveOutcome::Blocked;
        }
        match self.boxes.binary_search(&next) {
            Err(_) => {
                self.player = next;
                MoveOutcome::Walked
            }
            Ok(k) => {
                let Some(beyond) = self.neighbour(next, d) else {
                    return MoveOutcome::Blocked;
                };
                if !self.is_free(beyond) {
                    return MoveOutcome::Blocked;
                }
                let off_target = self.targets.binary_search(&next).is_ok();
                let onto_target = self.targets.binary_search(&beyond).is_ok();
                self.boxes[k] = beyond;
                self.boxes.sort_unstable();
                self.player = next;
                MoveOutcome::Pushed {
                    onto_target,
                    off_target,
                }
            }
        }
    }

    /// Whether every box is on a target.
    pub fn is_solved(&self) -> bool {
        self.boxes == self.targets
    }

    /// Number of boxes on targets.
    pub fn boxes_on_targets(&self) -> usize {
        self.boxes
            .iter()
            .filter(|b| self.targets.binary_search(b).is_ok())
            .count()
    }

    /// The player's position `(row, col)`.
    pub fn player(&self) -> (usize, usize) {
        (self.player / self.width, self.player % self.width)
    }

    /// Box positions `(row, col)`, in row-major order.
    pub fn boxes(&self) -> Vec<(usize, usize)> {
        self.boxes
            .iter()
            .map(|&b| (b / self.width, b % self.width))
            .collect()
    }

    /// The state after moving in `d` (unchanged if the move is blocked).
    pub fn moved(&self, d: Direction) -> Self {
        let mut next = self.clone();
        next.apply(d);
        next
    }

    /// A shortest move sequence solving this position (breadth-first search over player and box
    /// positions), or `None` if there is none within `max_states` explored states.
    pub fn solve(&self, max_states: usize) -> Option<Vec<Direction>> {
        type Key = (usize, Vec<usize>);
        if self.is_solved() {
            return Some(Vec::new());
        }
        let mut parent: HashMap<Key, Option<(Key, Direction)>> = HashMap::new();
        let start: Key = (self.player, self.boxes.clone());
        parent.insert(start.clone(), None);
        let mut queue = VecDeque::from([start]);
        let mut probe = self.clone();
        while let Some(key) = queue.pop_front() {
            for d in Direction::ALL {
                probe.player = key.0;
                probe.boxes.clone_from(&key.1);
                if probe.apply(d) == MoveOutcome::Blocked {
                    continue;
                }
                let next: Key = (probe.player, probe.boxes.clone());
                if parent.contains_key(&next) {
                    continue;
                }
                parent.insert(next.clone(), Some((key.clone(), d)));
                if probe.is_solved() {
                    let mut path = vec![d];
                    let mut cur = key.clone();
                    while let Some(Some((prev, d))) = parent.get(&cur) {
                        path.push(*d);
                        cur = prev.clone();
                    }
                    path.reverse();
                    return Some(path);
                }
                if parent.len() >= max_states {
                    return None;
                }
                queue.push_back(next);
            }
        }
        None
    }

    /// Renders the room followed by the legend.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(self.width * self.height * 2 + 250);
        for r in 0..self.height {
            for c in 0..self.width {
                let i = r * self.width + c;
                let target = self.targets.binary_search(&i).is_ok();
                let boxed = self.boxes.binary_search(&i).is_ok();
                let symbol = if self.walls[i] {
                    '#'
                } else if i == self.player {
                    if target { 'S' } else { 'P' }
                } else if boxed {
                    if target { '√' } else { 'X' }
                } else if target {
                    'O'
                } else {
                    '_'
                };
                if c > 0 {
                    out.push(' ');
                }
                out.push(symbol);
            }
            out.push('\n');
        }
        out.push_str(
            "Legend: # = wall, _ = floor, O = target, X = box, √ = box on a target, \
             P = you, S = you on a target.\n\
             Actions: up, down, left, right (walk; walking into a box pushes it if the cell \
             beyond is free). Solve by pushing every box onto a target.",
        );
        out
    }
}

/// The Sokoban environment (see the module docs). Reward +1 when every box is on a target
/// (the episode ends), plus the optional [`SokobanConfig::box_reward`] shaping; exhausting
/// `max_steps` ends the episode unsolved.
#[derive(Debug, Clone, Default)]
pub struct Sokoban {
    config: SokobanConfig,
    episode: Option<SokobanEpisode>,
}

#[derive(Debug, Clone)]
struct SokobanEpisode {
    state: SokobanState,
    config: SokobanConfig,
    steps: usize,
    done: bool,
}

impl Sokoban {
    /// A Sokoban environment with these defaults.
    pub fn new(config: SokobanConfig) -> Result<Self, EnvError> {
        config.validate()?;
        Ok(Self {
            config,
            episode: None,
        })
    }

    /// The current position, after a reset.
    pub fn state(&self) -> Option<&SokobanState> {
        self.episode.as_ref().map(|e| &e.state)
    }
}

impl Environment for Sokoban {
    fn reset(&mut self, task: &Task) -> Result<Observation, EnvError> {
        let config = self.config.for_task(task)?;
        let state = SokobanState::generate(task.seed, &config)?;
        let text = state.render();
        self.episode = Some(SokobanEpisode {
            state,
            config,
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
            match e.state.apply(d) {
                MoveOutcome::Blocked => {
                    info.feedback = Some(format!("moving {d} is blocked"));
                }
                MoveOutcome::Walked => {}
                MoveOutcome::Pushed {
                    onto_target,
                    off_target,
                } => {
                    if onto_target && !off_target {
                        reward += e.config.box_reward;
                    } else if off_target && !onto_target {
                        reward -= e.config.box_reward;
                    }
                }
            }
            if e.state.is_solved() {
                reward += 1.0;
                info.won = true;
                e.done = true;
                info.feedback = Some("every box is on a target".into());
            }
        }
        if !e.done && e.steps >= e.config.max_steps {
            e.done = true;
            info.truncated = true;
        }
        info.extra.insert("steps".into(), json!(e.steps));
        info.extra
            .insert("boxes_on_targets".into(), json!(e.state.boxes_on_targets()));
        Ok(StepResult {
            observation: Observation::new(e.state.render()),
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
    fn generated_rooms_are_walled_and_unsolved() {
        for seed in 0..100 {
            let config = SokobanConfig {
                num_boxes: 1 + (seed as usize % 2),
                ..SokobanConfig::default()
            };
            let s = SokobanState::generate(seed, &config).unwrap();
            assert!(!s.is_solved(), "seed {seed}");
            assert_eq!(s.boxes.len(), config.num_boxes);
            for r in 0..s.height {
                for c in 0..s.width {
                    if r == 0 || c == 0 || r == s.height - 1 || c == s.width - 1 {
                        assert!(s.walls[r * s.width + c]);
                    }
                }
            }
            assert!(!s.walls[s.player]);
            assert!(s.boxes.iter().all(|&b| !s.walls[b] && b != s.player));
        }
    }

    #[test]
    fn box_shaping_reward_is_opt_in() {
        let config = SokobanConfig {
            box_reward: 0.25,
            num_boxes: 2,
            width: 7,
            height: 7,
            ..SokobanConfig::default()
        };
        let task = Task::with_seed("s", 3);
        let mut env = Sokoban::new(config).unwrap();
        env.reset(&task).unwrap();
        let initially_on = env.state().unwrap().boxes_on_targets() as f64;
        let plan = env.state().unwrap().solve(1_000_000).unwrap();
        let mut total = 0.0;
        for d in plan {
            total += env.step(&d.to_action_text()).unwrap().reward;
        }
        // Shaping telescopes to 0.25 × (boxes on targets at the end − at the start), plus 1.
        let expected = 1.0 + 0.25 * (2.0 - initially_on);
        assert!(
            (total - expected).abs() < 1e-9,
            "total {total} vs {expected}"
        );
    }

    #[test]
    fn config_errors_name_the_field() {
        let err = Sokoban::new(SokobanConfig {
            width: 3,
            ..SokobanConfig::default()
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("width"), "{err}");
        let err = Sokoban::new(SokobanConfig {
            num_boxes: 9,
            ..SokobanConfig::default()
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("num_boxes"), "{err}");
    }
}
