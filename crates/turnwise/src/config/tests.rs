use super::*;
use turnwise_core::advantage::Estimator;

#[test]
fn every_preset_resolves_and_validates() {
    for name in presets::names() {
        let cfg = TrainConfig::resolve(Some(name), None, &[])
            .unwrap_or_else(|e| panic!("preset {name}: {e}"));
        assert!(
            !cfg.description.is_empty(),
            "preset {name} has no description"
        );
        let (method, what) = presets::summary(name).unwrap();
        assert!(!method.is_empty() && !what.is_empty(), "preset {name}");
    }
}

/// Every file of the repository's `presets/` folder is a preset under its file stem, and
/// nothing else is: the list is found, not written by hand.
#[test]
fn the_presets_are_the_files_of_the_presets_folder() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../presets");
    let mut files: Vec<(String, String)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .map(|p| {
            let name = p.file_stem().unwrap().to_str().unwrap().to_string();
            (name, std::fs::read_to_string(&p).unwrap())
        })
        .collect();
    files.sort();
    let embedded: Vec<(String, String)> = presets::PRESETS
        .iter()
        .map(|(n, t)| (n.to_string(), t.to_string()))
        .collect();
    assert_eq!(embedded, files);
}

/// A preset's listing keys (`method`, `summary`) describe it and configure nothing: a preset
/// file copied as a config file resolves to the preset's own config.
#[test]
fn a_preset_file_used_as_a_config_file_reads_as_the_preset() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("grpo.toml");
    std::fs::write(&path, presets::get("grpo").unwrap()).unwrap();
    let from_file = TrainConfig::resolve(Some("grpo"), Some(&path), &[]).unwrap();
    assert_eq!(
        from_file,
        TrainConfig::resolve(Some("grpo"), None, &[]).unwrap()
    );
}

/// Every preset cites its papers in full ("Title. Authors (year). arXiv:id", or anonymous
/// authors under review), and README's table of papers has every arXiv id a preset cites, with
/// its link.
#[test]
fn every_preset_cites_its_papers_as_readme_does() {
    let readme = include_str!("../../../../README.md");
    for name in presets::names() {
        let cfg = TrainConfig::resolve(Some(name), None, &[]).unwrap();
        assert!(!cfg.papers.is_empty(), "preset {name} cites no paper");
        for paper in &cfg.papers {
            let (title, rest) = paper
                .split_once(". ")
                .unwrap_or_else(|| panic!("preset {name}: {paper:?} has no title"));
            assert!(title.len() > 10, "preset {name}: title {title:?}");
            match rest.split_once("arXiv:") {
                Some((_, id)) => {
                    let id = id.trim();
                    assert!(
                        id.len() == 10 && id.as_bytes()[4] == b'.',
                        "preset {name}: arXiv id {id:?}"
                    );
                    assert!(
                        readme.contains(&format!("[{id}](https://arxiv.org/abs/{id})")),
                        "README's table of papers lacks arXiv {id} (preset {name})"
                    );
                    assert!(
                        readme.contains(title),
                        "README's table of papers lacks {title:?} (preset {name})"
                    );
                }
                None => assert!(
                    rest.starts_with("Anonymous authors"),
                    "preset {name}: {paper:?} names neither an arXiv id nor anonymous authors"
                ),
            }
        }
    }
    let e = TrainConfig::resolve(Some("grpo"), None, &["papers=[]".into()]).unwrap_err();
    assert!(e.to_string().contains("read-only"), "{e}");
}

#[test]
fn overrides_apply_with_toml_types() {
    let cfg = TrainConfig::resolve(
        Some("grpo"),
        None,
        &[
            "rollout.group_size=4".into(),
            "optim.lr=1e-4".into(),
            "rollout.info_gain=false".into(),
            "task.world.questions.hop_weights=[1.0, 0.0, 0.0, 0.0]".into(),
            "model.init_from=/tmp/some model".into(),
        ],
    )
    .unwrap();
    assert_eq!(cfg.rollout.group_size, 4);
    assert_eq!(cfg.optim.lr, 1e-4);
    assert_eq!(cfg.task.world.questions.hop_weights, [1.0, 0.0, 0.0, 0.0]);
    assert_eq!(
        cfg.model.init_from.as_deref(),
        Some(std::path::Path::new("/tmp/some model"))
    );
}

#[test]
fn unknown_fields_are_rejected_with_their_path() {
    let e = TrainConfig::resolve(Some("grpo"), None, &["rollout.group_sise=4".into()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("rollout") && e.contains("group_sise"), "{e}");
    let e = TrainConfig::resolve(Some("a2tgpo"), None, &["advantage.clip_betta=0.1".into()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("advantage") && e.contains("clip_betta"), "{e}");
}

#[test]
fn ill_typed_fields_are_rejected_with_their_path() {
    let e = TrainConfig::resolve(Some("grpo"), None, &["rollout.group_size=\"eight\"".into()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("rollout.group_size"), "{e}");
    let e = TrainConfig::resolve(Some("grpo"), None, &["optim.lr=-1".into()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("optim.lr"), "{e}");
}

#[test]
fn malformed_overrides_and_unknown_presets_are_explained() {
    let e = TrainConfig::resolve(Some("grpo"), None, &["rollout.group_size".into()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("key=value"), "{e}");
    let e = TrainConfig::resolve(Some("grpoo"), None, &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown preset") && e.contains("a2tgpo"), "{e}");
}

#[test]
fn init_from_is_not_empty_and_lora_rank_fits_the_model() {
    let err = TrainConfig::resolve(Some("grpo"), None, &["model.init_from=\"\"".into()])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.init_from") && err.contains("is empty"),
        "{err}"
    );
    // A path that does not exist resolves (configs are written for other machines too); it
    // is refused before a run starts and by `turnwise config` (tests/cli.rs).
    // The review's rank 100000 on a hidden size of 32.
    let base = TrainConfig::resolve(Some("grpo"), None, &[]).unwrap();
    let err = TrainConfig::resolve(Some("grpo"), None, &["model.lora.rank=100000".into()])
        .unwrap_err()
        .to_string();
    assert!(err.contains("model.lora.rank"), "{err}");
    let ok = format!(
        "model.lora.rank={}",
        base.model.hidden_size.min(base.model.intermediate_size)
    );
    TrainConfig::resolve(Some("grpo"), None, &[ok]).unwrap();
}

#[test]
fn inline_tables_merge_and_the_preset_is_read_only() {
    // `optim={lr=1e-4}` sets lr and keeps the preset's other optimizer settings (the review's
    // grpo lost its mini_batch_size = 64 this way).
    let base = TrainConfig::resolve(Some("grpo"), None, &[]).unwrap();
    let c = TrainConfig::resolve(Some("grpo"), None, &["optim={lr=1e-4}".into()]).unwrap();
    assert_eq!(c.optim.lr, 1e-4);
    assert_eq!(c.optim.mini_batch_size, base.optim.mini_batch_size);
    assert!(base.optim.mini_batch_size > 0);
    for arg in ["preset=\"a2tgpo\"", "description=\"x\""] {
        let err = TrainConfig::resolve(Some("grpo"), None, &[arg.into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("read-only"), "{arg}: {err}");
    }
}

#[test]
fn switching_the_estimator_drops_the_old_settings() {
    // `epsilon` belongs to grpo; rloo has no such field and would reject it.
    let cfg = TrainConfig::resolve(
        Some("grpo"),
        None,
        &[
            "advantage.epsilon=1e-4".into(),
            "advantage.estimator=\"rloo\"".into(),
        ],
    )
    .unwrap();
    assert_eq!(
        turnwise_core::advantage::Estimator::name(&cfg.advantage),
        "rloo"
    );
}

#[test]
fn inconsistent_settings_name_the_field_to_change() {
    let e = TrainConfig::resolve(Some("a2tgpo"), None, &["rollout.info_gain=false".into()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("rollout.info_gain"), "{e}");
    let e = TrainConfig::resolve(Some("ppo"), None, &["critic.enabled=false".into()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("critic.enabled"), "{e}");
}

#[test]
fn a_config_file_layers_between_preset_and_overrides() {
    let dir = std::env::temp_dir().join(format!("turnwise-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("my.toml");
    std::fs::write(&path, "seed = 7\n[rollout]\ngroup_size = 5\n").unwrap();
    let cfg =
        TrainConfig::resolve(Some("grpo"), Some(&path), &["rollout.group_size=6".into()]).unwrap();
    assert_eq!(cfg.seed, 7);
    assert_eq!(cfg.rollout.group_size, 6);
    std::fs::write(&path, "seed = \n").unwrap();
    let e = TrainConfig::resolve(Some("grpo"), Some(&path), &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("my.toml"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_resolved_config_round_trips_through_toml() {
    let cfg = TrainConfig::resolve(Some("at2po"), None, &[]).unwrap();
    let text = cfg.to_toml();
    let back = TrainConfig::from_table(text.parse().unwrap()).unwrap();
    assert_eq!(cfg, back);
}

#[test]
fn rl_subject_fraction_is_checked() {
    for bad in ["1.0", "-0.1", "nan"] {
        let e = TrainConfig::resolve(
            Some("grpo"),
            None,
            &[format!("task.rl_subject_fraction={bad}")],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("task.rl_subject_fraction"), "{bad}: {e}");
    }
    let c =
        TrainConfig::resolve(Some("grpo"), None, &["task.rl_subject_fraction=0.3".into()]).unwrap();
    assert_eq!(c.task.rl_subject_fraction, 0.3);
}

/// A loss defined by its clip is refused in an on-policy update (every ratio is 1 there), with
/// the field to change; every preset's own structure passes and has off-policy steps when its
/// loss needs them.
#[test]
fn clip_losses_need_off_policy_updates() {
    let err = TrainConfig::resolve(Some("gspo"), None, &["optim.mini_batch_size=0".to_string()])
        .unwrap_err()
        .to_string();
    assert!(err.contains("optim.mini_batch_size"), "{err}");
    assert!(
        TrainConfig::resolve(
            Some("gspo"),
            None,
            &[
                "optim.mini_batch_size=0".to_string(),
                "optim.ppo_epochs=2".to_string()
            ]
        )
        .is_ok()
    );
    for name in presets::names() {
        let cfg = TrainConfig::resolve(Some(name), None, &[]).unwrap();
        let (steps, off) = cfg.update_structure();
        let loss = cfg.actor.policy.resolve().unwrap().kind;
        if loss.defined_by_clip() {
            assert!(off > 0, "{name}: {steps} steps, none off-policy");
        }
        assert!(
            cfg.description.contains("Update:"),
            "{name}: the description does not state its update structure"
        );
    }
    // The papers' structures, scaled to 16 prompts × 8 rollouts.
    let steps = |n: &str| {
        TrainConfig::resolve(Some(n), None, &[])
            .unwrap()
            .update_structure()
    };
    assert_eq!(steps("a2tgpo"), (8, 7));
    assert_eq!(steps("at2po"), (8, 7));
    assert_eq!(steps("st-ppo"), (2, 1));
    assert_eq!(steps("mt-grpo"), (2, 1));
    assert_eq!(steps("igpo"), (1, 0));
    // verl-agent's step samples: at least 128/51 and 128/26 optimizer steps (one step per
    // rollout), K̂ times as many with K̂ steps per rollout.
    assert_eq!(steps("gigpo"), (3, 2));
    assert_eq!(steps("t2po"), (5, 4));
}

#[test]
fn tree_group_size_must_match_the_tree_shape() {
    // at2po: N = M + L·K = 2 + 2·3 = 8 leaves per prompt.
    let cfg = TrainConfig::resolve(Some("at2po"), None, &[]).unwrap();
    assert_eq!(cfg.rollout.tree_leaves_per_prompt(), Some(8));
    assert_eq!(cfg.rollout.group_size, 8);
    let e = TrainConfig::resolve(Some("at2po"), None, &["rollout.group_size=4".into()])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rollout.group_size (4)")
            && e.contains("rollout.tree_forks")
            && e.contains("= 8"),
        "{e}"
    );
    // Changing the shape and the group size together is fine (the README example).
    let cfg = TrainConfig::resolve(
        Some("at2po"),
        None,
        &["rollout.tree_forks=2".into(), "rollout.group_size=6".into()],
    )
    .unwrap();
    assert_eq!(cfg.rollout.tree_leaves_per_prompt(), Some(6));
    // tree-grpo: m·k = 2·3.
    let cfg = TrainConfig::resolve(Some("tree-grpo"), None, &[]).unwrap();
    assert_eq!(
        (
            cfg.rollout.tree_count,
            cfg.rollout.tree_leaves,
            cfg.rollout.group_size
        ),
        (2, Some(3), 6)
    );
    let e = TrainConfig::resolve(Some("tree-grpo"), None, &["rollout.tree_count=3".into()])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rollout.group_size (6)")
            && e.contains("rollout.tree_count (3)")
            && e.contains("rollout.tree_leaves (3)"),
        "{e}"
    );
    // k cannot exceed the leaves a tree grows (1 + 1·2 = 3).
    let e = TrainConfig::resolve(
        Some("tree-grpo"),
        None,
        &[
            "rollout.tree_leaves=4".into(),
            "rollout.group_size=8".into(),
        ],
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("rollout.tree_leaves") && e.contains("3 leaves"),
        "{e}"
    );
    // Chains ignore the tree shape.
    let cfg = TrainConfig::resolve(Some("grpo"), None, &["rollout.group_size=3".into()]).unwrap();
    assert_eq!(cfg.rollout.tree_leaves_per_prompt(), None);
}

#[test]
fn branch_penalty_default_follows_the_spec() {
    assert_eq!(
        RolloutConfig::default().tree_branch_penalty,
        turnwise_core::control::tree_expansion::AT2PO_BRANCH_PENALTY
    );
    assert_eq!(RolloutConfig::default().tree_branch_penalty, 0.05);
    // The default shape agrees with the default group size, so switching a chain config to
    // trees needs no other change.
    let d = RolloutConfig::default();
    assert_eq!(d.tree_count * d.leaves_per_tree(), d.group_size);
}

/// Each preset's reward is the one spec §10 names, in an agent format it can read; a reward
/// that cannot read `task.format` is refused, naming the field.
#[test]
fn preset_rewards_match_their_agent_format() {
    for (preset, reward, format) in [
        ("a2tgpo", "boxed_em", AgentFormatName::Boxed),
        ("at2po", "boxed_em", AgentFormatName::Boxed),
        ("grpo", "boxed_em", AgentFormatName::Boxed),
        ("gspo", "boxed_em", AgentFormatName::Boxed),
        ("dapo", "boxed_em", AgentFormatName::Boxed),
        ("igpo", "igpo_f1", AgentFormatName::SearchR1),
        ("tree-grpo", "search_r1_format", AgentFormatName::SearchR1),
        ("t2po", "t2po_em", AgentFormatName::T2po),
        ("mt-ppo", "mt_ppo_turn", AgentFormatName::SearchR1),
    ] {
        let cfg = TrainConfig::resolve(Some(preset), None, &[]).unwrap();
        assert_eq!(
            (cfg.reward.name(), cfg.task.format),
            (reward, format),
            "{preset}"
        );
    }
    for (preset, set) in [
        ("grpo", "task.format=\"search_r1\""),
        ("igpo", "task.format=\"boxed\""),
        ("tree-grpo", "task.format=\"t2po\""),
        ("t2po", "task.format=\"search_r1\""),
    ] {
        let e = TrainConfig::resolve(Some(preset), None, &[set.into()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("reward") && e.contains("task.format"),
            "{preset}: {e}"
        );
    }
    // em reads the format it is told; the plain answer block serves Search-R1 and T2PO.
    TrainConfig::resolve(
        Some("grpo"),
        None,
        &["reward={name=\"em\", format=\"boxed\"}".into()],
    )
    .unwrap();
    TrainConfig::resolve(Some("gigpo"), None, &["task.format=\"t2po\"".into()]).unwrap();
}

#[test]
fn runs_record_their_preset_and_quickstart_is_one() {
    for name in presets::names() {
        let cfg = TrainConfig::resolve(Some(name), None, &[]).unwrap();
        assert_eq!(cfg.preset, name);
    }
    let q = TrainConfig::resolve(Some(presets::QUICKSTART), None, &[]).unwrap();
    assert_eq!(q.preset, "quickstart");
    assert_eq!(q.sft.steps, 1100);
    assert_eq!(
        q.advantage,
        TrainConfig::resolve(Some("a2tgpo"), None, &[])
            .unwrap()
            .advantage
    );
    // An override may not relabel it (a grpo config labelled a2tgpo misleads `runs` and
    // `compare`); a config file that names its own preset still may.
    assert!(TrainConfig::resolve(Some("grpo"), None, &["preset=\"mine\"".into()]).is_err());
    let e = TrainConfig::resolve(Some("quickstrat"), None, &[]).unwrap_err();
    assert!(e.to_string().contains("quickstart"), "{e}");
}

#[test]
fn paths_are_stored_absolute_relative_to_their_config_file() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("exp").join("run.toml");
    std::fs::create_dir_all(file.parent().unwrap()).unwrap();
    std::fs::write(
        &file,
        "[model]\ninit_from = \"../models/warm\"\n[sft]\ndemonstrations = \"/abs/demos.jsonl\"\n",
    )
    .unwrap();
    let cfg = TrainConfig::resolve(Some("grpo"), Some(&file), &[]).unwrap();
    let init = cfg.model.init_from.unwrap();
    assert!(init.is_absolute(), "{}", init.display());
    assert_eq!(
        init,
        std::path::absolute(tmp.path().join("exp/../models/warm")).unwrap()
    );
    assert_eq!(
        cfg.sft.demonstrations.as_deref(),
        Some(Path::new("/abs/demos.jsonl"))
    );
    // `--set` paths are relative to the working directory.
    let cfg =
        TrainConfig::resolve(Some("grpo"), None, &["model.init_from=\"models/x\"".into()]).unwrap();
    assert_eq!(
        cfg.model.init_from.unwrap(),
        std::env::current_dir().unwrap().join("models/x")
    );
}

#[test]
fn numeric_settings_are_range_checked_under_their_key() {
    let cases = [
        ("optim.beta1=1.5", "optim.beta1"),
        ("optim.beta2=-0.1", "optim.beta2"),
        ("optim.weight_decay=-1", "optim.weight_decay"),
        ("optim.max_bad_updates=0", "optim.max_bad_updates"),
        ("critic.lr=-1", "critic.lr"),
        ("critic.lr=nan", "critic.lr"),
        ("critic.cliprange_value=0", "critic.cliprange_value"),
        ("critic.weight_decay=-0.5", "critic.weight_decay"),
        ("sft.lr=-1", "sft.lr"),
        ("sft.lr=nan", "sft.lr"),
        ("sft.min_lr_ratio=-5", "sft.min_lr_ratio"),
        ("rsft.lr=0", "rsft.lr"),
        (
            "rollout.tree_branch_penalty=-1",
            "rollout.tree_branch_penalty",
        ),
        ("model.hidden_size=0", "model.hidden_size"),
        (
            "model.max_position_embeddings=16",
            "model.max_position_embeddings",
        ),
        ("task.topk=100000", "task.topk"),
        ("task.max_observation_words=0", "task.max_observation_words"),
        ("eval.questions=0", "eval.questions"),
        ("run.keep_checkpoints=0", "run.keep_checkpoints"),
        (
            "advantage.estimator=\"gae\"\ncritic.enabled=true\nadvantage.gamma=2",
            "advantage.gamma",
        ),
        ("advantage.epsilon=-1", "advantage.epsilon"),
        ("advantage.epsilon=0", "advantage.epsilon"),
        ("actor.kl_loss_coef=-1", "actor.kl_loss_coef"),
        ("actor.entropy_coeff=nan", "actor.entropy_coeff"),
        ("actor.policy.clip_ratio_c=0.5", "actor.policy.clip_ratio_c"),
        ("algorithm.kl_ctrl.kl_coef=-1", "algorithm.kl_ctrl.kl_coef"),
        ("optim.lr=inf", "optim.lr"),
        (
            "task.world.persons=0",
            "task.world.countries/companies/persons",
        ),
        ("task.world.confusability=2", "task.world.confusability"),
    ];
    for (set, key) in cases {
        let sets: Vec<String> = set.split('\n').map(String::from).collect();
        let e = TrainConfig::resolve(Some("grpo"), None, &sets)
            .expect_err(&format!("{set} was accepted"));
        assert!(e.to_string().contains(key), "{set}: {e}");
    }
    // The defaults and the edges pass.
    for set in [
        "optim.beta1=0",
        "optim.weight_decay=0",
        "sft.min_lr_ratio=1",
        "task.topk=100",
        "optim.grad_clip=inf",
        "eval.questions=0\neval.greedy=false",
    ] {
        let sets: Vec<String> = set.split('\n').map(String::from).collect();
        let sets = if sets.len() > 1 {
            let mut s = sets;
            s.push("eval.sampled=false".into());
            s
        } else {
            sets
        };
        TrainConfig::resolve(Some("grpo"), None, &sets).unwrap_or_else(|e| panic!("{set}: {e}"));
    }
}

#[test]
fn task_env_selects_a_game_with_its_format_and_reward() {
    let resolve_with = |preset: &str, sets: &[&str]| {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        TrainConfig::resolve(Some(preset), None, &sets)
    };
    let resolve = |sets: &[&str]| resolve_with("gigpo", sets);
    assert_eq!(resolve(&[]).unwrap().task.env, TaskEnv::Search);
    // The environment sets the T2PO format and the plain outcome, over any preset's.
    for preset in ["gigpo", "grpo", "t2po"] {
        let cfg = resolve_with(preset, &["task.env=\"sokoban\""]).unwrap();
        assert_eq!(cfg.task.env, TaskEnv::Sokoban);
        assert_eq!(cfg.task.format, AgentFormatName::T2po, "{preset}");
        assert_eq!(cfg.reward.name(), "em", "{preset}");
    }
    // What the user sets wins, and is checked.
    let e = resolve(&["task.env=\"frozen_lake\"", "task.format=\"boxed\""])
        .unwrap_err()
        .to_string();
    assert!(e.contains("task.format") && e.contains("t2po"), "{e}");
    let e = resolve(&["task.env=\"chess\""]).unwrap_err().to_string();
    assert!(e.contains("task.env") && e.contains("chess"), "{e}");
    let e = resolve(&["task.env=\"frozen_lake\"", "task.game.hole_prob=1.0"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("task.game.hole_prob"), "{e}");
    // The t2po reward scores search actions; a game needs the plain outcome.
    let e = resolve_with(
        "t2po",
        &["task.env=\"frozen_lake\"", "reward.name=\"t2po_em\""],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("reward.name"), "{e}");
    // An environment chosen in a config file works the same.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("c.toml");
    std::fs::write(&file, "[task]\nenv = \"frozen_lake\"\n").unwrap();
    let cfg = TrainConfig::resolve(Some("grpo"), Some(&file), &[]).unwrap();
    assert_eq!(cfg.task.format, AgentFormatName::T2po);
}

#[test]
fn the_two_turn_task_sets_its_format_turns_rubrics_and_the_presets_credit() {
    let resolve = |preset: &str, sets: &[&str]| {
        let mut all = vec!["task.env=\"two_turn\"".to_string()];
        all.extend(sets.iter().map(|s| s.to_string()));
        TrainConfig::resolve(Some(preset), None, &all)
    };
    let cfg = resolve("mt-grpo", &[]).unwrap();
    assert_eq!(cfg.task.format, AgentFormatName::Verifiers);
    assert_eq!((cfg.task.max_turns, cfg.task.max_tool_calls), (2, Some(1)));
    assert_eq!(cfg.task.world.questions.hop_weights, [1.0, 0.0, 0.0, 0.0]);
    assert_eq!(cfg.reward.name(), "mt_grpo_two_turn");
    // The mt-grpo preset's [for_env.two_turn] table: the paper's two-turn credit.
    assert_eq!(cfg.advantage.name(), "mt_grpo_code");
    // The paper's baselines from the same preset: GRPO-OR and GRPO-MR.
    let or = resolve("mt-grpo", &["advantage.estimator=\"grpo\""]).unwrap();
    assert_eq!(or.advantage.name(), "grpo");
    assert_eq!(or.optim.ppo_epochs, cfg.optim.ppo_epochs);
    let mr = resolve(
        "mt-grpo",
        &[
            "advantage.estimator=\"grpo\"",
            "reward.merge_turn_rewards=true",
        ],
    )
    .unwrap();
    assert!(mr.to_toml().contains("merge_turn_rewards = true"));
    // Other presets keep their own estimator.
    assert_eq!(resolve("grpo", &[]).unwrap().advantage.name(), "grpo");
    // Without the environment the preset is the K-turn MT-GRPO of the search world.
    let search = TrainConfig::resolve(Some("mt-grpo"), None, &[]).unwrap();
    assert_eq!(search.advantage.name(), "mt_grpo");
    assert_eq!(search.task.format, AgentFormatName::SearchR1);
    // Two turns, one tool call, the verifiers format: each named when changed.
    for (set, key) in [
        ("task.max_turns=3", "task.max_turns"),
        ("task.max_tool_calls=2", "task.max_tool_calls"),
        ("task.format=\"search_r1\"", "task.format"),
    ] {
        let e = resolve("mt-grpo", &[set]).unwrap_err().to_string();
        assert!(e.contains(key), "{set}: {e}");
    }
    // A reward that cannot read the verifiers format is refused.
    let e = resolve("mt-grpo", &["reward.name=\"boxed_em\""])
        .unwrap_err()
        .to_string();
    assert!(e.contains("reward"), "{e}");
}

#[test]
fn preset_env_tables_name_known_environments() {
    let e = super::presets::for_env_table("x", toml::Value::String("y".into()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("for_env"), "{e}");
    let t: toml::Table = toml::from_str("[chess.advantage]\nestimator = \"grpo\"").unwrap();
    let e = super::presets::for_env_table("x", toml::Value::Table(t))
        .unwrap_err()
        .to_string();
    assert!(e.contains("chess"), "{e}");
    let t: toml::Table =
        toml::from_str("[a]\nclip = 1\nestimator = \"grpo\"\n[a.b]\nname = \"n\"").unwrap();
    assert_eq!(
        super::presets::flatten_overrides(&t),
        ["a.estimator=\"grpo\"", "a.b.name=\"n\"", "a.clip=1"]
    );
}

#[test]
fn lora_settings_are_validated_under_their_dotted_keys() {
    let resolve = |sets: &[&str]| {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        TrainConfig::resolve(Some("grpo"), None, &sets)
    };
    // Off by default, with PEFT's defaults for the other keys.
    let c = resolve(&[]).unwrap();
    assert_eq!(c.model.lora.rank, 0);
    assert!(c.model.lora.to_lora_config().is_none());
    assert_eq!(c.model.lora.alpha, 8.0);
    assert_eq!(c.model.lora.target_modules, ["q_proj", "v_proj"]);
    let c = resolve(&[
        "model.lora.rank=4",
        "model.lora.alpha=16",
        "model.lora.dropout=0.05",
        "model.lora.target_modules=[\"q_proj\", \"k_proj\", \"down_proj\"]",
    ])
    .unwrap();
    let l = c.model.lora.to_lora_config().unwrap();
    assert_eq!((l.rank, l.alpha, l.dropout), (4, 16.0, 0.05));
    assert_eq!(l.target_modules, ["q_proj", "k_proj", "down_proj"]);
    // The resolved config round-trips through TOML with the section.
    let back = TrainConfig::from_table(c.to_toml().parse::<toml::Table>().unwrap()).unwrap();
    assert_eq!(back.model.lora, c.model.lora);
    for (set, key) in [
        ("model.lora.alpha=0", "model.lora.alpha"),
        ("model.lora.dropout=1.0", "model.lora.dropout"),
        ("model.lora.dropout=-0.1", "model.lora.dropout"),
        ("model.lora.target_modules=[]", "model.lora.target_modules"),
        (
            "model.lora.target_modules=[\"qkv_proj\"]",
            "model.lora.target_modules",
        ),
        (
            "model.lora.target_modules=[\"q_proj\", \"q_proj\"]",
            "model.lora.target_modules",
        ),
        ("model.lora.rank=-1", "model.lora.rank"),
        ("model.lora.ranks=4", "ranks"),
    ] {
        let e = resolve(&["model.lora.rank=4", set])
            .unwrap_err()
            .to_string();
        assert!(e.contains(key), "{set}: {e}");
    }
    // Checked even while LoRA is off, so that a typo surfaces before it is turned on.
    let e = resolve(&["model.lora.target_modules=[\"qproj\"]"])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model.lora.target_modules") && e.contains("qproj"),
        "{e}"
    );
}

/// Absurd batch sizes are refused before anything runs, by a memory estimate naming the keys
/// (review defect 13: `rollout.group_size = 100000000` passed `turnwise config`), and a turn
/// limit no response can reach is refused.
#[test]
fn batches_beyond_the_machines_memory_are_refused() {
    let cfg = TrainConfig::resolve(Some("grpo"), None, &[]).unwrap();
    // 16 × 8 sequences, 400 tokens, the fresh model's KV cache: a few hundred MB at most.
    let floor = cfg.rollout_memory_floor();
    assert!(
        floor > 16 * 8 * 400 * 12 && floor < 2_000_000_000,
        "{floor}"
    );
    assert!(cfg.validate_memory(Some(4_000_000_000)).is_ok());
    let e = cfg
        .validate_memory(Some(1_000_000))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rollout.group_size") && e.contains("16 × 8") && e.contains("GB"),
        "{e}"
    );
    let e = TrainConfig::resolve(Some("grpo"), None, &["rollout.group_size=100000000".into()])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rollout.group_size") && e.contains("memory"),
        "{e}"
    );
    // Remote rollouts keep no KV cache here: only the trajectories count.
    let mut remote = cfg.clone();
    remote.rollout.backend = RolloutBackend::Remote;
    assert_eq!(remote.rollout_memory_floor(), 16 * 8 * 400 * 12);
    let e = TrainConfig::resolve(Some("grpo"), None, &["task.max_turns=1000000".into()])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("task.max_turns") && e.contains("max_response_tokens"),
        "{e}"
    );
}

/// The tracking keys: TensorBoard on and W&B off by default; W&B modes by name; names W&B
/// would refuse are refused here, naming the key.
#[test]
fn tracking_keys_default_parse_and_validate() {
    let cfg = TrainConfig::resolve(Some("grpo"), None, &[]).unwrap();
    assert!(cfg.run.tensorboard);
    assert_eq!(cfg.run.wandb, WandbSetting::Off);
    assert_eq!(cfg.run.wandb.mode(), None);
    let set = |sets: &[&str]| {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        TrainConfig::resolve(Some("grpo"), None, &sets)
    };
    let cfg = set(&[
        "run.wandb=\"offline\"",
        "run.wandb_entity=\"team\"",
        "run.tensorboard=false",
    ])
    .unwrap();
    assert_eq!(cfg.run.wandb, WandbSetting::Offline);
    assert_eq!(cfg.run.wandb_entity.as_deref(), Some("team"));
    assert!(!cfg.run.tensorboard);
    let e = set(&["run.wandb=\"cloud\""]).unwrap_err().to_string();
    assert!(e.contains("run.wandb"), "{e}");
    for (key, value) in [
        ("run.wandb_project", "\"a/b\""),
        ("run.wandb_project", "\" \""),
        ("run.wandb_entity", "\"x:y\""),
        ("run.wandb_name", "\"\""),
    ] {
        let e = set(&[&format!("{key}={value}")]).unwrap_err().to_string();
        assert!(e.contains(key), "{key}={value}: {e}");
    }
}

/// The numbers of the estimators', losses' and KL controller's settings are checked against
/// the range their key is given in `update::NUMBER_RANGES`, with the messages of before.
#[test]
fn other_crates_numbers_are_refused_outside_their_stated_ranges() {
    for (preset, set, message) in [
        (
            "a2tgpo",
            "advantage.gamma=1.5",
            "config field `advantage.gamma`: must be in [0, 1], got 1.5",
        ),
        (
            "gigpo",
            "advantage.similarity_thresh=-0.5",
            "config field `advantage.similarity_thresh`: must be in (0, 1), both ends excluded \
             (set advantage.enable_similarity = false to match anchors exactly), got -0.5",
        ),
        (
            "grpo",
            "advantage.epsilon=-1",
            "config field `advantage.epsilon`: must be a non-negative number, got -1",
        ),
        (
            "a2tgpo",
            "advantage.ig_epsilon=0",
            "config field `advantage.ig_epsilon`: must be positive (it is added to a group's \
             standard deviation, which is 0 when all its scores agree), got 0",
        ),
        (
            "a2tgpo",
            "advantage.clip_beta=-0.1",
            "config field `advantage.clip_beta`: must be a non-negative number, got -0.1",
        ),
        (
            "grpo",
            "actor.policy.clip_ratio_c=1",
            "config field `actor.policy.clip_ratio_c`: must be above 1 (the dual clip bounds \
             ratios of negative advantages), got 1",
        ),
        (
            "grpo",
            "actor.policy.clip_ratio_low=0",
            "config field `actor.policy.clip_ratio_low`: must be positive, got 0",
        ),
        (
            "grpo",
            "algorithm.kl_ctrl.horizon=-1",
            "config field `algorithm.kl_ctrl.horizon`: must be a non-negative number, got -1",
        ),
        (
            "grpo",
            "actor.entropy_coeff=nan",
            "config field `actor.entropy_coeff`: must be a finite number, got NaN",
        ),
        (
            "grpo",
            "task.world.heldout_fraction=inf",
            "config field `task.world.heldout_fraction`: must be a finite number, got inf",
        ),
    ] {
        let e = TrainConfig::resolve(Some(preset), None, &[set.into()])
            .expect_err(set)
            .to_string();
        assert_eq!(e, message, "{preset} {set}");
    }
    // The edges inside pass; only `optim.grad_clip` may be infinite.
    for (preset, set) in [
        ("a2tgpo", "advantage.gamma=1"),
        ("grpo", "advantage.epsilon=1e-9"),
        ("grpo", "actor.policy.clip_ratio_c=1.01"),
        ("grpo", "actor.kl_loss_coef=0"),
        ("grpo", "optim.grad_clip=inf"),
    ] {
        TrainConfig::resolve(Some(preset), None, &[set.into()])
            .unwrap_or_else(|e| panic!("{preset} {set}: {e}"));
    }
}

/// Every key `update::NUMBER_RANGES` states a range for is one a config has: some preset (or
/// the two-turn task's estimator) refuses a value just outside the range under that key.
#[test]
fn every_stated_number_range_names_a_live_key() {
    use turnwise_core::range::Range;
    let mut bases: Vec<(&str, Vec<String>)> =
        presets::names().iter().map(|p| (*p, Vec::new())).collect();
    bases.push(("mt-grpo", vec!["task.env=\"two_turn\"".into()]));
    for &(key, range) in super::update::NUMBER_RANGES {
        let (bad, what) = match range {
            Range::UnitInterval => ("1.5", "in [0, 1]"),
            Range::NonNegative => ("-1", "a non-negative number"),
            Range::StdEpsilon => ("0", "positive (it is added"),
            Range::Positive => ("0", "positive"),
            Range::AboveOne => ("1", "above 1"),
        };
        let want = format!("config field `{key}`: must be {what}");
        let refused = bases.iter().any(|(preset, sets)| {
            let mut sets = sets.clone();
            sets.push(format!("{key}={bad}"));
            TrainConfig::resolve(Some(preset), None, &sets)
                .is_err_and(|e| e.to_string().starts_with(&want))
        });
        assert!(refused, "no preset refuses {key}={bad} with {want:?}");
    }
}

/// `advantage.similarity_thresh` is refused by the config exactly where GiGPO's and T2PO's
/// estimator would refuse it at the first advantage step (outside (0, 1)), naming the key and
/// the range; values inside pass both.
#[test]
fn similarity_thresholds_the_estimator_refuses_are_refused_by_the_config() {
    use turnwise_core::advantage::{AdvantageBatch, AdvantageConfig};
    for preset in ["gigpo", "t2po"] {
        let base = TrainConfig::resolve(Some(preset), None, &[]).unwrap();
        for t in [0.0, 1e-9, 0.5, 0.9, 0.999_999, 1.0] {
            let set = format!("advantage.similarity_thresh={t:?}");
            let config = TrainConfig::resolve(Some(preset), None, std::slice::from_ref(&set));
            // The estimator's settings as training builds them, with this threshold.
            let mut v = serde_json::to_value(&base.advantage).unwrap();
            v["similarity_thresh"] = serde_json::json!(t);
            v["enable_similarity"] = serde_json::json!(true);
            let est: AdvantageConfig = serde_json::from_value(v).unwrap();
            let trains = est.estimate(&AdvantageBatch::new(Vec::new())).is_ok();
            assert_eq!(config.is_ok(), trains, "{preset} {set}: {config:?}");
            if let Err(e) = config {
                let e = e.to_string();
                assert!(
                    e.contains("advantage.similarity_thresh") && e.contains("in (0, 1)"),
                    "{preset} {set}: {e}"
                );
            }
        }
    }
}

/// One pass: a config with bad keys in three sections (an estimator's setting, the optimizer,
/// the rollout) reports all three at once, each on its own line under its key, and a value that
/// is also not finite is reported once.
#[test]
fn every_bad_key_is_reported_at_once() {
    let sets: Vec<String> = [
        "advantage.epsilon=-1",
        "optim.beta1=1.5",
        "rollout.group_size=0",
        "actor.entropy_coeff=nan",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let e = TrainConfig::resolve(Some("grpo"), None, &sets).unwrap_err();
    let ConfigError::Several(problems) = &e else {
        panic!("one error for several bad keys: {e}");
    };
    let text = e.to_string();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), problems.len(), "{text}");
    for want in [
        "config field `advantage.epsilon`: must be a non-negative number, got -1",
        "config field `optim.beta1`: must be in [0, 1), got 1.5",
        "config field `actor.entropy_coeff`: must be a finite number, got NaN",
    ] {
        assert!(lines.contains(&want), "{want}: {text}");
    }
    assert_eq!(
        lines
            .iter()
            .filter(|l| l.starts_with("config field `rollout.group_size`"))
            .count(),
        1,
        "{text}"
    );
    assert_eq!(lines.len(), 4, "{text}");
}

/// The estimator's and the loss's own checks ([`TrainConfig::validate_parts`]) report every
/// setting out of range under its dotted key, and pass a preset's settings.
#[test]
fn the_parts_report_their_own_settings_under_their_keys() {
    let mut cfg = TrainConfig::resolve(Some("a2tgpo"), None, &[]).unwrap();
    assert!(cfg.validate_parts().is_empty());
    let turnwise_core::advantage::AdvantageConfig::A2tgpo(a) = &mut cfg.advantage else {
        panic!("a2tgpo names its estimator");
    };
    a.gamma = 1.5;
    a.clip_beta = -0.1;
    cfg.actor.policy.clip_ratio_low = Some(0.0);
    let keys: Vec<String> = cfg.validate_parts().iter().map(|e| e.to_string()).collect();
    assert_eq!(
        keys,
        [
            "config field `advantage.gamma`: must be in [0, 1], got 1.5",
            "config field `advantage.clip_beta`: must be a non-negative number, got -0.1",
            "config field `actor.policy.clip_ratio_low`: must be positive, got 0",
        ]
    );
}
