//! The text games through the command line and the trainer (`task.env = "frozen_lake" |
//! "sokoban"`): a tiny GiGPO run warm-starts on the solver's demonstrations, trains, evaluates
//! (success rate, steps to success, invalid-action rate) and reports; `turnwise eval` reads the
//! run back; and on a game's rollout batch GiGPO's anchor-state groups hold more than one step.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Output;

use turnwise::config::TrainConfig;
use turnwise::trainer::Trainer;
use turnwise::trainer::advantage::rollout_of;

/// Overrides that shrink a game run to seconds.
fn tiny_game(env: &str) -> Vec<String> {
    let mut sets: Vec<String> = [
        "task.game.train=12",
        "task.game.validation=3",
        "task.game.test=3",
        "model.hidden_size=32",
        "model.num_layers=2",
        "model.num_heads=4",
        "model.num_kv_heads=2",
        "model.intermediate_size=64",
        "sft.steps=3",
        "sft.batch_size=4",
        "rollout.prompts_per_step=2",
        "rollout.group_size=4",
        "rollout.max_turn_tokens=16",
        "rollout.max_response_tokens=200",
        "optim.mini_batch_size=0",
        "run.steps=2",
        "eval.questions=3",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    sets.push(format!("task.env=\"{env}\""));
    // Sokoban's generated rooms need longer solutions than FrozenLake's small lakes.
    sets.push(match env {
        "sokoban" => "task.max_turns=20".into(),
        _ => "task.max_turns=6".into(),
    });
    sets
}

fn turnwise(args: &[String], cwd: &Path) -> Output {
    common::turnwise_in(args, cwd)
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `turnwise train --preset gigpo --set task.env=<env> …`, then `turnwise eval --run`.
fn trains_and_evaluates_through_the_cli(env: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let mut args: Vec<String> = ["train", "--preset", "gigpo", "--out", "run"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    for s in tiny_game(env) {
        args.extend(["--set".to_string(), s]);
    }
    let out = turnwise(&args, tmp.path());
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}\n{}", stdout, text(&out.stderr));
    // Eval lines before and after RL, on both held-out splits, with the game's figures.
    for when in ["before RL", "after RL"] {
        for split in ["validation", "test"] {
            assert!(
                stdout.lines().any(|l| l.starts_with(when)
                    && l.contains(split)
                    && l.contains("| success ")
                    && l.contains("steps to success")
                    && l.contains("invalid actions")),
                "no {when} {split} line:\n{stdout}"
            );
        }
    }
    // The RL step lines (logged on stderr off a terminal) and the closing summary name the
    // success rate, not EM.
    let stderr = text(&out.stderr);
    assert!(
        stderr
            .lines()
            .any(|l| l.contains("rl    1/2") && l.contains(" success ") && l.contains(" invalid ")),
        "{stderr}"
    );
    assert!(
        stdout.lines().any(|l| l.starts_with("test success (n=3)")),
        "{stdout}"
    );
    let run = tmp.path().join("run");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap()).unwrap();
    for key in ["before_greedy", "after_greedy", "after_sampled"] {
        let r = &summary[key];
        assert_eq!(
            (r["split"].as_str(), r["n"].as_u64()),
            (Some("test"), Some(3))
        );
        assert_game_figures(r);
    }
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    assert!(metrics.contains("eval/test/greedy/invalid_actions"));
    assert!(metrics.contains("eval/test/sampled/steps_to_success"));
    assert!(metrics.contains("\"train/invalid_actions\""));
    assert!(metrics.contains("gigpo/anchor_group/singleton_share"));
    for search_only in ["/f1\"", "/sub_em\"", "/answered\"", "tool_calls", "/em/hop"] {
        assert!(!metrics.contains(search_only), "{search_only} logged");
    }
    // report.md: the evaluation tables show success, steps to success and invalid actions,
    // and no search column; the main table the training success and invalid-action rates.
    let report = std::fs::read_to_string(run.join("report.md")).unwrap();
    assert!(
        report.contains(
            "| step | n | success | success_se | steps_to_success | invalid_actions | format_ok |"
        ),
        "{report}"
    );
    assert!(report.contains("Success "), "{report}");
    assert!(report.contains("| train success |"), "{report}");
    assert!(report.contains("| train invalid actions |"), "{report}");
    for search_only in [
        "| em |",
        "| f1 |",
        "sub_em",
        "answered",
        "tool_calls",
        "-hop",
        "| train EM |",
    ] {
        assert!(
            !report.contains(search_only),
            "{search_only} in the report:\n{report}"
        );
    }

    // `turnwise eval` reads the run's task back: the same game, held-out maps.
    let args: Vec<String> = ["eval", "--run", "run", "--questions", "2"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let out = turnwise(&args, tmp.path());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let r: serde_json::Value = serde_json::from_str(&text(&out.stdout)).unwrap();
    assert_eq!(
        (r["split"].as_str(), r["n"].as_u64()),
        (Some("test"), Some(2))
    );
    assert_game_figures(&r);
}

/// A game's evaluation as JSON (summary.json, `turnwise eval`): the success rate, steps to
/// success and the invalid-action rate, and none of the search task's figures.
fn assert_game_figures(r: &serde_json::Value) {
    let rate = |k: &str| {
        let v = r[k].as_f64().unwrap_or_else(|| panic!("no {k} in {r}"));
        assert!((0.0..=1.0).contains(&v), "{k} = {v}");
    };
    rate("success");
    rate("success_se");
    rate("invalid_actions");
    rate("format_ok");
    assert!(r["steps_to_success"].as_f64().is_some(), "{r}");
    for search_only in [
        "em",
        "em_se",
        "f1",
        "sub_em",
        "answered",
        "tool_calls",
        "em_by_hops",
    ] {
        assert!(r.get(search_only).is_none(), "{search_only} in {r}");
    }
}

#[test]
fn frozen_lake_trains_and_evaluates_through_the_cli() {
    trains_and_evaluates_through_the_cli("frozen_lake");
}

#[test]
fn sokoban_trains_and_evaluates_through_the_cli() {
    trains_and_evaluates_through_the_cli("sokoban");
}

/// Per prompt group, the sizes of the anchor-state groups of the steps after the first (the
/// first step's anchor, the map's starting board, is shared by the whole group).
fn later_step_anchor_groups(t: &mut Trainer) -> Vec<usize> {
    let batch = t.generate_round(&[0, 1, 2], 0, 0).unwrap();
    let mut sizes: BTreeMap<(usize, String), usize> = BTreeMap::new();
    for e in &batch.episodes {
        let r = rollout_of(&e.episode, e.group, e.score, &[], None);
        for a in r.anchors.iter().skip(1).filter(|a| !a.is_empty()) {
            *sizes.entry((e.group, a.clone())).or_default() += 1;
        }
    }
    sizes.into_values().collect()
}

#[test]
fn game_rollouts_share_anchor_states() {
    let mut sets = tiny_game("frozen_lake");
    sets.push("sft.steps=20".into());
    let cfg = TrainConfig::resolve(Some("gigpo"), None, &sets).unwrap();
    let mut t = Trainer::new(cfg).unwrap();
    t.warm_start(&mut |_, _, _| {}).unwrap();
    let sizes = later_step_anchor_groups(&mut t);
    assert!(!sizes.is_empty(), "no step after the first");
    let shared: usize = sizes.iter().filter(|&&n| n > 1).sum();
    let steps: usize = sizes.iter().sum();
    // Rollouts of one map revisit its states (moves back, blocked and invalid moves), so a
    // share of the later steps falls in anchor groups of two or more.
    assert!(
        sizes.iter().any(|&n| n > 1),
        "every later step is alone in its anchor group: {sizes:?}"
    );
    assert!(
        shared * 4 >= steps,
        "{shared} of {steps} later steps share an anchor"
    );
}

/// The first training map whose shortest solution has a length passing `fits`, with its
/// question.
fn train_map(
    t: &Trainer,
    fits: impl Fn(usize) -> bool,
) -> (&turnwise::task::games::GameMap, &turnwise::task::QaItem) {
    let split = turnwise_env::world::Split::Train;
    let maps = t.task.game.as_ref().expect("a game task").maps(split);
    let k = maps.iter().position(|m| fits(m.solution.len())).unwrap();
    (&maps[k], t.task.questions(split)[k])
}

fn play(t: &Trainer, q: &turnwise::task::QaItem, texts: &[String]) -> turnwise::rollout::Episode {
    common::play_turns(t, q, texts)
}

/// GiGPO's anchor of a step is the state the agent acted in (spec §3.7), step 0 included: a
/// game's step 0 is anchored by the starting board, so a later step back on it (after a move
/// the game could not parse) joins the anchor group of the map's first steps; the search
/// world's step 0 stays anchored by its prompt.
#[test]
fn a_later_step_on_the_starting_board_shares_step_zeros_anchor_group() {
    use turnwise::trainer::advantage::compute;
    use turnwise_env::world::Split;

    let cfg = TrainConfig::resolve(Some("gigpo"), None, &tiny_game("frozen_lake")).unwrap();
    let t = Trainer::new(cfg.clone()).unwrap();
    let (map, q) = train_map(&t, |n| (2..6).contains(&n));
    let solution: Vec<String> = map.solution.iter().map(|d| d.to_action_text()).collect();
    let mut detour = vec!["<think>goal</think><action>goal</action>".to_string()];
    detour.extend(solution.iter().cloned());
    // Two rollouts of the map: the solver's moves, and one unparsable turn first.
    let episodes = vec![play(&t, q, &solution), play(&t, q, &detour)];
    let anchors: Vec<Vec<String>> = episodes
        .iter()
        .map(|ep| rollout_of(ep, 0, ep.env_return, &[], None).anchors)
        .collect();
    assert_eq!(anchors[0][0], map.board);
    assert_eq!(anchors[1][0], map.board);
    assert_eq!(
        anchors[1][1], map.board,
        "the unparsable turn left the board"
    );
    assert_ne!(anchors[0][1], map.board, "the first move changed the board");
    // Through the trainer's estimator: every step shares its anchor group with a step of the
    // other rollout (the detour's step 1 with both step 0s), none is alone.
    let n = episodes.len();
    let scores: Vec<f64> = episodes.iter().map(|e| e.env_return).collect();
    let rows = compute(
        &cfg,
        &common::scored(&episodes, &vec![0; n], &scores, &vec![Vec::new(); n], None),
        None,
        None,
        None,
    )
    .unwrap();
    assert_eq!(rows.metrics["gigpo/anchor_group/singleton_share"], 0.0);

    // The search world: step 0's state is the question, anchored by the prompt; step 1 by the
    // observation of step 0.
    let mut sets = common::tiny_overrides();
    sets.push("task.format=\"t2po\"".into());
    let t = Trainer::new(TrainConfig::resolve(Some("gigpo"), None, &sets).unwrap()).unwrap();
    let q = t.task.questions(Split::Train)[0];
    let ep = play(
        &t,
        q,
        &[
            "<think>look</think><action><search>capital</search></action>".into(),
            "<think>done</think><action><answer>x</answer></action>".into(),
        ],
    );
    let anchors = rollout_of(&ep, 0, 0.0, &[], None).anchors;
    assert_eq!(anchors[0], format!("prompt:{}", q.id));
    assert_eq!(Some(&anchors[1]), ep.turn_texts[0].1.as_ref());
}

/// The solver's moves played through the rollout's episode bookkeeping: a won episode of
/// valid moves (recorded as moves, not invalid turns), scored 1 by the game's reward, with no
/// GiGPO invalid-action penalty; an unparsable turn is the one penalised.
#[test]
fn solver_moves_through_the_rollout_are_valid_and_win() {
    use turnwise_core::trajectory::TurnAction;

    let cfg = TrainConfig::resolve(Some("gigpo"), None, &tiny_game("frozen_lake")).unwrap();
    let t = Trainer::new(cfg.clone()).unwrap();
    // A map with room for one wasted turn within task.max_turns = 6.
    let (map, q) = train_map(&t, |n| n < 6);
    let play = |texts: &[String]| play(&t, q, texts);
    let penalised = |ep: &turnwise::rollout::Episode| {
        let out = t.task.score_episode(&cfg.reward, ep, &[]).unwrap();
        let mut r = rollout_of(ep, 0, out.score, &out.turn_rewards, None);
        turnwise::trainer::advantage::place_rewards(&cfg, ep, &mut r).unwrap()
    };

    let mut moves: Vec<String> = map.solution.iter().map(|d| d.to_action_text()).collect();
    let ep = play(&moves);
    assert!(ep.won && ep.env_return == 1.0, "{}", ep.response_text());
    assert_eq!(ep.trajectory.turns.len(), map.solution.len());
    for (turn, d) in ep.trajectory.turns.iter().zip(&map.solution) {
        assert_eq!(
            turn.action,
            TurnAction::Move {
                action: d.as_str().into()
            }
        );
    }
    assert_eq!(t.task.score_episode(&cfg.reward, &ep, &[]).unwrap().em, 1.0);
    assert_eq!(penalised(&ep), 0);

    // One unparsable turn first: the state is unchanged, the turn is invalid and penalised.
    moves.insert(0, "<think>goal</think><action>goal</action>".into());
    let ep = play(&moves);
    assert!(ep.won);
    assert!(matches!(
        ep.trajectory.turns[0].action,
        TurnAction::Invalid { .. }
    ));
    assert_eq!(penalised(&ep), 1);
}
