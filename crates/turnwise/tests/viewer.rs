//! The trajectory viewer (`turnwise view`) on real runs: a tiny training of one RL step per
//! preset (grpo; a2tgpo with information gain and clip scales; gigpo with step groups and step
//! samples) writes annotated samples, the viewer's page holds every episode with one advantage
//! per agent token, headless Chromium renders it (a screenshot, and the DOM after the page's
//! script ran, with and without a filter in the URL), and `--serve` answers over HTTP.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use turnwise_core::advantage::Channel;

use serde_json::Value;
use turnwise::config::TrainConfig;
use turnwise::pipeline::{RunOptions, run};
use turnwise::run::view::{serve_view, write_view};
use turnwise::run::{RunDir, SampleRecord};

/// Episodes of the tiny batch (2 prompts × 3 rollouts), all saved as samples.
const EPISODES: usize = 6;

/// One RL step of `preset` on the tiny world and model, every episode saved as a sample;
/// `extra` overrides come last.
fn tiny_run(preset: &str, dir: &Path, extra: &[&str]) -> Vec<SampleRecord> {
    let mut sets = common::tiny_overrides();
    sets.extend(
        [
            "run.steps=1",
            "run.save_every=1",
            &format!("run.samples_per_step={EPISODES}"),
            "eval.questions=2",
            // Room for a search, its observation and an answer.
            "rollout.max_turn_tokens=24",
            "rollout.max_response_tokens=160",
        ]
        .map(String::from),
    );
    sets.extend(extra.iter().map(|s| s.to_string()));
    let cfg = TrainConfig::resolve(Some(preset), None, &sets).unwrap();
    run(
        cfg,
        &RunOptions {
            dir: dir.to_path_buf(),
            quiet: true,
        },
        false,
    )
    .unwrap();
    RunDir::open(dir).unwrap().read_samples(1).unwrap().unwrap()
}

/// What every annotated sample line holds, whatever the preset: the decoded prompt and turns,
/// one token text and one advantage per agent token, per-turn advantages, the group (with the
/// mean and std of its members' scores where the estimator normalises those, `outcome_stats`),
/// and clipped shares in [0, 1].
fn check_records(preset: &str, recs: &[SampleRecord], outcome_stats: bool) {
    assert_eq!(recs.len(), EPISODES, "{preset}");
    for r in recs {
        let t = &r.trajectory;
        let (tokens, turns) = (t.agent_token_count(), t.num_turns());
        let id = &t.id;
        assert!(!r.prompt_text.as_deref().unwrap_or("").is_empty(), "{id}");
        assert_eq!(r.turn_texts.len(), turns, "{id}");
        assert_eq!(r.token_texts.len(), tokens, "{id}");
        // The pieces make the turns' text (a byte-level tokenizer's stray bytes aside).
        let text: String = r.turn_texts.iter().map(|x| x.agent.as_str()).collect();
        if !text.contains('\u{fffd}') {
            assert_eq!(r.token_texts.concat(), text, "{id}");
        }
        assert_eq!(r.trained, Some(true), "{id}");
        assert!(r.em.is_some() && r.format_ok.is_some(), "{id}");
        assert_eq!(r.advantages.as_ref().map(Vec::len), Some(tokens), "{id}");
        assert_eq!(
            r.turn_advantages.as_ref().map(Vec::len),
            Some(turns),
            "{id}"
        );
        let clipped = r
            .clipped
            .as_ref()
            .expect("clip shares of a trained episode");
        assert_eq!(clipped.len(), tokens, "{id}");
        assert!(clipped.iter().all(|c| (0.0..=1.0).contains(c)), "{id}");
        let g = r.group.as_ref().expect("a group");
        assert_eq!(g.size, 3, "{id}");
        let scores: Vec<f64> = recs
            .iter()
            .filter(|o| o.group.as_ref().map(|x| x.id) == Some(g.id))
            .map(|o| o.score.unwrap())
            .collect();
        assert_eq!(scores.len(), 3, "{id}");
        if !outcome_stats {
            continue;
        }
        let mean = scores.iter().sum::<f64>() / 3.0;
        let std = (scores.iter().map(|s| (s - mean).powi(2)).sum::<f64>() / 2.0).sqrt();
        assert!(
            (g.mean - mean).abs() < 1e-9 && (g.std - std).abs() < 1e-9,
            "{id}: {g:?}"
        );
    }
}

/// The page's embedded data.
fn page_data(html: &str) -> Value {
    let json = html
        .split("<script type=\"application/json\" id=\"data\">")
        .nth(1)
        .and_then(|s| s.split("</script>").next())
        .expect("the page embeds its data");
    serde_json::from_str(json).unwrap()
}

/// The page of the run's latest step holds every episode, each turn's tokens with one
/// advantage each; returns the data.
fn check_page(dir: &Path, recs: &[SampleRecord]) -> Value {
    let out = dir.join("page.html");
    let (path, step) = write_view(dir, None, Some(&out)).unwrap();
    assert_eq!((path, step), (out.clone(), 1));
    let html = std::fs::read_to_string(&out).unwrap();
    assert!(
        !html.contains("<script src") && !html.contains("<link"),
        "self-contained"
    );
    let data = page_data(&html);
    let eps = data["episodes"].as_array().unwrap();
    assert_eq!(eps.len(), recs.len());
    for (ep, r) in eps.iter().zip(recs) {
        assert_eq!(ep["id"], r.trajectory.id.as_str());
        let turns = ep["turns"].as_array().unwrap();
        assert_eq!(turns.len(), r.trajectory.num_turns());
        let mut n = 0;
        for t in turns {
            let ids = t["tokens"]["ids"].as_array().unwrap().len();
            assert_eq!(t["tokens"]["adv"].as_array().unwrap().len(), ids);
            assert_eq!(t["tokens"]["text"].as_array().unwrap().len(), ids);
            assert!(t["advantage"].is_number());
            n += ids;
        }
        assert_eq!(n, r.trajectory.agent_token_count());
    }
    data
}

#[test]
fn grpo_samples_carry_group_normalised_advantages_and_the_page_shows_them() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("grpo");
    // A warm start long enough that the tiny model writes whole turns and sometimes answers
    // right (tests/presets.rs's), so that outcomes differ within a group.
    let recs = tiny_run(
        "grpo",
        &dir,
        &[
            "sft.steps=300",
            "sft.batch_size=4",
            "rollout.max_turn_tokens=48",
            "rollout.max_response_tokens=240",
        ],
    );
    check_records("grpo", &recs, true);
    assert!(
        recs.iter().any(|r| r.group.as_ref().unwrap().std > 0.0),
        "no group with differing outcomes: the check of the advantages below is vacuous (the \
         warm start no longer makes the tiny model answer right at times: lengthen it)"
    );
    for r in &recs {
        // GRPO: every token of the episode gets (s − mean) / (std + 1e-6) of its group.
        let g = r.group.as_ref().unwrap();
        let want = (r.score.unwrap() - g.mean) / (g.std + 1e-6);
        for &a in r.advantages.as_ref().unwrap() {
            assert!(
                (a - want).abs() < 1e-4,
                "{}: {a} vs {want}",
                r.trajectory.id
            );
        }
        assert!(r.info_gain.is_none() && r.channels.is_empty() && r.step_groups.is_none());
    }
    let data = check_page(&dir, &recs);
    assert_eq!(data["preset"], "grpo");
    assert_eq!(data["estimator"], "grpo");

    // A samples file written before the annotations (bare trajectories) still shows, its
    // tokens decoded with the run's checkpoint tokenizer.
    let run_dir = RunDir::open(&dir).unwrap();
    let bare: Vec<_> = recs.iter().map(|r| r.trajectory.clone()).collect();
    run_dir.write_samples(7, &bare).unwrap();
    let (path, step) = write_view(&dir, None, None).unwrap();
    assert_eq!(step, 7);
    assert_eq!(path, dir.join("view/step-00007.html"));
    let old = page_data(&std::fs::read_to_string(path).unwrap());
    assert_eq!(old["episodes"].as_array().unwrap().len(), EPISODES);
    assert!(
        old["notes"].as_array().unwrap().len() >= 2,
        "{}",
        old["notes"]
    );
    let t0 = &old["episodes"][0]["turns"][0];
    assert!(t0["tokens"]["adv"].is_null());
    let text: String = t0["tokens"]["text"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    let want = recs[0].token_texts[..t0["tokens"]["ids"].as_array().unwrap().len()].concat();
    assert_eq!(text, want);
    let err = write_view(&dir, Some(5), None).unwrap_err().to_string();
    assert!(
        err.contains("no samples of step 5") && err.contains("1, 7"),
        "{err}"
    );

    // The binary: `turnwise view RUN --step 1 --out FILE`.
    let out = tmp.path().join("cli.html");
    let o = common::turnwise_in(
        &[
            "view".into(),
            dir.display().to_string(),
            "--step".into(),
            "1".into(),
            "--out".into(),
            out.display().to_string(),
        ],
        tmp.path(),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        page_data(&std::fs::read_to_string(&out).unwrap())["step"],
        1
    );

    // `--serve`: the page over HTTP on loopback, any step by `?step=N`.
    let server = serve_view(&dir, "127.0.0.1:0".parse().unwrap()).unwrap();
    let base = server.url();
    let get = |q: &str| {
        let r = reqwest::blocking::get(format!("{base}/{q}")).unwrap();
        (r.status().as_u16(), r.text().unwrap())
    };
    let (status, body) = get("");
    assert_eq!(status, 200);
    let served = page_data(&body);
    assert_eq!(
        (served["step"].clone(), served["served"].clone()),
        (7.into(), true.into())
    );
    let (status, body) = get("?step=1");
    assert_eq!(status, 200);
    assert_eq!(page_data(&body)["episodes"], data["episodes"]);
    let (status, body) = get("?step=3");
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("no samples of step 3"), "{body}");
    assert_eq!(get("?step=x").0, 400);
    drop(server);

    chromium_renders(&dir, &tmp.path().join("page-grpo.html"), &data);
}

#[test]
fn a2tgpo_samples_carry_information_gain_and_clip_scales() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("a2tgpo");
    let recs = tiny_run("a2tgpo", &dir, &[]);
    check_records("a2tgpo", &recs, true);
    for r in &recs {
        let turns = r.trajectory.num_turns();
        let id = &r.trajectory.id;
        let ig = r.info_gain.as_ref().expect("information gains");
        assert_eq!(ig.len(), turns - 1, "{id}");
        let c = r.channels.get(&Channel::ClipScale).expect("clip scales");
        assert_eq!(c.len(), turns, "{id}");
        assert!(c.iter().all(|x| x.is_finite() && *x > 0.0), "{id}: {c:?}");
        assert_eq!(c.last(), Some(&1.0), "{id}: the final turn's scale is 1");
    }
    let data = check_page(&dir, &recs);
    let t0 = &data["episodes"][0]["turns"][0];
    assert!(t0["channels"]["clip_scale"].is_number());
    if recs[0].trajectory.num_turns() > 1 {
        assert!(t0["info_gain"].is_number());
    }
}

#[test]
fn gigpo_samples_carry_step_groups() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("gigpo");
    let recs = tiny_run("gigpo", &dir, &[]);
    check_records("gigpo", &recs, false);
    let mut sizes = std::collections::BTreeMap::new();
    for r in &recs {
        let s = r.step_groups.as_ref().expect("step groups");
        assert_eq!(s.len(), r.trajectory.num_turns());
        for g in s {
            sizes.insert(g.id, g.size);
        }
    }
    // Each group's size is the number of step samples carrying its id (every episode is a
    // sample here); the first steps of a prompt's rollouts share the prompt as their anchor.
    for (id, size) in sizes {
        let n = recs
            .iter()
            .flat_map(|r| r.step_groups.as_ref().unwrap())
            .filter(|g| g.id == id)
            .count();
        assert_eq!(n, size, "step group {id}");
    }
    assert_eq!(recs[0].step_groups.as_ref().unwrap()[0].size, 3);
    // The group's statistics are GiGPO's episode term's: over its step samples' scores, each
    // the episode's summed step rewards less the preset's 0.01 penalty on an invalid step.
    for r in &recs {
        let g = r.group.as_ref().unwrap();
        let pool: Vec<f64> = recs
            .iter()
            .filter(|o| o.group.as_ref().unwrap().id == g.id)
            .flat_map(|o| {
                let turns = &o.trajectory.turns;
                let raw: f64 = turns.iter().map(|t| t.env_reward.unwrap_or(0.0)).sum();
                turns.iter().map(move |t| match t.action {
                    turnwise_core::trajectory::TurnAction::Invalid { .. } => raw - 0.01,
                    _ => raw,
                })
            })
            .collect();
        let n = pool.len() as f64;
        let mean = pool.iter().sum::<f64>() / n;
        let std = (pool.iter().map(|s| (s - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt();
        assert!(
            (g.mean - mean).abs() < 1e-9 && (g.std - std).abs() < 1e-9,
            "{g:?}: {pool:?}"
        );
    }
    let data = check_page(&dir, &recs);
    assert!(data["episodes"][0]["turns"][0]["step_group"]["size"].is_number());
}

/// `chromium` on PATH; a missing browser fails the test with what to do.
fn chromium() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("chromium"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "chromium is not on PATH: the viewer's test renders the page in headless \
                 Chromium; install it with `apt-get install -y chromium` (CI's .ci/run does)"
            )
        })
}

/// Runs headless Chromium with `args` and the page `url`; returns its stdout.
fn run_chromium(profile: &Path, args: &[&str], url: &str) -> String {
    let o = Command::new(chromium())
        .args([
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(url)
        .output()
        .expect("chromium starts");
    assert!(
        o.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

/// Elements of class `class` (first class of their attribute) in a DOM dump.
fn count_class(dom: &str, tag: &str, class: &str) -> usize {
    dom.matches(&format!("<{tag} class=\"{class}")).count()
}

/// Token spans with a background colour in a DOM dump.
fn coloured_tokens(dom: &str) -> usize {
    dom.split("<span class=\"tok")
        .skip(1)
        .filter(|s| {
            let tag = &s[..s.find('>').unwrap_or(s.len())];
            tag.contains("background-color: rgba(")
        })
        .count()
}

/// Headless Chromium renders the page of `data` (written to `page`): a screenshot that is not
/// blank, and after the script ran, one element per episode and turn and a coloured span per
/// token; `#filter=` and `#group=` in the URL show the matching episodes only.
fn chromium_renders(dir: &Path, page: &Path, data: &Value) {
    write_view(dir, Some(1), Some(page)).unwrap();
    let profile = tempfile::tempdir().unwrap();
    let url = format!("file://{}", page.display());
    let shot = dir.join("page.png");
    run_chromium(
        profile.path(),
        &[
            &format!("--screenshot={}", shot.display()),
            "--window-size=1280,1400",
            "--virtual-time-budget=2000",
        ],
        &url,
    );
    let png = std::fs::read(&shot).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let (w, h) = (
        u32::from_be_bytes(png[16..20].try_into().unwrap()),
        u32::from_be_bytes(png[20..24].try_into().unwrap()),
    );
    assert_eq!((w, h), (1280, 1400));
    // A blank page compresses to a few kilobytes; text and coloured tokens do not.
    assert!(png.len() > 40_000, "{} bytes", png.len());
    if let Ok(keep) = std::env::var("TURNWISE_VIEW_SCREENSHOT") {
        std::fs::copy(&shot, keep).unwrap();
    }

    let eps = data["episodes"].as_array().unwrap();
    let dump = |hash: &str| {
        run_chromium(
            profile.path(),
            &["--dump-dom", "--virtual-time-budget=2000"],
            &format!("{url}{hash}"),
        )
    };
    let dom = dump("");
    let turns: usize = eps
        .iter()
        .map(|e| e["turns"].as_array().unwrap().len())
        .sum();
    let tokens: usize = eps
        .iter()
        .flat_map(|e| e["turns"].as_array().unwrap())
        .map(|t| t["tokens"]["ids"].as_array().unwrap().len())
        .sum();
    assert_eq!(count_class(&dom, "article", "episode"), eps.len());
    assert_eq!(count_class(&dom, "section", "turn"), turns);
    assert_eq!(coloured_tokens(&dom), tokens);
    assert!(dom.contains(&format!("showing {} of {}", eps.len(), eps.len())));

    let with = |flag: bool| eps.iter().filter(|e| e["correct"] == flag).count();
    for (filter, want) in [("correct", with(true)), ("wrong", with(false))] {
        let dom = dump(&format!("#filter={filter}"));
        assert_eq!(count_class(&dom, "article", "episode"), want, "{filter}");
    }
    let group = eps[0]["group"]["id"].as_u64().unwrap();
    let in_group = eps
        .iter()
        .filter(|e| e["group"]["id"].as_u64() == Some(group))
        .count();
    assert!(in_group < eps.len());
    let dom = dump(&format!("#group={group}&color=entropy"));
    assert_eq!(count_class(&dom, "article", "episode"), in_group);
    assert!(
        dom.contains("class=\"on\" data-v=\"entropy\"")
            || dom.contains("data-v=\"entropy\" class=\"on\"")
    );
}
