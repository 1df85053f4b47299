//! Text games as the task (`task.env = "frozen_lake" | "sokoban"`): seeded maps per split
//! (held-out maps never repeat a training map), the rules and the board as the question, the
//! solver's shortest solutions (with optional noise) as warm-start demonstrations, and the
//! environment's return as the reward.
//!
//! The games run through [`GameEnv`], which shows the agent the board only (the rules and the
//! legend are in the prompt) with its rows separated by ` | `, so that a word-level tokenizer,
//! which drops line breaks, still sees the rows. Identical states give identical observations,
//! which GiGPO's anchor-state groups read (spec §3.7).

use std::collections::HashSet;

use anyhow::{Context, Result, bail};
use turnwise_core::control::SplitMix64;
use turnwise_env::env::{EnvError, Environment, Observation, StepResult, Task};
use turnwise_env::games::{Direction, FrozenLake, FrozenLakeConfig, Sokoban, SokobanConfig};
use turnwise_env::world::Split;

use crate::config::{GameConfig, TaskConfig, TaskEnv};
use crate::task::QaItem;

/// Most states the Sokoban solver explores per solve.
const SOLVE_STATES: usize = 200_000;

/// The board of a game observation as the agent sees it: the grid's rows (the legend left
/// out) joined by ` | `, on a line of its own after `board:`.
pub fn board_text(raw: &str) -> String {
    let rows: Vec<&str> = raw
        .lines()
        .take_while(|l| !l.starts_with("Legend:"))
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    format!("\nboard: {}\n", rows.join(" | "))
}

/// The rules of a game, the opening of every question.
fn rules(kind: TaskEnv) -> &'static str {
    match kind {
        TaskEnv::FrozenLake => {
            "FrozenLake. You are P on a frozen lake: walk to the goal G. _ is safe ice; \
             stepping onto a hole O ends the game. Every turn, think inside <think> </think>, \
             then write one move inside <action> </action>: up, down, left or right (up is one \
             row towards the top). Rows of the board are separated by |."
        }
        TaskEnv::Sokoban => {
            "Sokoban. You are P (S when on a target). Push every box X onto a target O; √ is a \
             box on a target, # is a wall, _ is floor. Walking into a box pushes it when the \
             cell beyond is free. Every turn, think inside <think> </think>, then write one \
             move inside <action> </action>: up, down, left or right (up is one row towards \
             the top). Rows of the board are separated by |."
        }
        TaskEnv::Search | TaskEnv::TwoTurn | TaskEnv::OpenEnv => "",
    }
}

#[derive(Debug, Clone)]
enum Game {
    Lake(FrozenLake),
    Sokoban(Sokoban),
}

/// A game environment (FrozenLake or Sokoban) whose observations are [`board_text`].
/// The turn limit is the game's step limit.
#[derive(Debug, Clone)]
pub struct GameEnv {
    game: Game,
}

impl GameEnv {
    /// The game `kind` with the sizes of `game` and `max_turns` steps per episode.
    pub fn new(kind: TaskEnv, game: &GameConfig, max_turns: usize) -> Result<Self> {
        let game = match kind {
            TaskEnv::FrozenLake => Game::Lake(FrozenLake::new(FrozenLakeConfig {
                size: game.size,
                hole_prob: game.hole_prob,
                max_steps: max_turns,
            })?),
            TaskEnv::Sokoban => Game::Sokoban(Sokoban::new(SokobanConfig {
                width: game.room_size,
                height: game.room_size,
                num_boxes: game.num_boxes,
                max_steps: max_turns,
                ..SokobanConfig::default()
            })?),
            TaskEnv::Search | TaskEnv::TwoTurn | TaskEnv::OpenEnv => {
                bail!("task.env = \"{}\" is not a game", kind.name())
            }
        };
        Ok(Self { game })
    }

    /// A shortest solution from the current state (breadth-first search), after a reset;
    /// `None` when there is none (fell into a hole, a box stuck in a corner).
    pub fn solve(&self) -> Option<Vec<Direction>> {
        match &self.game {
            Game::Lake(g) => {
                let (map, player) = (g.map()?, g.player()?);
                if map.cell(player) == turnwise_env::games::LakeCell::Hole {
                    return None;
                }
                g.solve()
            }
            Game::Sokoban(g) => g.state()?.solve(SOLVE_STATES),
        }
    }

    fn inner(&mut self) -> &mut dyn Environment {
        match &mut self.game {
            Game::Lake(g) => g,
            Game::Sokoban(g) => g,
        }
    }
}

impl Environment for GameEnv {
    fn reset(&mut self, task: &Task) -> Result<Observation, EnvError> {
        let obs = self.inner().reset(task)?;
        Ok(Observation::new(board_text(&obs.text)))
    }

    fn step(&mut self, action_text: &str) -> Result<StepResult, EnvError> {
        let mut r = self.inner().step(action_text)?;
        r.observation = Observation::new(board_text(&r.observation.text));
        Ok(r)
    }
}

/// One generated map of a split.
#[derive(Debug, Clone, PartialEq)]
pub struct GameMap {
    /// Its id (`frozen_lake-test-3`).
    pub id: String,
    /// The seed the environment generates it from.
    pub seed: u64,
    /// The first observation ([`board_text`]).
    pub board: String,
    /// A shortest solution.
    pub solution: Vec<Direction>,
}

/// The seed of candidate `j` of split `split` (splitmix64 of the three).
fn map_seed(base: u64, split: usize, j: usize) -> u64 {
    let mut z = base
        ^ (split as u64).wrapping_mul(0xD1B5_4A32_D192_ED03)
        ^ (j as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A game task: the maps of every split and how episodes are played.
#[derive(Debug, Clone)]
pub struct GameTask {
    kind: TaskEnv,
    game: GameConfig,
    max_turns: usize,
    maps: [Vec<GameMap>; 3],
}

impl GameTask {
    /// Generates the maps of `config.game` for `config.env`: training maps first, then
    /// validation and test maps, each map kept only when it differs from every map kept before
    /// and its shortest solution fits `config.max_turns` turns.
    pub fn build(config: &TaskConfig) -> Result<Self> {
        let kind = config.env;
        let game = config.game.clone();
        let mut env = GameEnv::new(kind, &game, config.max_turns)?;
        let mut seen = HashSet::new();
        let mut maps: [Vec<GameMap>; 3] = Default::default();
        for (k, split) in Split::ALL.into_iter().enumerate() {
            let wanted = match split {
                Split::Train => game.train,
                Split::Validation => game.validation,
                Split::Test => game.test,
            };
            let tries = 50 * wanted + 200;
            for j in 0..tries {
                if maps[k].len() == wanted {
                    break;
                }
                let seed = map_seed(game.seed, k, j);
                let id = format!("{}-{}-{}", kind.name(), split.name(), maps[k].len());
                let board = env
                    .reset(&Task::with_seed(id.clone(), seed))
                    .with_context(|| format!("generating {} map {seed}", kind.name()))?
                    .text;
                let Some(solution) = env.solve() else {
                    continue;
                };
                if solution.is_empty()
                    || solution.len() > config.max_turns
                    || !seen.insert(board.clone())
                {
                    continue;
                }
                maps[k].push(GameMap {
                    id,
                    seed,
                    board,
                    solution,
                });
            }
            if maps[k].len() < wanted {
                bail!(
                    "task.env = \"{}\": found {} of the {wanted} {} maps asked (task.game.{}) \
                     that are new and solvable within task.max_turns = {} turns in {tries} \
                     seeds; raise task.max_turns, make the maps smaller or ask for fewer",
                    kind.name(),
                    maps[k].len(),
                    split.name(),
                    split.name(),
                    config.max_turns
                );
            }
        }
        Ok(Self {
            kind,
            game,
            max_turns: config.max_turns,
            maps,
        })
    }

    /// The maps of `split`.
    pub fn maps(&self, split: Split) -> &[GameMap] {
        let k = Split::ALL
            .iter()
            .position(|&s| s == split)
            .expect("every split is in Split::ALL");
        &self.maps[k]
    }

    /// A fresh environment for one episode.
    pub fn env(&self) -> Result<GameEnv> {
        GameEnv::new(self.kind, &self.game, self.max_turns)
    }

    /// The question of a map: the rules, then the board.
    pub fn question_text(&self, map: &GameMap) -> String {
        format!("{} {}", rules(self.kind), map.board.trim())
    }

    /// The questions of `split`: one per map, carrying its seed and no golden answers.
    pub fn questions(&self, split: Split) -> Vec<QaItem> {
        self.maps(split)
            .iter()
            .map(|m| QaItem {
                id: m.id.clone(),
                text: self.question_text(m),
                golden_answers: Vec::new(),
                hops: 0,
                prompt: None,
                seed: m.seed,
                routine_turns: 0,
            })
            .collect()
    }

    /// The demonstration of `map`: the response segments `(text, written_by_agent)` of the
    /// solver playing it through [`GameEnv`] (so observations are exactly what rollouts see).
    /// With probability `noise` per turn the solver first makes another move, kept only when
    /// the game stays solvable within the turn limit (a detour it then recovers from).
    pub fn demonstration(
        &self,
        map: &GameMap,
        noise: f64,
        rng: &mut SplitMix64,
    ) -> Result<Vec<(String, bool)>> {
        let mut env = self.env()?;
        env.reset(&Task::with_seed(map.id.clone(), map.seed))?;
        let mut segments = Vec::new();
        for turn in 0..self.max_turns {
            let plan = env
                .solve()
                .with_context(|| format!("the solver lost map {} at turn {turn}", map.id))?;
            let mut pick = plan[0];
            if noise > 0.0 && rng.next_f64() < noise {
                let others: Vec<Direction> =
                    Direction::ALL.into_iter().filter(|&d| d != pick).collect();
                let detour = others[rng.below(others.len())];
                let mut trial = env.clone();
                let r = trial.step(&detour.to_action_text())?;
                let fits = |p: Vec<Direction>| turn + 1 + p.len() <= self.max_turns;
                if r.info.won || (!r.done && trial.solve().is_some_and(fits)) {
                    pick = detour;
                }
            }
            let text = pick.to_action_text();
            let r = env.step(&text)?;
            segments.push((text, true));
            if r.done {
                if !r.info.won {
                    bail!("the solver's demonstration of map {} did not win", map.id);
                }
                return Ok(segments);
            }
            segments.push((r.observation.text, false));
        }
        bail!(
            "the solver's demonstration of map {} did not finish in {} turns",
            map.id,
            self.max_turns
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The game `env` with `max_turns` turns and `[train, validation, test]` maps.
    fn game(env: TaskEnv, max_turns: usize, [train, validation, test]: [usize; 3]) -> GameTask {
        let config = TaskConfig {
            env,
            format: crate::config::AgentFormatName::T2po,
            max_turns,
            game: GameConfig {
                train,
                validation,
                test,
                ..GameConfig::default()
            },
            ..TaskConfig::default()
        };
        GameTask::build(&config).unwrap()
    }

    fn lake(max_turns: usize) -> GameTask {
        game(TaskEnv::FrozenLake, max_turns, [30, 10, 10])
    }

    #[test]
    fn held_out_maps_are_new_and_every_map_fits_the_turn_limit() {
        let task = lake(5);
        let train: HashSet<&str> = task
            .maps(Split::Train)
            .iter()
            .map(|m| m.board.as_str())
            .collect();
        assert_eq!(train.len(), 30);
        for split in [Split::Validation, Split::Test] {
            assert_eq!(task.maps(split).len(), 10);
            assert!(
                task.maps(split)
                    .iter()
                    .all(|m| !train.contains(m.board.as_str()))
            );
        }
        for m in Split::ALL.iter().flat_map(|&s| task.maps(s)) {
            assert!((1..=5).contains(&m.solution.len()), "{}", m.id);
        }
        // Same config, same maps.
        assert_eq!(lake(5).maps(Split::Test), task.maps(Split::Test));
        let q = &task.questions(Split::Test)[0];
        assert!(q.text.starts_with("FrozenLake.") && q.text.contains("board: "));
        assert_eq!(q.seed, task.maps(Split::Test)[0].seed);
    }

    #[test]
    fn demonstrations_win_and_noise_makes_detours() {
        let task = lake(6);
        let mut rng = SplitMix64::new(1);
        let mut longer = 0;
        for m in task.maps(Split::Train) {
            let clean = task.demonstration(m, 0.0, &mut rng).unwrap();
            let moves = clean.iter().filter(|(_, a)| *a).count();
            assert_eq!(moves, m.solution.len());
            // Agent turn, observation, agent turn, …, agent turn.
            assert_eq!(clean.len(), 2 * moves - 1);
            assert!(clean[0].0.starts_with("<think>") && clean[0].0.ends_with("</action>"));
            assert!(clean.iter().all(|(t, a)| *a || t.starts_with("\nboard: ")));
            let noisy = task.demonstration(m, 0.5, &mut rng).unwrap();
            longer += usize::from(noisy.len() > clean.len());
        }
        assert!(longer > 0, "noise 0.5 never made a detour");
    }

    #[test]
    fn sokoban_maps_fit_and_their_demonstrations_win() {
        let task = game(TaskEnv::Sokoban, 20, [8, 2, 2]);
        let mut rng = SplitMix64::new(3);
        for m in task.maps(Split::Train) {
            assert!((1..=20).contains(&m.solution.len()));
            // 6 rows of 6 cells.
            assert_eq!(m.board.matches(" | ").count(), 5, "{}", m.board);
            // `demonstration` fails unless the replay wins.
            let demo = task.demonstration(m, 0.3, &mut rng).unwrap();
            assert!(demo.iter().filter(|(_, a)| *a).count() >= m.solution.len());
        }
        assert!(
            task.question_text(&task.maps(Split::Test)[0])
                .starts_with("Sokoban.")
        );
    }

    #[test]
    fn boards_keep_rows_and_drop_the_legend() {
        let raw = "_ P\nO G\nLegend: P = you\nActions: up";
        assert_eq!(board_text(raw), "\nboard: _ P | O G\n");
    }
}
