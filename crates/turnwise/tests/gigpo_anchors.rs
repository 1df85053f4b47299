//! GiGPO's anchor-state groups on the search world (spec §3.7): the last observation is not the
//! state, so a step's anchor group is keyed by its depth and the observations before it as well
//! (`trainer::advantage::anchor_scopes`); a game's board is its whole state and groups across
//! depths. `gigpo/anchor_group/singleton_share` counts the steps after the first only.

mod common;

use turnwise::config::TrainConfig;
use turnwise::rollout::Episode;
use turnwise::trainer::Trainer;
use turnwise::trainer::advantage::{anchor_scopes, compute, rollout_of};
use turnwise_core::trajectory::TurnAction;
use turnwise_env::world::Split;

/// An action the search environment refuses: it answers with its constant invalid-action text.
const INVALID: &str = "<think>hmm</think><action>hmm</action>";

fn search(query: &str, thought: &str) -> String {
    format!("<think>{thought}</think><action><search>{query}</search></action>")
}

const ANSWER: &str = "<think>done</think><action><answer>x</answer></action>";

/// The anchor-group key of every step of `ep`: its scope (none: one scope for all steps) and
/// its anchor.
fn keys(cfg: &TrainConfig, ep: &Episode) -> Vec<(String, String)> {
    let anchors = rollout_of(ep, 0, 0.0, &[], None).anchors;
    let scopes = anchor_scopes(cfg, &anchors);
    anchors
        .into_iter()
        .enumerate()
        .map(|(k, a)| (scopes.get(k).cloned().unwrap_or_default(), a))
        .collect()
}

/// `gigpo/anchor_group/singleton_share` of `episodes` as one prompt group, through the
/// trainer's advantage computation.
fn singleton_share(cfg: &TrainConfig, episodes: &[Episode]) -> f64 {
    let n = episodes.len();
    let rows = compute(
        cfg,
        &common::scored(
            episodes,
            &vec![0; n],
            &vec![0.0; n],
            &vec![Vec::new(); n],
            None,
        ),
        None,
        None,
        None,
    )
    .unwrap();
    rows.metrics["gigpo/anchor_group/singleton_share"]
}

#[test]
fn identical_observations_at_different_depths_are_different_states() {
    let mut sets = common::tiny_overrides();
    sets.push("task.format=\"t2po\"".into());
    let cfg = TrainConfig::resolve(Some("gigpo"), None, &sets).unwrap();
    let t = Trainer::new(cfg.clone()).unwrap();
    let q = t.task.questions(Split::Train)[0];
    let play = |texts: &[String]| common::play_turns(&t, q, texts);
    // a: two refused actions, then an answer; b: a search, a refused action, an answer.
    let a = play(&[INVALID.into(), INVALID.into(), ANSWER.into()]);
    let b = play(&[search("capital", "look"), INVALID.into(), ANSWER.into()]);
    for (ep, k) in [(&a, 0), (&a, 1), (&b, 1)] {
        assert!(
            matches!(ep.trajectory.turns[k].action, TurnAction::Invalid { .. }),
            "{}: turn {k} is {:?}",
            ep.trajectory.id,
            ep.trajectory.turns[k].action
        );
    }
    let (ka, kb) = (keys(&cfg, &a), keys(&cfg, &b));
    // The same feedback text is the anchor of a's steps 1 and 2 and of b's step 2 ...
    assert_eq!(ka[1].1, ka[2].1);
    assert_eq!(ka[1].1, kb[2].1);
    assert_ne!(kb[1].1, kb[2].1, "b's search returned passages");
    // ... but they acted at different depths (a: 1 and 2) or after different observations (a's
    // step 2 after the feedback, b's after the passages): three anchor groups.
    assert_ne!(ka[1], ka[2]);
    assert_ne!(ka[2], kb[2]);
    assert_ne!(ka[1], kb[2]);
    // Step 0 (the question) is one state for both.
    assert_eq!(ka[0], kb[0]);

    // No state after the first step repeats: every later step is alone in its anchor group
    // (step 0, shared by the whole group, is not counted).
    assert_eq!(singleton_share(&cfg, &[a.clone(), b.clone()]), 1.0);

    // c repeats b's states with other words of its own (the agent's text is its action, not
    // the state): b's and c's later steps share their groups, a's stay alone.
    let c = play(&[
        search("capital", "search it"),
        INVALID.into(),
        ANSWER.into(),
    ]);
    assert_ne!(b.turn_texts[0].0, c.turn_texts[0].0);
    assert_eq!(keys(&cfg, &c), kb);
    let share = singleton_share(&cfg, &[a, b, c]);
    assert!((share - 2.0 / 6.0).abs() < 1e-12, "{share}");
}

/// A game's board is its whole state: no scope, so a board at any depth is one anchor state.
#[test]
fn a_game_board_is_one_state_at_every_depth() {
    let anchors: Vec<String> = ["b0", "b1", "b0", "b1"].map(String::from).into();
    for game in ["frozen_lake", "sokoban"] {
        let sets = [format!("task.env=\"{game}\"")];
        let cfg = TrainConfig::resolve(Some("gigpo"), None, &sets).unwrap();
        assert!(anchor_scopes(&cfg, &anchors).is_empty(), "{game}");
    }
    let cfg = TrainConfig::resolve(Some("gigpo"), None, &[]).unwrap();
    let scopes = anchor_scopes(&cfg, &anchors);
    assert_eq!(scopes.len(), 4);
    assert_ne!(scopes[1], scopes[3], "search: b1 at depths 1 and 3");
}
