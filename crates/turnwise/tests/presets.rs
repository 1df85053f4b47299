//! Every preset, with its own settings, on a tiny model and world from one shared warm start:
//! no metric is NaN and the metrics that show its mechanism show it at work.

use std::collections::BTreeMap;

use turnwise::config::{TrainConfig, TrainSamples, presets};
use turnwise::trainer::Trainer;
use turnwise::update::{Row, logprobs_no_grad, pack};

mod common;
use common::tiny_overrides;

/// Room for whole turns: the tiny overrides' 12-token turns cut most boxed-format turns short,
/// so every outcome would be a format failure and no group would carry signal.
const ROOM: [&str; 2] = [
    "rollout.max_turn_tokens=48",
    "rollout.max_response_tokens=240",
];

/// One warm start per agent format, shared by every preset of that format (the quickstart's
/// arrangement: one warm start, every method trained from it), long enough that the tiny model
/// writes whole turns in the format and sometimes answers right, exported as a Hugging Face
/// folder. `preset` is the first preset of the format to ask for it (its task settings build
/// the demonstrations).
fn shared_warm_start(preset: &str) -> anyhow::Result<std::path::PathBuf> {
    use std::collections::BTreeMap;
    use std::sync::Mutex;
    static DIRS: Mutex<BTreeMap<String, tempfile::TempDir>> = Mutex::new(BTreeMap::new());
    let format = TrainConfig::resolve(Some(preset), None, &[])?.task.format;
    let key = format!("{format:?}");
    let mut dirs = DIRS.lock().unwrap();
    if let Some(d) = dirs.get(&key) {
        return Ok(d.path().to_path_buf());
    }
    let dir = tempfile::tempdir()?;
    // The preset's own batch (RL settings, unused here): a tree preset refuses another group
    // size than its leaves per prompt.
    let mut sets = tiny_world();
    sets.extend(ROOM.map(String::from));
    sets.extend(["sft.steps=300".to_string(), "sft.batch_size=8".to_string()]);
    // The warm start needs no judge (mt-ppo-judge would serve SmolLM2 for it).
    sets.push("judge.enabled=false".into());
    let cfg = TrainConfig::resolve(Some(preset), None, &sets)?;
    let mut t = Trainer::new(cfg)?;
    t.warm_start(&mut |_, loss, _| assert!(loss.is_finite()))?;
    t.export(dir.path())?;
    let path = dir.path().to_path_buf();
    dirs.insert(key, dir);
    Ok(path)
}

/// The tiny world and model of `common::tiny_overrides`, without its update structure (its
/// prompts per step, group size and mini-batch), which each preset brings itself here.
fn tiny_world() -> Vec<String> {
    const STRUCTURE: [&str; 3] = [
        "rollout.prompts_per_step=",
        "rollout.group_size=",
        "optim.mini_batch_size=",
    ];
    tiny_overrides()
        .into_iter()
        .filter(|s| !STRUCTURE.iter().any(|k| s.starts_with(k)))
        .collect()
}

/// The preset's batch scaled down (fewer prompts per step, the mini-batch in the same
/// proportion) so that its update structure, `TrainConfig::update_structure()` (optimizer steps
/// per batch, off-policy steps), equals the unscaled preset's: the smallest prompt count from 2
/// at which the rounded mini-batch gives the same structure. `full` is the preset as shipped.
/// Returns the overrides and the structure.
fn scaled_batch(name: &str, full: &TrainConfig) -> anyhow::Result<(Vec<String>, (usize, usize))> {
    let want = full.update_structure();
    let (p0, m0) = (full.rollout.prompts_per_step, full.optim.mini_batch_size);
    for p in 2..=p0 {
        // m0 · p / p0, rounded (0 stays 0: the whole batch).
        let m = if m0 == 0 {
            0
        } else {
            ((2 * m0 * p + p0) / (2 * p0)).max(1)
        };
        let sets = vec![
            format!("rollout.prompts_per_step={p}"),
            format!("optim.mini_batch_size={m}"),
        ];
        let mut scaled = full.clone();
        scaled.rollout.prompts_per_step = p;
        scaled.optim.mini_batch_size = m;
        if scaled.update_structure() == want {
            return Ok((sets, want));
        }
    }
    anyhow::bail!("{name}: no smaller batch keeps its update structure {want:?}")
}

/// One preset's run: its resolved settings, the trainer after the steps, each step's output.
struct Run {
    cfg: TrainConfig,
    trainer: Trainer,
    steps: Vec<turnwise::trainer::StepOutput>,
}

impl Run {
    fn metrics(&self) -> Vec<BTreeMap<String, f64>> {
        self.steps.iter().map(|o| o.metrics.clone()).collect()
    }
}

/// `steps` RL steps of preset `name` with its own settings, as shipped but for the size of the
/// world, the model and the batch: its own group size (tree presets: their own leaves per
/// prompt), lr, epochs and loss; fewer prompts per step and the mini-batch scaled with them, so
/// that its update structure is the preset's own ([`scaled_batch`], asserted). From the shared
/// warm start of its agent format. `extra` overrides apply to the preset as shipped (to break a
/// mechanism on purpose, or to build a base to compare with). No metric may be NaN.
fn run_preset(name: &str, steps: usize, extra: &[&str]) -> anyhow::Result<Run> {
    let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    let full = TrainConfig::resolve(Some(name), None, &extra)?;
    let (scaled, structure) = scaled_batch(name, &full)?;
    let mut sets = tiny_world();
    sets.extend(ROOM.map(String::from));
    // Kept until the run ends: mt-ppo-judge's judge.
    let _judge_dir = if name == "mt-ppo-judge" {
        common::install_policy_host();
        // SmolLM2 would judge in seconds per rollout: the tiny GGUF fixture stands in, its
        // context raised from 256 to 8192 tokens (its RoPE positions are computed) so that the
        // rubric prompt fits, as tests/judge_rewards.rs does; in the preset's choice mode every
        // verdict then parses.
        let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../turnwise-model/src/checkpoint/fixtures/gguf/tiny-llama.gguf");
        let mut bytes = std::fs::read(fixture)?;
        let key = b"llama.context_length";
        let at = bytes
            .windows(key.len())
            .position(|w| w == key)
            .ok_or_else(|| anyhow::anyhow!("no context length in the fixture"))?
            + key.len();
        anyhow::ensure!(bytes[at + 4..at + 8] == 256u32.to_le_bytes());
        bytes[at + 4..at + 8].copy_from_slice(&8192u32.to_le_bytes());
        let dir = tempfile::tempdir()?;
        let gguf = dir.path().join("tiny-llama-8k.gguf");
        std::fs::write(&gguf, bytes)?;
        sets.push(format!("judge.serve=\"{}\"", gguf.display()));
        Some(dir)
    } else {
        None
    };
    sets.extend(extra);
    sets.extend(scaled);
    sets.push(format!(
        "model.init_from=\"{}\"",
        shared_warm_start(name)?.display()
    ));
    sets.push("sft.steps=0".into());
    let cfg = TrainConfig::resolve(Some(name), None, &sets)?;
    // The preset's own update: structure, group, lr, epochs, loss and samples.
    anyhow::ensure!(
        cfg.update_structure() == structure,
        "update structure {:?}, the preset's own is {structure:?}",
        cfg.update_structure()
    );
    anyhow::ensure!(
        cfg.rollout.group_size == full.rollout.group_size,
        "group size"
    );
    anyhow::ensure!(cfg.optim.lr == full.optim.lr, "lr {}", cfg.optim.lr);
    anyhow::ensure!(cfg.optim.ppo_epochs == full.optim.ppo_epochs, "epochs");
    anyhow::ensure!(cfg.optim.samples == full.optim.samples, "samples");
    // Dr.GRPO's constant K is the response budget, scaled with the world (ROOM).
    let mut own_actor = full.actor.clone();
    if own_actor.policy.loss_scale_factor == Some(full.rollout.max_response_tokens as f64) {
        own_actor.policy.loss_scale_factor = Some(cfg.rollout.max_response_tokens as f64);
    }
    anyhow::ensure!(cfg.actor == own_actor, "actor loss settings");
    anyhow::ensure!(cfg.advantage == full.advantage, "advantage settings");
    let mut t = Trainer::new(cfg.clone())?;
    t.freeze_reference()?;
    let mut out = Vec::new();
    for _ in 0..steps {
        let o = t.rl_step()?;
        anyhow::ensure!(!o.episodes.is_empty(), "no episodes");
        for (k, v) in &o.metrics {
            anyhow::ensure!(!v.is_nan(), "{k} is NaN");
        }
        out.push(o);
    }
    Ok(Run {
        cfg,
        trainer: t,
        steps: out,
    })
}

type Steps = [BTreeMap<String, f64>];

/// `key` of step `m`, or an error naming the missing metric.
fn get(m: &BTreeMap<String, f64>, key: &str) -> anyhow::Result<f64> {
    m.get(key)
        .copied()
        .ok_or_else(|| anyhow::anyhow!("metric {key} is missing"))
}

/// Some step satisfies `f` on `key`.
fn some(steps: &Steps, key: &str, f: impl Fn(f64) -> bool) -> anyhow::Result<()> {
    let v: Vec<f64> = steps
        .iter()
        .map(|m| get(m, key))
        .collect::<anyhow::Result<_>>()?;
    anyhow::ensure!(v.iter().any(|&x| f(x)), "no step shows it in {key}: {v:?}");
    Ok(())
}

/// Every step satisfies `f` on `key`.
fn every(steps: &Steps, key: &str, f: impl Fn(f64) -> bool) -> anyhow::Result<()> {
    let v: Vec<f64> = steps
        .iter()
        .map(|m| get(m, key))
        .collect::<anyhow::Result<_>>()?;
    anyhow::ensure!(v.iter().all(|&x| f(x)), "a step breaks it in {key}: {v:?}");
    Ok(())
}

/// Every step's optimizer steps are `ceil(train rows / mini-batch) · epochs`, none skipped.
/// With trajectory rows and no DAPO filter the batch is the nominal one, so the count is the
/// preset's own [`TrainConfig::update_structure`]; with step samples (gigpo, t2po) it is at
/// least that. Returns each step's count.
fn optimizer_steps(run: &Run) -> anyhow::Result<Vec<usize>> {
    let o = &run.cfg.optim;
    let (own, _) = run.cfg.update_structure();
    let nominal = run.cfg.rollout.prompts_per_step * run.cfg.rollout.group_size;
    let mut out = Vec::new();
    for (i, o2) in run.steps.iter().enumerate() {
        let m = &o2.metrics;
        let rows = get(m, "batch/train_rows")? as usize;
        let mini = match o.mini_batch_size {
            0 => rows,
            k => k.min(rows),
        };
        let want = rows.div_ceil(mini.max(1)) * o.ppo_epochs;
        // A batch DAPO's filter left empty trains nothing and logs no update.
        let got = match rows {
            0 => m.get("actor/optimizer_steps").copied().unwrap_or(0.0),
            _ => get(m, "actor/optimizer_steps")?,
        };
        anyhow::ensure!(
            got == want as f64,
            "step {}: {got} optimizer steps, expected {want} ({rows} rows, mini-batch {}, {} epochs)",
            i + 1,
            o.mini_batch_size,
            o.ppo_epochs
        );
        anyhow::ensure!(
            m.get("actor/skipped_updates").copied().unwrap_or(0.0) == 0.0,
            "step {}: skipped updates",
            i + 1
        );
        if o.samples == TrainSamples::Trajectory && !run.cfg.rollout.filter_zero_variance_groups {
            anyhow::ensure!(rows == nominal, "step {}: {rows} rows of {nominal}", i + 1);
            anyhow::ensure!(
                want == own,
                "step {}: {want} optimizer steps, own {own}",
                i + 1
            );
        } else if o.samples == TrainSamples::Step {
            // At least one step sample per rollout.
            anyhow::ensure!(
                want >= own,
                "step {}: {want} optimizer steps < {own}",
                i + 1
            );
        }
        out.push(want);
    }
    Ok(out)
}

/// (token-weighted mean, max, min) over the loss tokens of one batch of outcome-only group
/// advantages under `estimator`, from each episode's score, prompt group and loss tokens:
/// `grpo` (s − mean)/(std + 1e-6) with the unbiased std, `dr_grpo` s − mean, `rloo`
/// s − mean of the others (groups of at least 2).
fn outcome_stats(groups: &BTreeMap<&str, Vec<(f64, f64)>>, estimator: &str) -> (f64, f64, f64) {
    let (mut sum, mut tokens) = (0.0, 0.0);
    let (mut max, mut min) = (f64::NEG_INFINITY, f64::INFINITY);
    for members in groups.values() {
        let n = members.len() as f64;
        let mean = members.iter().map(|m| m.0).sum::<f64>() / n;
        let var = members.iter().map(|m| (m.0 - mean).powi(2)).sum::<f64>() / (n - 1.0);
        for &(s, t) in members {
            let a = match estimator {
                "grpo" => (s - mean) / (var.sqrt() + 1e-6),
                "dr_grpo" => s - mean,
                _ => s - (n * mean - s) / (n - 1.0),
            };
            if t > 0.0 {
                sum += a * t;
                tokens += t;
                max = max.max(a);
                min = min.min(a);
            }
        }
    }
    (sum / tokens.max(1.0), max, min)
}

/// The trainer's advantages (`critic/advantages/{mean,max,min}` over the loss tokens) on each
/// step's batch are those `own` (grpo, dr_grpo or rloo) gives on the step's scores and groups,
/// and on some step's batch they differ from what the other two would give.
fn outcome_advantages(run: &Run, own: &str) -> anyhow::Result<()> {
    let close = |a: (f64, f64, f64), b: (f64, f64, f64)| {
        let c = |x: f64, y: f64| (x - y).abs() <= 1e-6 * x.abs().max(1.0);
        c(a.0, b.0) && c(a.1, b.1) && c(a.2, b.2)
    };
    let mut telling = 0;
    for (i, o) in run.steps.iter().enumerate() {
        let mut groups: BTreeMap<&str, Vec<(f64, f64)>> = BTreeMap::new();
        for e in &o.episodes {
            let t = &e.trajectory;
            let score = t
                .outcome_reward
                .ok_or_else(|| anyhow::anyhow!("{} has no score", t.id))?;
            let row = Row::from_trajectory(t, run.cfg.rollout.train_on_forced);
            let tokens: f64 = row.loss_mask.iter().map(|&m| f64::from(m)).sum();
            groups
                .entry(t.prompt_uid.as_str())
                .or_default()
                .push((score, tokens));
        }
        anyhow::ensure!(groups.values().all(|g| g.len() >= 2), "a singleton group");
        let m = &o.metrics;
        let trainer = (
            get(m, "critic/advantages/mean")?,
            get(m, "critic/advantages/max")?,
            get(m, "critic/advantages/min")?,
        );
        let mine = outcome_stats(&groups, own);
        anyhow::ensure!(
            close(trainer, mine),
            "step {}: the trainer's advantages (mean, max, min) {trainer:?} are not {own}'s {mine:?}",
            i + 1
        );
        if ["grpo", "dr_grpo", "rloo"]
            .iter()
            .filter(|&&e| e != own)
            .all(|e| !close(outcome_stats(&groups, e), mine))
        {
            telling += 1;
        }
    }
    anyhow::ensure!(
        telling > 0,
        "no step's batch tells {own} from the other outcome estimators (no informative group)"
    );
    Ok(())
}

/// GSPO's sequence-level ratio: on the last step's rollouts, with their sampled log-probs as the
/// behaviour policy and the trainer's updated policy, the loss the preset configures clips one
/// ratio per row (the same value on every loss token of a row), and the update moved them.
fn one_ratio_per_row(run: &Run) -> anyhow::Result<()> {
    use candle_core::Tensor;
    use turnwise_model::loss::policy::{PolicyLossInput, compute_policy_loss};
    let t = &run.trainer;
    let forced = run.cfg.rollout.train_on_forced;
    let episodes = &run.steps.last().expect("a step").episodes;
    let rows: Vec<Row> = episodes
        .iter()
        .map(|e| {
            let mut r = Row::from_trajectory(&e.trajectory, forced);
            r.advantages = r.loss_mask.iter().map(|&m| f32::from(m)).collect();
            r
        })
        .collect();
    let refs: Vec<&Row> = rows.iter().collect();
    let device = t.policy.device();
    let packed = pack(&refs, device)?;
    let l = packed.response_width;
    let grid = |v: &[Vec<f32>]| -> anyhow::Result<Tensor> {
        let mut flat = vec![0f32; v.len() * l];
        for (i, r) in v.iter().enumerate() {
            flat[i * l..i * l + r.len()].copy_from_slice(r);
        }
        Ok(Tensor::from_vec(flat, (v.len(), l), device)?)
    };
    let new = logprobs_no_grad(&t.policy, &rows, run.cfg.rollout.temperature, 64)?;
    let old: Vec<Vec<f32>> = episodes
        .iter()
        .map(|e| e.trajectory.flatten(forced).logprobs)
        .collect();
    let (new, old) = (grid(&new)?, grid(&old)?);
    let input = PolicyLossInput::new(&new, &old, &packed.advantages, &packed.loss_mask)
        .with_turn_id(&packed.turn_id);
    let out = compute_policy_loss(&input, &run.cfg.actor.policy)?;
    let ratio = out.ratio.to_vec2::<f32>()?;
    let mask = packed.loss_mask.to_vec2::<f32>()?;
    let mut per_row = Vec::new();
    for (i, (r, m)) in ratio.iter().zip(&mask).enumerate() {
        let v: Vec<f32> = r
            .iter()
            .zip(m)
            .filter(|(_, m)| **m > 0.0)
            .map(|(x, _)| *x)
            .collect();
        if v.is_empty() {
            continue;
        }
        let (lo, hi) = v
            .iter()
            .fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
        anyhow::ensure!(
            hi - lo <= 1e-6 * hi.abs().max(1.0),
            "row {i}: {} loss tokens with ratios from {lo} to {hi}, not one sequence ratio",
            v.len()
        );
        per_row.push(lo);
    }
    anyhow::ensure!(
        per_row.iter().any(|r| (r - 1.0).abs() > 1e-4),
        "every sequence ratio is 1 (the update did not move the policy): {per_row:?}"
    );
    Ok(())
}

/// AT2PO's forks are chosen by entropy, not at random: on a fresh batch of the trained policy,
/// in every tree and expansion iteration, the forked nodes' scores (entropy minus the branching
/// penalty for the siblings they had then) are the top `tree_forks` of the candidates then
/// (the non-leaf nodes, root included, that existed before the iteration: the fork records say
/// which nodes each iteration created). Returns how many iterations had more candidates than
/// forks (where a random choice would show).
fn entropy_chosen_forks(run: &mut Run) -> anyhow::Result<usize> {
    let rc = run.cfg.rollout.clone();
    let (k, iterations, alpha) = (rc.tree_forks, rc.tree_iterations, rc.tree_branch_penalty);
    let (batch, _, _) = run.trainer.sample_batch()?;
    let tb = batch
        .trees
        .ok_or_else(|| anyhow::anyhow!("no trees in the batch"))?;
    anyhow::ensure!(
        tb.forks.len() == tb.trees.len() * k * iterations,
        "{} forks for {} trees",
        tb.forks.len(),
        tb.trees.len()
    );
    let mut choices = 0;
    for (ti, tree) in tb.trees.iter().enumerate() {
        let forks: Vec<_> = tb.forks.iter().filter(|f| f.tree == ti).collect();
        let n = tree.nodes.len();
        // The iteration that created each node (0: the initial chains); parents come first.
        let mut fork_of = vec![None; n];
        for (j, f) in forks.iter().enumerate() {
            let node = f.node.ok_or_else(|| anyhow::anyhow!("a pruned fork"))?;
            fork_of[node] = Some(j / k + 1);
        }
        let mut created = vec![0usize; n];
        for i in 0..n {
            created[i] = match (fork_of[i], tree.nodes[i].parent) {
                (Some(it), _) => it,
                (None, Some(p)) => created[p],
                (None, None) => 0,
            };
        }
        for it in 1..=iterations {
            let children = |p: usize| {
                (0..n)
                    .filter(|&c| tree.nodes[c].parent == Some(p) && created[c] < it)
                    .count()
            };
            let score = |i: usize| {
                let node = &tree.nodes[i];
                let siblings = children(node.parent.unwrap_or(i));
                node.entropy - alpha * siblings.saturating_sub(1) as f64
            };
            let mut ranked: Vec<f64> = (0..n)
                .filter(|&i| created[i] < it && !tree.nodes[i].is_leaf)
                .map(score)
                .collect();
            ranked.sort_by(|a, b| b.total_cmp(a));
            let top: Vec<f64> = ranked.iter().cycle().take(k).copied().collect();
            let mut picked = Vec::new();
            for f in &forks[(it - 1) * k..it * k] {
                let s = f.selected.ok_or_else(|| anyhow::anyhow!("a pruned pick"))?;
                anyhow::ensure!(
                    (f.entropy - tree.nodes[s].entropy).abs() < 1e-12,
                    "tree {ti}: a fork's recorded entropy is not its node's"
                );
                picked.push(score(s));
            }
            picked.sort_by(|a, b| b.total_cmp(a));
            anyhow::ensure!(
                picked.iter().zip(&top).all(|(a, b)| (a - b).abs() < 1e-12),
                "tree {ti}, iteration {it}: forked nodes scored {picked:?}, the top {k} of the \
                 candidates' {ranked:?} are {top:?}"
            );
            if ranked.len() > k {
                choices += 1;
            }
        }
    }
    Ok(choices)
}

/// The trainable weights of `t`, by name.
fn weights(t: &Trainer) -> BTreeMap<String, Vec<f32>> {
    turnwise_model::model::transformer::varmap_tensors(&t.varmap, true)
        .into_iter()
        .map(|(k, v)| (k, v.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

/// The clipping-bias variant `variant` against `base` at the variant's own settings: the two
/// differ only in the correction (the settings are equal but for the loss, whose resolved clip,
/// aggregation and ratio form are equal), and both ran from the shared warm start with the same
/// seed, so the first on-policy mini-batch is the same. The mean weight s̄ is in (0, 1] (the
/// correction never up-weights). The variant's off-policy mini-batches must have clipped some
/// token (else the comparison shows nothing, and fails: review F m10), the correction
/// down-weighted those rows (s̄ < 1 in an off-policy mini-batch) and the weights after the run
/// differ from the base's.
fn against_base(variant: &Run, base: &Run) -> anyhow::Result<()> {
    let strip = |c: &TrainConfig| {
        let mut v = serde_json::to_value(c).expect("a config serialises");
        v["actor"]["policy"] = serde_json::Value::Null;
        v["description"] = serde_json::Value::Null;
        v["papers"] = serde_json::Value::Null;
        v["preset"] = serde_json::Value::Null;
        v
    };
    let (sv, sb) = (strip(&variant.cfg), strip(&base.cfg));
    if sv != sb {
        let keys: Vec<&String> = sv
            .as_object()
            .expect("a table")
            .iter()
            .filter(|(k, v)| sb.get(k.as_str()) != Some(v))
            .map(|(k, _)| k)
            .collect();
        anyhow::bail!("the base differs in more than the loss: {keys:?}");
    }
    let (rv, rb) = (
        variant.cfg.actor.policy.resolve()?,
        base.cfg.actor.policy.resolve()?,
    );
    anyhow::ensure!(
        rv.clip_bias.is_some() && rb.clip_bias.is_none(),
        "correction"
    );
    anyhow::ensure!(
        (
            rv.clip_low,
            rv.clip_high,
            rv.clip_ratio_c,
            rv.agg_mode,
            rv.ratio_form
        ) == (
            rb.clip_low,
            rb.clip_high,
            rb.clip_ratio_c,
            rb.agg_mode,
            rb.ratio_form
        ),
        "the base's loss differs in more than the correction"
    );
    let s = variant.metrics();
    every(&s, "actor/clip_bias_scale", |x| x > 0.0 && x <= 1.0)?;
    let clipped: f64 = s
        .iter()
        .map(|m| get(m, "actor/clip_bias_num_clipped"))
        .sum::<anyhow::Result<f64>>()?;
    let (wv, wb) = (weights(&variant.trainer), weights(&base.trainer));
    let moved = wv
        .iter()
        .flat_map(|(k, v)| v.iter().zip(&wb[k]).map(|(x, y)| (x - y).abs()))
        .fold(0f32, f32::max);
    anyhow::ensure!(
        clipped > 0.0,
        "no off-policy mini-batch clipped a token in {} steps: nothing for the correction to \
         act on, so this comparison would show nothing",
        s.len()
    );
    // An off-policy mini-batch without a row to weight (all advantages 0) logs no s̄.
    let offpolicy: Vec<f64> = s
        .iter()
        .filter_map(|m| m.get("actor/clip_bias_scale_offpolicy").copied())
        .collect();
    anyhow::ensure!(
        offpolicy.iter().any(|&x| x < 1.0),
        "clipped tokens, but no off-policy mini-batch was down-weighted: {offpolicy:?}"
    );
    anyhow::ensure!(
        moved > 0.0,
        "clipped tokens, but the weights equal the base's"
    );
    Ok(())
}

/// DAPO's decoupled clip at the trainer level (review E, R9: setting `clip_ratio_high = 0.2`
/// passed every trainer-level test): `dapo` against the same run with a symmetric ε_high = 0.2.
/// The two are identical up to the first step with an off-policy mini-batch (the ratios of an
/// on-policy mini-batch are 1, inside either clip); in that step's later mini-batches the same
/// ratios meet the two upper bounds, so a token with A > 0 and ratio in (1.2, 1.28] is clipped by
/// the symmetric run only: its upper clip fraction must be the larger, and the weights differ.
fn decoupled_clip_binds_later(dapo: &Run, symmetric: &Run) -> anyhow::Result<()> {
    let (sd, ss) = (dapo.metrics(), symmetric.metrics());
    let first = sd
        .iter()
        .position(|m| m.get("actor/optimizer_steps").is_some_and(|&n| n > 1.0))
        .ok_or_else(|| anyhow::anyhow!("no dapo step had an off-policy mini-batch"))?;
    for (i, (a, b)) in sd.iter().zip(&ss).take(first).enumerate() {
        for key in ["actor/pg_loss", "batch/train_rows"] {
            anyhow::ensure!(
                a.get(key) == b.get(key),
                "step {}: {key} differs before any off-policy mini-batch",
                i + 1
            );
        }
    }
    let high = |m: &BTreeMap<String, f64>| get(m, "actor/pg_clipfrac_high");
    let (hd, hs) = (high(&sd[first])?, high(&ss[first])?);
    anyhow::ensure!(
        hs > hd,
        "step {}: the upper clip fraction at ε_high 0.2 ({hs}) is not above dapo's at 0.28 \
         ({hd}): no token with a ratio in (1.2, 1.28] and A > 0 tells the two clips apart",
        first + 1
    );
    anyhow::ensure!(
        weights(&dapo.trainer) != weights(&symmetric.trainer),
        "the weights equal the symmetric clip's"
    );
    Ok(())
}

/// What only preset `name` does, shown on its run at its own settings (tiny world and model,
/// the warm start of its agent format, whole turns). The optimizer steps of every preset are
/// checked first ([`optimizer_steps`]).
fn signature(name: &str, run: &mut Run) -> anyhow::Result<()> {
    let pos = |x: f64| x > 0.0;
    let counts = optimizer_steps(run)?;
    let s = &run.metrics();
    let prompts = run.cfg.rollout.prompts_per_step as f64;
    // No preset but DAPO filters groups.
    if name != "dapo" {
        every(s, "batch/filtered_groups", |x| x == 0.0)?;
    }
    match name {
        "grpo" => {
            outcome_advantages(run, "grpo")?;
            // The KL to the reference is 0 until the first update moves the policy (a step
            // whose second mini-batch is off the behaviour policy: ppo_kl != 0), and > 0 in
            // that step (its later mini-batch) and every step after.
            let first = s
                .iter()
                .position(|m| m.get("actor/ppo_kl").is_some_and(|&x| x != 0.0))
                .ok_or_else(|| anyhow::anyhow!("no update moved the policy"))?;
            every(&s[first..], "actor/kl_loss", pos)?;
        }
        "dr-grpo" => {
            outcome_advantages(run, "dr_grpo")?;
            // Its second mini-batch is off-policy once a group carries signal.
            some(s, "actor/ppo_kl", |x| x != 0.0)?;
        }
        "rloo" => {
            // The leave-one-out baseline on its own batch, not GRPO's or Dr.GRPO's.
            outcome_advantages(run, "rloo")?;
            some(s, "actor/ppo_kl", |x| x != 0.0)?;
        }
        "s-grpo" => {
            // Against GRPO's loss at its own settings: see outcome_group_presets_….
            outcome_advantages(run, "grpo")?;
            some(s, "actor/ppo_kl", |x| x != 0.0)?;
        }
        "gspo" => {
            outcome_advantages(run, "grpo")?;
            one_ratio_per_row(run)?;
            // Its 3e-4/4e-4 sequence clip binds on the off-policy mini-batches.
            every(s, "actor/pg_clipfrac", pos)?;
        }
        "dapo" => {
            // Dynamic sampling (the filter on accuracy itself is shown in tests/dapo.rs): every
            // generated group is kept as informative or filtered out, rounds are added only
            // while fewer than `prompts` groups are informative, at most max_num_gen_batches,
            // and the batch is the first `prompts` informative groups.
            let g = run.cfg.rollout.group_size as f64;
            let rounds = run.cfg.rollout.max_num_gen_batches as f64;
            for (i, m) in s.iter().enumerate() {
                let informative = get(m, "batch/informative_groups")?;
                let filtered = get(m, "batch/filtered_groups")?;
                let refills = get(m, "batch/refill_rounds")?;
                let rows = get(m, "batch/train_rows")?;
                anyhow::ensure!(
                    informative + filtered == (refills + 1.0) * prompts
                        && refills < rounds
                        && (refills + 1.0 == rounds || informative >= prompts)
                        && rows == informative.min(prompts) * g,
                    "step {}: {informative} informative and {filtered} filtered groups in \
                     {refills} refill rounds, {rows} rows",
                    i + 1
                );
            }
            some(s, "batch/filtered_groups", pos)?;
            some(s, "batch/train_rows", pos)?;
            some(s, "reward/overlong_penalty/mean", |x| x < 0.0)?;
        }
        "igpo" => {
            // One on-policy optimizer step per batch (checked above): every ratio is 1.
            anyhow::ensure!(counts.iter().all(|&c| c == 1), "{counts:?} optimizer steps");
            every(s, "actor/pg_clipfrac", |x| x == 0.0)?;
            every(s, "actor/ppo_kl", |x| x == 0.0)?;
            some(s, "info_gain/turn_0/mean", |x| x != 0.0)?;
        }
        "a2tgpo" => {
            some(s, "a2tgpo/clip_scale/max", |x| x > 1.0)?;
            some(s, "a2tgpo/clip_scale/min", |x| x < 1.0)?;
            some(s, "actor/pg_clipfrac_high", pos)?;
            some(s, "actor/pg_clipfrac_low", pos)?;
        }
        "at2po" => {
            every(s, "tree/leaves", |x| x == 8.0)?;
            some(s, "tree/node_value/abs_mean", pos)?;
            some(s, "actor/pg_clipfrac", pos)?;
            let choices = entropy_chosen_forks(run)?;
            anyhow::ensure!(choices > 0, "no iteration had more candidates than forks");
        }
        "tree-grpo" => {
            every(s, "tree/leaves", |x| x == 6.0)?;
            every(s, "tree/labels_per_group", |x| x == 2.0)?;
            every(s, "actor/kl_loss", pos)?;
        }
        "ppo" | "turn-ppo" | "s-ppo" | "st-ppo" | "mt-ppo" => {
            every(s, "actor/reward_kl_penalty_coeff", |x| x == 0.001)?;
            some(s, "actor/reward_kl_penalty", pos)?;
            every(s, "critic/vf_explained_var", f64::is_finite)?;
            // The second of its two mini-batches is off-policy.
            every(s, "actor/ppo_kl", |x| x != 0.0)?;
            if name == "mt-ppo" {
                some(s, "mt_ppo/turn_rewards_placed", pos)?;
            }
        }
        "mt-ppo-judge" => {
            // Judged by the tiny GGUF fixture with a long context (see run_preset): every
            // rollout of every step is judged, none falls back to the rules.
            every(s, "judge/episodes", pos)?;
            every(s, "judge/failures", |x| x == 0.0)?;
            every(s, "judge/requests", pos)?;
            every(s, "critic/vf_explained_var", f64::is_finite)?;
        }
        "mt-grpo" => {
            // Each prompt's rollouts are regrouped per turn: more groups than prompts.
            every(s, "mt_grpo/turn_group/groups", |x| x > prompts)?;
            // Its second epoch over the batch is off-policy.
            every(s, "actor/ppo_kl", |x| x != 0.0)?;
        }
        "gigpo" | "t2po" => {
            // verl-agent's step samples: more rows than rollouts, mini-batches of step
            // samples (the counts checked above), the later ones off-policy.
            for m in s {
                let (train, traj) = (
                    get(m, "batch/train_rows")?,
                    get(m, "batch/trajectory_rows")?,
                );
                anyhow::ensure!(train > traj, "{train} step samples of {traj} rollouts");
            }
            anyhow::ensure!(counts.iter().all(|&c| c >= 2), "{counts:?} optimizer steps");
            every(s, "actor/ppo_kl", |x| x != 0.0)?;
            // A prompt's rollouts share the first anchor state.
            every(s, "gigpo/anchor_group/group_size/mean", |x| x > 1.0)?;
            some(s, "gigpo/anchor_group/singleton_share", |x| x < 1.0)?;
            some(s, "gigpo/penalised_steps", pos)?;
            if name == "gigpo" {
                every(s, "actor/kl_loss", pos)?;
            }
            if name == "t2po" {
                some(s, "rollout/tds_regenerations", pos)?;
                // TDS selects (review F C1): some eligible turn is accepted on its first
                // draw, and not every one spends the budget.
                some(s, "rollout/tds_accepted_first_share", pos)?;
                every(s, "rollout/tds_budget_exhausted_share", |x| x < 1.0)?;
            }
        }
        other => anyhow::bail!("{other} has no signature"),
    }
    Ok(())
}

/// The presets of each family test; together every preset, once.
const OUTCOME: [&str; 6] = ["grpo", "dr-grpo", "rloo", "gspo", "dapo", "s-grpo"];
const PPO: [&str; 6] = [
    "ppo",
    "s-ppo",
    "turn-ppo",
    "st-ppo",
    "mt-ppo",
    "mt-ppo-judge",
];
const TURN_CREDIT: [&str; 5] = ["igpo", "a2tgpo", "mt-grpo", "gigpo", "t2po"];
const TREES: [&str; 2] = ["at2po", "tree-grpo"];

/// Runs each of `names` for `steps` steps (its own settings, [`run_preset`]) and checks its
/// signature; a failure is named in `failures`. Returns the runs.
fn run_and_check(
    names: &[&str],
    steps: usize,
    failures: &mut Vec<String>,
) -> BTreeMap<String, Run> {
    let mut runs = BTreeMap::new();
    for &name in names {
        let t0 = std::time::Instant::now();
        // DAPO trains only on groups whose accuracy differs, rare on the tiny model: more
        // steps (a step costs seconds), so that some step trains.
        // mt-ppo-judge: one step, its judge's verdicts take minutes of CPU per step.
        let steps = match name {
            "dapo" => 2 * steps,
            "mt-ppo-judge" => 1,
            _ => steps,
        };
        let result = run_preset(name, steps, &[]).and_then(|mut run| {
            if std::env::var_os("SIGNATURE_DUMP").is_some() {
                eprintln!("== {name}: {:#?}", run.metrics());
            }
            let checked = signature(name, &mut run);
            runs.insert(name.to_string(), run);
            checked
        });
        eprintln!("{name}: {:.0} s", t0.elapsed().as_secs_f64());
        if let Err(e) = result {
            failures.push(format!("{name}: {e:#}"));
        }
    }
    runs
}

fn assert_none(failures: &[String]) {
    assert!(
        failures.is_empty(),
        "presets failed:\n{}",
        failures.join("\n")
    );
}

#[test]
fn every_preset_is_checked_once() {
    let mut checked: Vec<&str> = [&OUTCOME[..], &PPO, &TURN_CREDIT, &TREES].concat();
    checked.sort_unstable();
    let mut all = presets::names();
    all.sort_unstable();
    assert_eq!(checked, all);
}

/// The outcome-only group presets; S-GRPO against GRPO's loss at S-GRPO's own settings.
#[test]
fn outcome_group_presets_run_with_their_own_settings() {
    let mut failures = Vec::new();
    // Several steps: the tiny model ties every outcome of a group in many steps.
    let runs = run_and_check(&OUTCOME, 3, &mut failures);
    if let Some(dapo) = runs.get("dapo") {
        let steps = dapo.metrics().len();
        let r = run_preset("dapo", steps, &["actor.policy.clip_ratio_high=0.2"])
            .and_then(|symmetric| decoupled_clip_binds_later(dapo, &symmetric));
        if let Err(e) = r {
            failures.push(format!("dapo against a symmetric clip: {e:#}"));
        }
    }
    if let Some(variant) = runs.get("s-grpo") {
        let r = run_preset("s-grpo", 3, &["actor.policy.policy_loss=\"vanilla\""])
            .and_then(|base| against_base(variant, &base));
        if let Err(e) = r {
            failures.push(format!("s-grpo against grpo's loss: {e:#}"));
        }
    }
    assert_none(&failures);
}

/// The PPO family; S-PPO against PPO and ST-PPO against Turn-PPO.
#[test]
fn ppo_presets_run_with_their_own_settings() {
    let mut failures = Vec::new();
    let runs = run_and_check(&PPO, 2, &mut failures);
    for (variant, base) in [("s-ppo", "ppo"), ("st-ppo", "turn-ppo")] {
        if let (Some(v), Some(b)) = (runs.get(variant), runs.get(base))
            && let Err(e) = against_base(v, b)
        {
            failures.push(format!("{variant} against {base}: {e:#}"));
        }
    }
    assert_none(&failures);
}

/// The presets with turn-level credit (information gain, turn groups, anchor states).
#[test]
fn turn_credit_presets_run_with_their_own_settings() {
    let mut failures = Vec::new();
    run_and_check(&TURN_CREDIT, 2, &mut failures);
    assert_none(&failures);
}

/// The tree presets, with their own leaves per prompt.
#[test]
fn tree_presets_run_with_their_own_settings() {
    let mut failures = Vec::new();
    run_and_check(&TREES, 2, &mut failures);
    assert_none(&failures);
}

/// The trainer's recomputed log-probs of the sampled tokens equal the sampler's (the response
/// columns of the packed batch line up with the tokens), so PPO ratios start at exactly 1.
#[test]
fn recomputed_logprobs_match_the_sampled_ones() {
    use turnwise::update::logprobs_no_grad;

    let cfg = TrainConfig::resolve(Some("grpo"), None, &tiny_overrides()).unwrap();
    let mut t = Trainer::new(cfg).unwrap();
    t.warm_start(&mut |_, _, _| {}).unwrap();
    let rows = common::sampled_rows(&t, 6);
    let lp = logprobs_no_grad(&t.sampler, &rows, 1.0, 4).unwrap();
    let mut checked = 0;
    for (i, (row, l)) in rows.iter().zip(&lp).enumerate() {
        for (k, (&m, &recomputed)) in row.loss_mask.iter().zip(l.iter()).enumerate() {
            if m == 1 {
                let sampled = row.sampled_logprobs[k];
                assert!(
                    (sampled - recomputed).abs() < 1e-3,
                    "token {k} of episode e{i}: sampled {sampled} vs recomputed {recomputed}"
                );
                checked += 1;
            }
        }
    }
    assert!(checked > 20);
}

/// Every preset as shipped trains the same with its shared prefixes computed once
/// (`optim.share_prefix`, on by default: the G rollouts of a prompt, a tree's branches and a
/// trajectory's step samples run what they share forward and backward once) as with every row
/// run whole. Both run in lockstep from the shared warm start, step by step until a step moves
/// the weights (the tiny model ties every outcome of a group in some steps; until a step moves
/// them the two runs are the same, so their rollouts are too). After that step, every
/// mini-batch at the preset's own settings with its clip and AdamW, the weights agree to within
/// 0.1 % of the step they took and the update's metrics to rounding; and where a shard holds
/// more than one row, the shared pass saved tokens (on two cores a mini-batch of two rows runs
/// one row per core: sharing would only serialise them). mt-ppo-judge is mt-ppo's update with
/// a judged reward (its judge costs minutes a step here): mt-ppo stands for it.
/// `actor/turn_kl_entropy` is left out: a ratio of log-ratio sums that are rounding noise while
/// the policy has not moved.
#[test]
fn shared_prefixes_train_every_preset_as_without() {
    let l2 = |a: &BTreeMap<String, Vec<f32>>, b: &BTreeMap<String, Vec<f32>>| -> f64 {
        a.iter()
            .flat_map(|(k, x)| x.iter().zip(&b[k]))
            .map(|(x, y)| f64::from(x - y).powi(2))
            .sum::<f64>()
            .sqrt()
    };
    let mut failures = Vec::new();
    for name in presets::names() {
        if name == "mt-ppo-judge" {
            continue;
        }
        let t0 = std::time::Instant::now();
        let checked = (|| -> anyhow::Result<String> {
            let mut shared = run_preset(name, 0, &[])?;
            let mut whole = run_preset(name, 0, &["optim.share_prefix=false"])?;
            let before = weights(&shared.trainer);
            let mut steps = 0;
            let (ms, mw, step) = loop {
                let (ms, mw) = (shared.trainer.rl_step()?, whole.trainer.rl_step()?);
                steps += 1;
                let step = l2(&before, &weights(&shared.trainer));
                if step > 0.0 || steps == 4 {
                    break (ms.metrics, mw.metrics, step);
                }
            };
            anyhow::ensure!(step > 0.0, "{steps} steps did not move the weights");
            let apart = l2(&weights(&shared.trainer), &weights(&whole.trainer));
            anyhow::ensure!(
                apart <= 1e-3 * step,
                "weights {apart:.3e} apart after a step of {step:.3e}"
            );
            let saved = ms.get("actor/shared_prefix_tokens").copied().unwrap_or(0.0);
            let mb = match shared.cfg.optim.mini_batch_size {
                0 => usize::MAX,
                m => m,
            };
            if mb / rayon::current_num_threads() >= 2 {
                anyhow::ensure!(saved > 0.0, "no shared prefix tokens: {saved}");
            }
            anyhow::ensure!(
                mw.get("actor/shared_prefix_tokens") == Some(&0.0),
                "the whole-row run shared tokens"
            );
            let mut worst = (0.0f64, String::new(), 0.0, 0.0);
            for (k, a) in &ms {
                let keep = k.starts_with("actor/") || k.starts_with("critic/");
                if !keep
                    || k.starts_with("actor/shared_prefix")
                    || k == "actor/turn_kl_entropy"
                    || !a.is_finite()
                {
                    continue;
                }
                let b = mw
                    .get(k)
                    .ok_or_else(|| anyhow::anyhow!("{k} only with sharing"))?;
                let d = (a - b).abs() / a.abs().max(b.abs()).max(1e-3);
                if d > worst.0 {
                    worst = (d, k.clone(), *a, *b);
                }
            }
            anyhow::ensure!(
                worst.0 <= 1e-3,
                "{} differs by {:.2e} ({} shared, {} whole)",
                worst.1,
                worst.0,
                worst.2,
                worst.3
            );
            Ok(format!(
                "step {steps}: weights {apart:.1e} apart / step {step:.1e}; {saved:.0} tokens \
                 shared per mini-batch ({:.0} %); worst metric {} at {:.1e}",
                100.0 * ms.get("actor/shared_prefix_frac").copied().unwrap_or(0.0),
                worst.1,
                worst.0
            ))
        })();
        match checked {
            Ok(line) => eprintln!("{name}: {line} [{:.0} s]", t0.elapsed().as_secs_f64()),
            Err(e) => failures.push(format!("{name}: {e:#}")),
        }
    }
    assert_none(&failures);
}
