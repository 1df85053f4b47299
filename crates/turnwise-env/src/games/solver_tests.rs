//! Both games through the [`Environment`] trait: every generated map for seeds 0..50 is solved
//! by BFS and replaying the plan wins; random and invalid actions are handled; determinism per
//! seed; revisited states render identically.

use std::collections::HashSet;

use turnwise_core::control::SplitMix64;

use super::*;
use crate::env::{Environment, Task};

const SEEDS: std::ops::Range<u64> = 0..50;

fn task(seed: u64) -> Task {
    Task::with_seed(format!("seed-{seed}"), seed)
}

#[test]
fn frozen_lake_bfs_solves_every_seed_and_replay_wins() {
    for size in [4, 6, 8] {
        let config = FrozenLakeConfig {
            size,
            hole_prob: 0.3,
            max_steps: 100,
        };
        for seed in SEEDS {
            let mut env = FrozenLake::new(config.clone()).unwrap();
            env.reset(&task(seed)).unwrap();
            let plan = env
                .solve()
                .unwrap_or_else(|| panic!("size {size} seed {seed} unsolvable"));
            assert!(!plan.is_empty());
            for (i, d) in plan.iter().enumerate() {
                let r = env.step(&d.to_action_text()).unwrap();
                assert!(r.info.valid_action && r.info.format_ok);
                let last = i + 1 == plan.len();
                assert_eq!(r.done, last, "seed {seed} step {i}");
                assert_eq!(r.reward, if last { 1.0 } else { 0.0 });
                assert_eq!(r.info.won, last);
            }
        }
    }
}

#[test]
fn sokoban_bfs_solves_every_seed_and_replay_wins() {
    for (boxes, side) in [(1, 6), (2, 7)] {
        let mut lengths = Vec::new();
        let config = SokobanConfig {
            num_boxes: boxes,
            width: side,
            height: side,
            max_steps: 500,
            ..SokobanConfig::default()
        };
        for seed in SEEDS {
            let mut env = Sokoban::new(config.clone()).unwrap();
            env.reset(&task(seed)).unwrap();
            let plan = env
                .state()
                .unwrap()
                .solve(2_000_000)
                .unwrap_or_else(|| panic!("{boxes} boxes seed {seed} unsolvable"));
            assert!(!plan.is_empty());
            lengths.push(plan.len());
            let mut total = 0.0;
            for (i, d) in plan.iter().enumerate() {
                let r = env.step(&d.to_action_text()).unwrap();
                total += r.reward;
                assert_eq!(r.done, i + 1 == plan.len(), "seed {seed} step {i}");
            }
            assert_eq!(total, 1.0, "seed {seed}");
            assert!(env.state().unwrap().is_solved());
        }
        // Rooms are not trivial: the median shortest solution takes several moves.
        lengths.sort_unstable();
        let median = lengths[lengths.len() / 2];
        assert!(median >= 4, "{boxes} boxes: median solution {median} moves");
    }
}

#[test]
fn generation_is_deterministic_per_seed_and_varies_across_seeds() {
    let mut lakes = HashSet::new();
    let mut rooms = HashSet::new();
    for seed in SEEDS {
        let (mut a, mut b) = (FrozenLake::default(), FrozenLake::default());
        let obs = a.reset(&task(seed)).unwrap();
        assert_eq!(obs, b.reset(&task(seed)).unwrap());
        lakes.insert(obs.text);
        let (mut a, mut b) = (Sokoban::default(), Sokoban::default());
        let obs = a.reset(&task(seed)).unwrap();
        assert_eq!(obs, b.reset(&task(seed)).unwrap());
        assert_eq!(a.state(), b.state());
        rooms.insert(obs.text);
    }
    assert!(lakes.len() >= 45, "only {} distinct lakes", lakes.len());
    assert!(rooms.len() >= 45, "only {} distinct rooms", rooms.len());
}

#[test]
fn invalid_actions_flag_info_and_leave_the_state_unchanged() {
    let mut lake = FrozenLake::default();
    let mut soko = Sokoban::default();
    let envs: [&mut dyn Environment; 2] = [&mut lake, &mut soko];
    for env in envs {
        let start = env.reset(&task(7)).unwrap();
        for text in [
            "",
            "up",
            "<action>jump</action>",
            "<think>hmm</think>",
            "<think>x</think><action></action>",
        ] {
            let r = env.step(text).unwrap();
            assert!(!r.info.valid_action, "{text:?}");
            assert!(!r.info.format_ok);
            assert!(r.info.feedback.is_some());
            assert_eq!(r.reward, 0.0);
            assert!(!r.done);
            assert_eq!(r.observation, start, "state changed on {text:?}");
        }
        // Relaxed parse: the move is applied but the format flag is down.
        let r = env.step("go <action>UP</action> now").unwrap();
        assert!(r.info.valid_action && !r.info.format_ok);
        assert_eq!(r.info.action.as_deref(), Some("up"));
    }
}

#[test]
fn step_limit_truncates_and_misuse_is_an_error() {
    let mut env = FrozenLake::new(FrozenLakeConfig {
        max_steps: 3,
        ..FrozenLakeConfig::default()
    })
    .unwrap();
    assert!(matches!(
        env.step("<action>up</action>"),
        Err(crate::env::EnvError::NotReset { .. })
    ));
    env.reset(&task(1)).unwrap();
    let mut last = None;
    for _ in 0..3 {
        last = Some(
            env.step("<think>wait</think><action>nowhere</action>")
                .unwrap(),
        );
    }
    let last = last.unwrap();
    assert!(last.done && last.info.truncated && !last.info.won);
    assert!(matches!(
        env.step("<action>up</action>"),
        Err(crate::env::EnvError::EpisodeOver { .. })
    ));
}

#[test]
fn random_play_never_breaks_invariants() {
    let mut rng = SplitMix64::new(99);
    let words = ["up", "down", "left", "right", "stay", ""];
    for seed in SEEDS {
        let mut lake = FrozenLake::default();
        let mut soko = Sokoban::default();
        for env in [&mut lake as &mut dyn Environment, &mut soko] {
            env.reset(&task(seed)).unwrap();
            let mut steps = 0;
            loop {
                let w = words[rng.below(words.len())];
                let r = env
                    .step(&format!("<think>r</think><action>{w}</action>"))
                    .unwrap();
                steps += 1;
                assert!(r.reward == 0.0 || (r.reward == 1.0 && r.info.won && r.done));
                if r.done {
                    break;
                }
                assert!(steps < 1000);
            }
        }
        let boxes = soko.state().unwrap().boxes();
        assert_eq!(boxes.len(), 1);
    }
}

#[test]
fn revisiting_a_state_gives_the_identical_observation() {
    // FrozenLake: find a safe neighbour, step there and back.
    for seed in SEEDS {
        let mut env = FrozenLake::default();
        let start = env.reset(&task(seed)).unwrap();
        let map = env.map().unwrap().clone();
        let pos = map.start();
        let Some((d, back)) = [
            (Direction::Up, Direction::Down),
            (Direction::Down, Direction::Up),
            (Direction::Left, Direction::Right),
            (Direction::Right, Direction::Left),
        ]
        .into_iter()
        .find(|(d, _)| {
            let next = map.next_position(pos, *d);
            next != pos && map.cell(next) == LakeCell::Frozen
        }) else {
            continue;
        };
        let away = env.step(&d.to_action_text()).unwrap();
        assert_ne!(away.observation, start);
        let again = env.step(&back.to_action_text()).unwrap();
        assert_eq!(again.observation.text, start.text, "seed {seed}");
        // A blocked or invalid move also reproduces the same string.
        let same = env.step("<think>?</think><action>fly</action>").unwrap();
        assert_eq!(same.observation.text, start.text);
    }
    // Sokoban: a walk that pushes nothing, there and back.
    let mut revisits = 0;
    for seed in SEEDS {
        let mut env = Sokoban::default();
        let start = env.reset(&task(seed)).unwrap();
        let state = env.state().unwrap().clone();
        for (d, back) in [
            (Direction::Up, Direction::Down),
            (Direction::Left, Direction::Right),
        ] {
            let there = state.moved(d);
            if there.player() != state.player() && there.boxes() == state.boxes() {
                env.step(&d.to_action_text()).unwrap();
                let r = env.step(&back.to_action_text()).unwrap();
                assert_eq!(r.observation.text, start.text, "seed {seed}");
                revisits += 1;
                break;
            }
        }
    }
    assert!(revisits > 25, "only {revisits} seeds had a free walk");
}

#[test]
fn observations_render_grid_and_legend() {
    let mut env = FrozenLake::default();
    let text = env.reset(&task(0)).unwrap().text;
    let grid: Vec<&str> = text.lines().take(4).collect();
    assert!(grid.iter().all(|l| l.split(' ').count() == 4), "{text}");
    assert_eq!(
        text.matches('P').count(),
        2,
        "player once + legend once: {text}"
    );
    assert!(text.contains("Legend:") && text.contains("G = goal"));
    let mut env = Sokoban::default();
    let text = env.reset(&task(0)).unwrap().text;
    let grid: Vec<&str> = text.lines().take(6).collect();
    assert_eq!(grid[0], "# # # # # #");
    assert!(text.contains("Legend:") && text.contains("X = box"));
}
