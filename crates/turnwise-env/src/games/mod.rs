//! Text games for multi-turn RL: [`FrozenLake`] and [`Sokoban`], generated deterministically
//! from [`Task::seed`](crate::env::Task::seed), solvable by construction, rendered as text grids
//! with a legend, and driven by T2PO-format actions
//! `<think>…</think><action>up|down|left|right</action>` (spec §2.6).
//!
//! Both implement [`Environment`](crate::env::Environment). Observations show the grid and the
//! legend only, so revisiting a state gives the identical string (GiGPO anchors, spec §3.7).
//! An action that cannot be parsed leaves the state unchanged and sets
//! [`StepInfo::valid_action`](crate::env::StepInfo::valid_action) to `false` (the trainer
//! applies the invalid-action penalty); a move into a wall is valid and changes nothing.

mod frozen_lake;
mod sokoban;
#[cfg(test)]
mod solver_tests;

use std::fmt;

use serde_json::Value;

pub use frozen_lake::{FrozenLake, FrozenLakeConfig, FrozenLakeMap, LakeCell};
pub use sokoban::{Sokoban, SokobanConfig, SokobanState};

use crate::env::{EnvError, Task};

/// A move on a grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// One row towards the top.
    Up,
    /// One row towards the bottom.
    Down,
    /// One column to the left.
    Left,
    /// One column to the right.
    Right,
}

impl Direction {
    /// All four directions, in a fixed order.
    pub const ALL: [Direction; 4] = [
        Direction::Up,
        Direction::Down,
        Direction::Left,
        Direction::Right,
    ];

    /// `(row delta, column delta)`.
    pub fn delta(self) -> (isize, isize) {
        match self {
            Direction::Up => (-1, 0),
            Direction::Down => (1, 0),
            Direction::Left => (0, -1),
            Direction::Right => (0, 1),
        }
    }

    /// The lowercase action word (`"up"`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Up => "up",
            Direction::Down => "down",
            Direction::Left => "left",
            Direction::Right => "right",
        }
    }

    /// Parses an action word, ignoring case and surrounding whitespace.
    pub fn parse(word: &str) -> Option<Self> {
        match word.trim().to_ascii_lowercase().as_str() {
            "up" => Some(Direction::Up),
            "down" => Some(Direction::Down),
            "left" => Some(Direction::Left),
            "right" => Some(Direction::Right),
            _ => None,
        }
    }

    /// The T2PO-format text of this move, e.g. `<think>…</think><action>up</action>`.
    pub fn to_action_text(self) -> String {
        format!(
            "<think>Move {0}.</think><action>{0}</action>",
            self.as_str()
        )
    }
}

impl fmt::Display for Direction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A policy turn parsed for a game.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedAction {
    /// The move, when the first `<action>…</action>` block holds a direction word.
    pub direction: Option<Direction>,
    /// Whether the text passes the strict T2PO format check.
    pub format_ok: bool,
    /// What is wrong, when `direction` is `None` or `format_ok` is `false`.
    pub problem: Option<String>,
}

fn is_cjk(c: char) -> bool {
    ('\u{4e00}'..='\u{9fff}').contains(&c)
}

/// Parses a T2PO-format turn (spec §2.6).
///
/// The relaxed parser takes the first `<action>…</action>` block and accepts its content if it
/// is one of `up`, `down`, `left`, `right` (any case, surrounding whitespace ignored). The strict
/// check additionally requires the whole text to be `<think>…</think><action>…</action>` (only
/// whitespace around and between the two blocks), each of the four tags exactly once, and no CJK
/// characters (verl-agent's "non-target-language" rule).
pub fn parse_action(text: &str) -> ParsedAction {
    let relaxed = text.find("<action>").and_then(|open| {
        let start = open + "<action>".len();
        text[start..]
            .find("</action>")
            .map(|len| &text[start..start + len])
    });
    let (direction, mut problem) = match relaxed {
        None => (None, Some("no <action>…</action> block".to_owned())),
        Some(content) => match Direction::parse(content) {
            Some(d) => (Some(d), None),
            None => (
                None,
                Some(format!(
                    "action {:?} is not one of up, down, left, right",
                    content.trim()
                )),
            ),
        },
    };
    let strict = strict_problem(text);
    if problem.is_none() {
        problem = strict.clone();
    }
    ParsedAction {
        direction,
        format_ok: direction.is_some() && strict.is_none(),
        problem,
    }
}

/// Why `text` fails the strict `<think>…</think><action>…</action>` check, if it does.
fn strict_problem(text: &str) -> Option<String> {
    for tag in ["<think>", "</think>", "<action>", "</action>"] {
        let n = text.matches(tag).count();
        if n != 1 {
            return Some(format!("tag {tag} appears {n} times, expected once"));
        }
    }
    let trimmed = text.trim();
    let think_end = trimmed.find("</think>").unwrap_or(0);
    let action_start = trimmed.find("<action>").unwrap_or(0);
    if !trimmed.starts_with("<think>")
        || !trimmed.ends_with("</action>")
        || action_start < think_end
        || !trimmed[think_end + "</think>".len()..action_start]
            .trim()
            .is_empty()
    {
        return Some("expected exactly <think>…</think><action>…</action>".to_owned());
    }
    if text.chars().any(is_cjk) {
        return Some("text contains CJK characters".to_owned());
    }
    None
}

/// Reads an optional unsigned integer from `task.params[key]`.
fn param_usize(task: &Task, env: &str, key: &str) -> Result<Option<usize>, EnvError> {
    match task.params.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(|n| Some(n as usize))
            .ok_or_else(|| EnvError::BadTask {
                env: env.to_owned(),
                field: format!("params.{key}"),
                message: format!("must be a non-negative integer, got {v}"),
            }),
    }
}

/// Reads an optional number from `task.params[key]`.
fn param_f64(task: &Task, env: &str, key: &str) -> Result<Option<f64>, EnvError> {
    match task.params.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_f64().map(Some).ok_or_else(|| EnvError::BadTask {
            env: env.to_owned(),
            field: format!("params.{key}"),
            message: format!("must be a number, got {v}"),
        }),
    }
}

/// A [`EnvError::BadTask`] for a config field.
fn bad_config(env: &str, field: &str, message: String) -> EnvError {
    EnvError::BadTask {
        env: env.to_owned(),
        field: field.to_owned(),
        message,
    }
}

/// Moves `(row, col)` one step in `d` inside a `rows × cols` grid.
fn step_in(pos: (usize, usize), d: Direction, rows: usize, cols: usize) -> Option<(usize, usize)> {
    let (dr, dc) = d.delta();
    let r = pos.0.checked_add_signed(dr)?;
    let c = pos.1.checked_add_signed(dc)?;
    (r < rows && c < cols).then_some((r, c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strict_and_relaxed_parsing() {
        let p = parse_action("<think>go</think><action>up</action>");
        assert_eq!(
            (p.direction, p.format_ok, p.problem),
            (Some(Direction::Up), true, None)
        );
        let p = parse_action("  <think>a\nb</think>\n<action> Left </action>\n");
        assert_eq!((p.direction, p.format_ok), (Some(Direction::Left), true));
        // Relaxed: valid move, but no think block.
        let p = parse_action("I will go <action>down</action>");
        assert_eq!((p.direction, p.format_ok), (Some(Direction::Down), false));
        assert!(p.problem.unwrap().contains("<think>"));
        // Two action blocks: the first counts, format fails.
        let p = parse_action("<think>x</think><action>right</action><action>up</action>");
        assert_eq!((p.direction, p.format_ok), (Some(Direction::Right), false));
        let p = parse_action("<think>x</think><action>jump</action>");
        assert_eq!((p.direction, p.format_ok), (None, false));
        assert!(p.problem.unwrap().contains("jump"));
        let p = parse_action("<think>x</think>");
        assert_eq!(p.direction, None);
        let p = parse_action("<think>向上</think><action>up</action>");
        assert_eq!((p.direction, p.format_ok), (Some(Direction::Up), false));
        let p = parse_action("<action>up</action><think>x</think>");
        assert!(!p.format_ok);
        for d in Direction::ALL {
            let p = parse_action(&d.to_action_text());
            assert_eq!((p.direction, p.format_ok), (Some(d), true));
        }
    }
}
