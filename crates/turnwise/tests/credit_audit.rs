//! `turnwise credit-audit` end to end: a tiny warm-started model on a tiny world, audited by the
//! real subcommand; the report's files and the shape of its tables.

mod common;

use std::time::Instant;

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `command` with the tiny world and model's overrides, then `sets`, as `--set` flags.
fn tiny_command(command: &[&str], sets: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = command.iter().map(|s| s.to_string()).collect();
    let sets = common::tiny_overrides()
        .into_iter()
        .chain(sets.iter().map(|s| s.to_string()));
    for s in sets {
        args.push("--set".into());
        args.push(s);
    }
    args
}

/// `credit-audit` of `source` (`--checkpoint DIR` or `--run DIR`) on 3 validation episodes in
/// groups of 3, K = M = 2, `bootstrap` resamples, into `audit/`.
fn tiny_audit(source: &[&str], bootstrap: usize) -> Vec<String> {
    let mut args = vec!["credit-audit".to_string()];
    args.extend(source.iter().map(|s| s.to_string()));
    for (flag, value) in [
        ("--split", "validation".to_string()),
        ("--episodes", "3".into()),
        ("--group", "3".into()),
        ("--alternatives", "2".into()),
        ("--rollouts", "2".into()),
        ("--bootstrap", bootstrap.to_string()),
        ("--out", "audit".into()),
    ] {
        args.push(flag.into());
        args.push(value);
    }
    args
}

#[test]
fn credit_audit_writes_its_tables_for_a_tiny_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let out = common::turnwise_in(
        &tiny_command(&["sft", "--preset", "grpo", "--out", "model"], &[]),
        tmp.path(),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));

    let t0 = Instant::now();
    let audit = tiny_audit(&["--checkpoint", "model"], 50);
    let out = common::turnwise_in(&audit, tmp.path());
    let seconds = t0.elapsed().as_secs_f64();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(seconds < 120.0, "a tiny audit took {seconds:.0} s");
    let dir = tmp.path().join("audit");
    for f in turnwise::audit::report::FILES {
        assert!(dir.join(f).is_file(), "{f} is missing");
    }
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("audit.json")).unwrap()).unwrap();
    assert_eq!(r["episodes"], 3);
    assert_eq!(
        (r["alternatives"].as_u64(), r["rollouts"].as_u64()),
        (Some(2), Some(2))
    );
    let turns = r["turns"].as_u64().unwrap() as usize;
    let audited = r["audited"].as_array().unwrap();
    assert!(turns >= 3, "every episode has a turn: {turns}");
    assert_eq!(audited.len(), turns);
    // Every turn: K alternatives of M returns, the taken turn's M, and one credit per estimator.
    let estimators = r["estimators"].as_array().unwrap();
    let names: Vec<&str> = estimators
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert!(
        names.contains(&"grpo") && names.contains(&"gigpo"),
        "{names:?}"
    );
    assert!(
        names.contains(&"igpo") && names.contains(&"a2tgpo"),
        "{names:?}"
    );
    assert_eq!(names.last(), Some(&turnwise::audit::RANDOM));
    // A warm start has no critic: PPO's GAE is left out, saying where one comes from.
    assert!(!names.contains(&"ppo"), "{names:?}");
    let skipped = r["skipped"].as_array().unwrap();
    assert!(
        skipped.iter().any(|s| s[0] == "ppo"
            && s[1].as_str().unwrap().contains("trained critic")
            && s[1].as_str().unwrap().contains("--run")),
        "{skipped:?}"
    );
    let max_depth = audited
        .iter()
        .map(|t| t["turn"].as_u64().unwrap() as usize + 1)
        .max()
        .unwrap();
    for t in audited {
        assert_eq!(t["replay"]["taken"].as_array().unwrap().len(), 2);
        let alts = t["replay"]["alternatives"].as_array().unwrap();
        assert_eq!(alts.len(), 2);
        assert!(alts.iter().all(|a| a.as_array().unwrap().len() == 2));
        assert_eq!(t["credit"].as_object().unwrap().len(), names.len());
    }
    for e in estimators {
        assert_eq!(e["overall"]["turns"].as_u64(), Some(turns as u64));
        assert_eq!(e["by_depth"].as_array().unwrap().len(), max_depth);
    }
    assert_eq!(r["depths"].as_array().unwrap().len(), max_depth);
    let rollouts = r["replay_rollouts"].as_u64().unwrap();
    assert!(rollouts <= r["cost_bound"].as_u64().unwrap());
    assert_eq!(r["cost_bound"].as_u64(), Some(turns as u64 * 3 * 2));
    let density = r["realised_density"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&density));
    // The built-in world states its density (the default, 1).
    assert_eq!(r["stated_density"].as_f64(), Some(1.0));
    // The markdown: one row per estimator in the main table, one per estimator and depth below.
    let md = std::fs::read_to_string(dir.join("audit.md")).unwrap();
    assert!(md.contains("Realised decision density"), "{md}");
    assert!(
        md.contains("| estimator | turns | Spearman [95 %] | chance [95 %] | p |"),
        "{md}"
    );
    // The permutation test, wherever ρ is defined.
    for e in estimators {
        let o = &e["overall"];
        if o["spearman"]["value"].is_f64() {
            let p = o["spearman_null"]["p_value"].as_f64().unwrap();
            assert!(p > 0.0 && p <= 1.0, "{e}");
        }
    }
    for n in &names {
        let rows = md
            .lines()
            .filter(|l| l.starts_with(&format!("| {n} |")))
            .count();
        assert_eq!(rows, 1 + max_depth, "{n}: {md}");
    }
    let svg = std::fs::read_to_string(dir.join("spearman_by_depth.svg")).unwrap();
    assert!(svg.starts_with("<svg") || svg.starts_with("<?xml"), "{svg}");

    // The report's files are turnwise's own (issue 50, ownership by manifest): a second audit
    // into the folder is refused without --overwrite and replaces them with it; a folder of the
    // user's holding an audit.md of its own is never written into, --overwrite or not.
    let again = common::turnwise_in(&audit, tmp.path());
    assert!(
        !again.status.success(),
        "a second audit overwrote the first"
    );
    assert!(
        text(&again.stderr).contains("audit.md"),
        "{}",
        text(&again.stderr)
    );
    let mut overwrite = audit.clone();
    overwrite.push("--overwrite".into());
    let again = common::turnwise_in(&overwrite, tmp.path());
    assert!(again.status.success(), "{}", text(&again.stderr));
    let mine = tmp.path().join("mine");
    std::fs::create_dir(&mine).unwrap();
    std::fs::write(mine.join("audit.md"), "my notes").unwrap();
    std::fs::write(mine.join("keep.txt"), "mine too").unwrap();
    let into_mine = |extra: &[&str]| {
        let mut a = audit.clone();
        *a.last_mut().unwrap() = "mine".into();
        a.extend(extra.iter().map(|s| s.to_string()));
        common::turnwise_in(&a, tmp.path())
    };
    for extra in [&[][..], &["--overwrite"][..]] {
        let o = into_mine(extra);
        assert!(
            !o.status.success(),
            "{extra:?}: wrote into the user's folder"
        );
        assert!(text(&o.stderr).contains("audit.md"), "{}", text(&o.stderr));
    }
    assert_eq!(
        std::fs::read_to_string(mine.join("audit.md")).unwrap(),
        "my notes"
    );
    assert_eq!(
        std::fs::read_to_string(mine.join("keep.txt")).unwrap(),
        "mine too"
    );
}

/// A run of the PPO family holds a trained critic: auditing it scores PPO's GAE (the turn's
/// advantage at its first token, from the critic's values) beside the others; before this it
/// was always left out.
#[test]
fn credit_audit_scores_ppo_from_the_critic_of_a_ppo_run() {
    let tmp = tempfile::tempdir().unwrap();
    let out = common::turnwise_in(
        &tiny_command(
            &["train", "--preset", "ppo", "--out", "run"],
            &["run.steps=1", "eval.greedy=false", "eval.sampled=false"],
        ),
        tmp.path(),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let audit = tiny_audit(&["--run", "run"], 20);
    let out = common::turnwise_in(&audit, tmp.path());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let r: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("audit/audit.json")).unwrap(),
    )
    .unwrap();
    let skipped = r["skipped"].as_array().unwrap();
    assert!(skipped.iter().all(|s| s[0] != "ppo"), "{skipped:?}");
    let ppo = r["estimators"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "ppo")
        .unwrap_or_else(|| panic!("no ppo row: {}", r["estimators"]));
    let turns = r["turns"].as_u64().unwrap();
    assert_eq!(ppo["overall"]["turns"].as_u64(), Some(turns));
    // GAE's credit varies with the critic's values: not the outcome broadcast (one value per
    // episode) on every turn.
    let audited = r["audited"].as_array().unwrap();
    let credit = |t: &serde_json::Value, n: &str| t["credit"][n].as_f64().unwrap();
    assert!(
        audited.iter().all(|t| credit(t, "ppo").is_finite()),
        "{audited:?}"
    );
    assert!(
        audited
            .iter()
            .any(|t| (credit(t, "ppo") - credit(t, "grpo")).abs() > 1e-9),
        "PPO's credit equals GRPO's broadcast on every turn"
    );
    let md = std::fs::read_to_string(tmp.path().join("audit/audit.md")).unwrap();
    assert!(md.lines().any(|l| l.starts_with("| ppo |")), "{md}");
}
