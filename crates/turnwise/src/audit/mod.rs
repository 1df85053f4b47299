//! `turnwise credit-audit`: which turn earned the outcome, measured by executing replays, and
//! how well each advantage estimator's turn credit agrees with it.
//!
//! The data flow, one stage per step of [`audit`]:
//!
//! 1. **Panel.** The first `episodes` questions of a split; per question a group of `group`
//!    episodes sampled by the checkpoint's policy at the run's training temperature and
//!    sampling settings, from a fixed seed. The group's first episode is the audited one; the
//!    others are its group, as in a training step.
//! 2. **Replay** ([`replay`]). At each turn of each audited episode, `K` alternative turns
//!    sampled from the exact state (the prefix's cached keys and values, and the environment
//!    rebuilt by replaying the episode's actions: [`crate::rollout::EpisodeState::fork`]), the
//!    taken turn and each alternative rolled forward `M` times to the end: the replay
//!    advantage of the taken turn with its standard error. Its return is the run's reward
//!    score, the one the estimators read.
//! 3. **Estimators** ([`estimator_credit`]). Each estimator's per-turn advantage of the audited
//!    episodes, computed over the panel's groups exactly as a training step computes it
//!    ([`crate::trainer::advantage::compute`]): GRPO's broadcast, MT-GRPO's turn rewards,
//!    IGPO's and A2TGPO's information gain (the probes run here), GiGPO's anchor groups, PPO's
//!    GAE over the checkpoint's own trained critic (a run of the PPO family), and a seeded
//!    random baseline. An estimator the run cannot feed (a critic it does not have, a tree it
//!    did not grow) is listed as skipped, with the reason.
//! 4. **Scores** ([`score`]). Per estimator, Spearman's rank correlation with the replay
//!    advantage and the share of decisive turns whose sign it gets right, overall and per
//!    turn depth, with bootstrap intervals over episodes; and the realised decision density
//!    (the share of turns whose replay advantage is non-zero beyond twice its error).
//! 5. **Report** ([`report`]). `audit.md`, `audit.json` and `spearman_by_depth.svg` in the
//!    output folder.
//!
//! Cost: at most `episodes × turns × (K + 1) × M` rollouts, plus the `episodes × group`
//! episodes of the panel; all of them batched and sharing their prefixes' keys and values.

pub mod replay;
pub mod report;
pub mod score;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::{Context, Result};
use serde::Serialize;
use turnwise_core::advantage::Estimator;
use turnwise_core::control::SplitMix64;
use turnwise_core::trajectory::TurnAction;
use turnwise_env::env::Environment;
use turnwise_env::world::Split;

use crate::config::TrainConfig;
use crate::rollout::{Decoding, Episode, EpisodeSpec, EpisodeState, Policy, step_turn};
use crate::task::TaskSet;
use crate::trainer::Trainer;
use crate::trainer::sampling::ScoredEpisode;
use crate::update::Row;
use replay::{ReplaySettings, Replayer, TurnReplay};
use score::{Agreement, ScoredTurn};

/// The estimators the audit scores, by the preset whose `[advantage]` (and, for turn rewards,
/// `[reward]`) each one is computed with.
/// `ppo` (GAE over a critic's values) is scored when the audited checkpoint holds a trained
/// critic (a run of the PPO family), and listed as left out otherwise.
pub const ESTIMATOR_PRESETS: &[&str] =
    &["grpo", "rloo", "mt-grpo", "igpo", "a2tgpo", "gigpo", "ppo"];

/// The label of the seeded random baseline.
pub const RANDOM: &str = "random";

/// Settings of an audit.
#[derive(Debug, Clone, PartialEq)]
pub struct AuditSettings {
    /// The split the panel's questions come from.
    pub split: Split,
    /// Audited episodes (the first this many questions of the split).
    pub episodes: usize,
    /// Episodes per question (the audited one and its group), as `rollout.group_size`.
    pub group: usize,
    /// Alternatives, continuations, seed and chunk of the replay.
    pub replay: ReplaySettings,
    /// Bootstrap resamples of the intervals.
    pub bootstrap: usize,
}

impl AuditSettings {
    /// Checks the settings.
    pub fn validate(&self) -> Result<()> {
        self.replay.validate()?;
        anyhow::ensure!(self.episodes >= 1, "--episodes must be at least 1, got 0");
        anyhow::ensure!(
            self.group >= 2,
            "--group must be at least 2 (the estimators normalise within a group), got {}",
            self.group
        );
        anyhow::ensure!(self.bootstrap >= 1, "--bootstrap must be at least 1, got 0");
        Ok(())
    }
}

/// What `turnwise credit-audit` (and a study's `[[audit]]`) asks: [`AuditSettings`] with the
/// group left to the audited run's `rollout.group_size` when `None`.
#[derive(Debug, Clone, PartialEq)]
pub struct AuditRequest {
    /// The split the panel's questions come from.
    pub split: Split,
    /// Audited episodes.
    pub episodes: usize,
    /// Episodes per question; the run's `rollout.group_size` when `None`.
    pub group: Option<usize>,
    /// The replay's settings; a `chunk` of 0 is [`live_budget_chunk`]'s for the model.
    pub replay: ReplaySettings,
    /// Bootstrap resamples.
    pub bootstrap: usize,
}

/// The key-value cache a replay's live continuations may hold at once when the chunk is left
/// to the model: 2 GiB. (The SmolLM2-135M audit of results.md peaked at 13.6 GB with 256
/// continuations of 712 tokens at once, 8.4 GB of it their caches.)
pub const LIVE_KV_BUDGET: u64 = 2 << 30;

/// How many continuations a replay rolls at once for `model` when each may grow to
/// `max_tokens` tokens: as many as fit [`LIVE_KV_BUDGET`] of key-value cache (every layer's keys
/// and values, `dtype_bytes` each), at least 8 and at most 256.
pub fn live_budget_chunk(
    model: &turnwise_model::model::ModelConfig,
    max_tokens: usize,
    dtype_bytes: usize,
) -> usize {
    let per_token = 2
        * model.num_hidden_layers as u64
        * model.num_key_value_heads as u64
        * model.head_dim as u64
        * dtype_bytes as u64;
    let per_episode = (per_token * max_tokens as u64).max(1);
    (LIVE_KV_BUDGET / per_episode).clamp(8, 256) as usize
}

impl AuditRequest {
    /// The settings of an audit of a run whose `rollout.group_size` is `run_group`.
    pub fn settings(&self, run_group: usize) -> AuditSettings {
        AuditSettings {
            split: self.split,
            episodes: self.episodes,
            group: self.group.unwrap_or(run_group),
            replay: self.replay,
            bootstrap: self.bootstrap,
        }
    }
}

/// Audits the checkpoint of `source` (as `turnwise eval` opens it) and writes the report into
/// `out`, a folder turnwise owns ([`crate::ownership`]: an earlier audit's files there are
/// replaced only with `overwrite`, a folder of the user's holding one of [`report::FILES`] is
/// never written into). Returns the report and what was audited.
pub fn audit_into(
    source: &crate::checkpoints::EvalSource<'_>,
    request: &AuditRequest,
    out: &std::path::Path,
    overwrite: bool,
) -> Result<(AuditReport, String)> {
    // Refused before the audit runs: an existing report file there, unless overwriting what
    // turnwise wrote (its manifest says so).
    let prepared = crate::ownership::prepare(
        out,
        crate::ownership::Kind::Audit,
        &report::FILES,
        overwrite,
        true,
    )?;
    let (trainer, what) = crate::checkpoints::open_for_eval(source)?;
    let mut settings = request.settings(trainer.config.rollout.group_size);
    if settings.replay.chunk == 0 {
        // The longest an episode's context grows: its prompt (bounded by the rollout's own
        // budget for it) and every response and observation token.
        let cfg = &trainer.config;
        let max_tokens = (cfg.rollout.max_response_tokens + 512)
            .min(trainer.model_config.max_position_embeddings.max(1));
        let bytes = trainer.sampler.dtype().size_in_bytes();
        settings.replay.chunk = live_budget_chunk(&trainer.model_config, max_tokens, bytes);
        tracing::info!(
            chunk = settings.replay.chunk,
            max_tokens,
            "credit audit: continuations rolled at once (--max-live)"
        );
    }
    settings.validate()?;
    eprintln!("auditing {what}");
    let report = audit(&trainer, &what, &settings)?;
    let owner = prepared.clear()?;
    report::write(&report, out)?;
    if let Some(owner) = &owner {
        crate::ownership::note_outputs(owner, &report::FILES)?;
    }
    Ok((report, what))
}

/// The policy and environment of a checkpoint as the replay oracle drives them.
pub struct ModelReplayer<'a> {
    /// The policy (local sampling).
    pub policy: Policy<'a>,
    /// A fresh environment per fork.
    pub make_env: &'a dyn Fn() -> Result<Box<dyn Environment>>,
    /// The run's training sampling settings.
    pub decoding: Decoding,
    /// The return of a finished episode from its golden answers.
    pub score: &'a dyn Fn(&Episode, &[String]) -> Result<f64>,
}

impl Replayer for ModelReplayer<'_> {
    type State = EpisodeState;

    fn fork(&self, state: &EpisodeState, seed: u64) -> Result<EpisodeState> {
        let mut f = state.fork(&self.policy, (self.make_env)()?)?;
        f.set_seed(seed);
        Ok(f)
    }

    fn step(&self, states: &mut [&mut EpisodeState]) -> Result<()> {
        step_turn(&self.policy, states, &self.decoding)
    }

    fn is_done(&self, state: &EpisodeState) -> bool {
        state.is_done()
    }

    fn outcome(&self, state: EpisodeState) -> Result<f64> {
        let golds = state.task().answers.clone();
        (self.score)(&state.finish(), &golds)
    }
}

/// One audited turn with every estimator's credit.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AuditedTurn {
    /// The episode's index in the panel.
    pub episode: usize,
    /// Its question's id.
    pub question: String,
    /// The turn's depth.
    pub turn: usize,
    /// What the taken turn did: `search`, `answer`, `move` or `invalid`.
    pub action: String,
    /// The replay (returns, advantage, standard error, decisive).
    pub replay: TurnReplay,
    /// Each estimator's advantage of the turn.
    pub credit: BTreeMap<String, f64>,
}

/// An estimator's scores against the replay.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EstimatorScores {
    /// The estimator.
    pub name: String,
    /// Over every audited turn.
    pub overall: Agreement,
    /// Per turn depth (index = depth).
    pub by_depth: Vec<Agreement>,
}

/// The replay's figures at one turn depth.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DepthSummary {
    /// The depth.
    pub depth: usize,
    /// Turns audited at that depth.
    pub turns: usize,
    /// Decisive turns among them.
    pub decisive: usize,
    /// Mean `|Â|`.
    pub mean_abs_advantage: f64,
    /// Mean standard error.
    pub mean_se: f64,
}

/// What an audit found.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AuditReport {
    /// What was audited (the checkpoint).
    pub source: String,
    /// The split.
    pub split: String,
    /// Audited episodes.
    pub episodes: usize,
    /// Episodes per question.
    pub group: usize,
    /// `K`.
    pub alternatives: usize,
    /// `M`.
    pub rollouts: usize,
    /// The seed.
    pub seed: u64,
    /// Bootstrap resamples of the intervals (and shuffles of the permutation tests).
    pub bootstrap: usize,
    /// Sampling temperature of every rollout.
    pub temperature: f64,
    /// Audited turns.
    pub turns: usize,
    /// Replay rollouts run (continuations actually rolled, never more than the cost bound).
    pub replay_rollouts: usize,
    /// The cost bound `turns × (K + 1) × M`.
    pub cost_bound: usize,
    /// Mean return of the audited episodes.
    pub mean_return: f64,
    /// The realised decision density: the share of turns whose replay advantage is non-zero
    /// beyond twice its standard error.
    pub realised_density: f64,
    /// The decision density the world states (`task.world.decision_density`; `None` for a
    /// task that is not the built-in world).
    pub stated_density: Option<f64>,
    /// The replay per depth.
    pub depths: Vec<DepthSummary>,
    /// Every audited turn.
    pub audited: Vec<AuditedTurn>,
    /// Each estimator's agreement with the replay, in [`ESTIMATOR_PRESETS`]' order, the
    /// random baseline last.
    pub estimators: Vec<EstimatorScores>,
    /// Estimators left out, with the reason.
    pub skipped: Vec<(String, String)>,
    /// Wall-clock seconds per stage: panel, replay, estimators.
    pub seconds: BTreeMap<String, f64>,
}

/// Audits `trainer`'s policy (see the module docs); `source` names it in the report.
pub fn audit(trainer: &Trainer, source: &str, s: &AuditSettings) -> Result<AuditReport> {
    s.validate()?;
    let cfg = &trainer.config;
    anyhow::ensure!(
        cfg.rollout.backend != crate::config::RolloutBackend::Remote,
        "the credit audit samples with the local engine; this config has rollout.backend = \
         \"remote\" (audit it with --set rollout.backend=\"local\")"
    );
    let mut seconds = BTreeMap::new();
    // 1. The panel.
    let t0 = Instant::now();
    let questions: Vec<_> = trainer
        .task
        .questions(s.split)
        .into_iter()
        .take(s.episodes)
        .collect();
    anyhow::ensure!(
        !questions.is_empty(),
        "the {} split has no questions to audit",
        s.split.name()
    );
    let mut specs = Vec::with_capacity(questions.len() * s.group);
    for (i, q) in questions.iter().enumerate() {
        let prompt_ids = trainer.tokenizer.encode(&trainer.task.prompt(q)?)?;
        for g in 0..s.group {
            specs.push(EpisodeSpec {
                id: format!("audit-{}-{g}", q.id),
                prompt_uid: format!("{i}:{}", q.id),
                prompt_ids: prompt_ids.clone(),
                task: TaskSet::env_task(q),
                seed: crate::rollout::turn_seed(s.replay.seed, i * s.group + g),
            });
        }
    }
    let make_env = || trainer.task.env();
    let score_with =
        |reward: &turnwise_core::reward::RewardConfig, ep: &Episode, golds: &[String]| {
            trainer.task.score_episode(reward, ep, golds)
        };
    let score = |ep: &Episode, golds: &[String]| Ok(score_with(&cfg.reward, ep, golds)?.score);
    let decoding = trainer.decoding(cfg.rollout.temperature);
    let replayer = ModelReplayer {
        policy: trainer.rollout_policy(),
        make_env: &make_env,
        decoding: decoding.clone(),
        score: &score,
    };
    let keep: Vec<bool> = (0..specs.len()).map(|i| i % s.group == 0).collect();
    let starts = specs
        .into_iter()
        .map(|spec| EpisodeState::start(spec, make_env()?))
        .collect::<Result<Vec<_>>>()?;
    tracing::info!(
        episodes = starts.len(),
        audited = questions.len(),
        "credit audit: playing the panel"
    );
    let played = replay::play(&replayer, starts, &keep)?;
    let mut befores: Vec<Vec<EpisodeState>> = Vec::new();
    let mut episodes: Vec<ScoredEpisode> = Vec::with_capacity(played.len());
    for (i, p) in played.into_iter().enumerate() {
        let golds = p.finished.task().answers.clone();
        let ep = p.finished.finish();
        let out = score_with(&cfg.reward, &ep, &golds)?;
        let mut se = ScoredEpisode::new(ep, i / s.group, out.score, out.turn_rewards);
        se.em = out.em;
        se.format_ok = out.format_ok;
        se.golds = golds;
        episodes.push(se);
        if keep[i] {
            befores.push(p.before);
        }
    }
    seconds.insert("panel".into(), t0.elapsed().as_secs_f64());

    // 2. The replay.
    let t1 = Instant::now();
    let audited_idx: Vec<usize> = (0..questions.len()).map(|i| i * s.group).collect();
    let taken: Vec<f64> = audited_idx.iter().map(|&i| episodes[i].score).collect();
    let turns: usize = befores.iter().map(Vec::len).sum();
    tracing::info!(
        turns,
        cost_bound = s.replay.cost(turns),
        "credit audit: replaying every turn"
    );
    let refs: Vec<&[EpisodeState]> = befores.iter().map(Vec::as_slice).collect();
    let mut replay_rollouts = 0usize;
    let mut last_log = Instant::now();
    let replays = replay::replay(&replayer, &refs, &taken, &s.replay, &mut |done, total| {
        replay_rollouts = total;
        if last_log.elapsed().as_secs_f64() > 10.0 || done == total {
            last_log = Instant::now();
            tracing::info!(
                done,
                total,
                seconds = t1.elapsed().as_secs_f64().round(),
                "credit audit: replay rollouts"
            );
        }
    })?;
    drop(befores);
    seconds.insert("replay".into(), t1.elapsed().as_secs_f64());

    // 3. The estimators.
    let t2 = Instant::now();
    let (credit, skipped) = estimator_credit(trainer, &episodes, &audited_idx, s.replay.seed)?;
    seconds.insert("estimators".into(), t2.elapsed().as_secs_f64());

    // 4. Scores.
    let mut audited = Vec::with_capacity(turns);
    for (e, (reps, &i)) in replays.into_iter().zip(&audited_idx).enumerate() {
        let traj = &episodes[i].episode.trajectory;
        for rep in reps {
            let action = match traj.turns.get(rep.turn).map(|t| &t.action) {
                Some(TurnAction::Search { .. }) => "search",
                Some(TurnAction::Answer { .. }) => "answer",
                Some(TurnAction::Move { action }) => action.as_str(),
                _ => "invalid",
            };
            let credit = credit
                .iter()
                .map(|(name, per_episode)| {
                    let v = per_episode[e].get(rep.turn).copied().unwrap_or(0.0);
                    (name.clone(), v)
                })
                .collect();
            audited.push(AuditedTurn {
                episode: e,
                question: questions[e].id.clone(),
                turn: rep.turn,
                action: action.into(),
                replay: rep,
                credit,
            });
        }
    }
    let names: Vec<String> = credit.iter().map(|(n, _)| n.clone()).collect();
    let estimators = names
        .iter()
        .map(|name| score_estimator(name, &audited, s.bootstrap, s.replay.seed))
        .collect();
    let max_depth = audited.iter().map(|t| t.turn + 1).max().unwrap_or(0);
    let depths = (0..max_depth)
        .map(|d| {
            let at: Vec<&AuditedTurn> = audited.iter().filter(|t| t.turn == d).collect();
            let n = at.len().max(1) as f64;
            DepthSummary {
                depth: d,
                turns: at.len(),
                decisive: at.iter().filter(|t| t.replay.decisive).count(),
                mean_abs_advantage: at.iter().map(|t| t.replay.advantage.abs()).sum::<f64>() / n,
                mean_se: at.iter().map(|t| t.replay.se).sum::<f64>() / n,
            }
        })
        .collect();
    let decisive = audited.iter().filter(|t| t.replay.decisive).count();
    Ok(AuditReport {
        source: source.into(),
        split: s.split.name().into(),
        episodes: questions.len(),
        group: s.group,
        alternatives: s.replay.alternatives,
        rollouts: s.replay.rollouts,
        seed: s.replay.seed,
        bootstrap: s.bootstrap,
        temperature: decoding.temperature,
        turns,
        replay_rollouts,
        cost_bound: s.replay.cost(turns),
        mean_return: taken.iter().sum::<f64>() / taken.len().max(1) as f64,
        realised_density: decisive as f64 / turns.max(1) as f64,
        stated_density: trainer.task.world_config().map(|w| w.decision_density),
        depths,
        audited,
        estimators,
        skipped,
        seconds,
    })
}

/// The scores of estimator `name` over the audited turns.
fn score_estimator(
    name: &str,
    audited: &[AuditedTurn],
    bootstrap: usize,
    seed: u64,
) -> EstimatorScores {
    let turns: Vec<ScoredTurn> = audited
        .iter()
        .map(|t| ScoredTurn {
            episode: t.episode,
            turn: t.turn,
            replay: t.replay.advantage,
            decisive: t.replay.decisive,
            estimate: t.credit[name],
        })
        .collect();
    let max_depth = turns.iter().map(|t| t.turn + 1).max().unwrap_or(0);
    EstimatorScores {
        name: name.into(),
        overall: score::agreement(&turns, &|_| true, bootstrap, seed),
        by_depth: (0..max_depth)
            .map(|d| score::agreement(&turns, &|t| t.turn == d, bootstrap, seed))
            .collect(),
    }
}

/// Per estimator (in [`ESTIMATOR_PRESETS`]' order, then [`RANDOM`]): per audited episode
/// (`audited[e]` indexes `episodes`), its advantage of each turn, computed over all of
/// `episodes`' groups as a training step computes it; and the estimators left out, with why.
#[allow(clippy::type_complexity)]
pub fn estimator_credit(
    trainer: &Trainer,
    episodes: &[ScoredEpisode],
    audited: &[usize],
    seed: u64,
) -> Result<(Vec<(String, Vec<Vec<f64>>)>, Vec<(String, String)>)> {
    let cfg = &trainer.config;
    let mut out = Vec::new();
    let mut skipped = Vec::new();
    let mut gains: Option<Result<Vec<Vec<f64>>, String>> = None;
    let env_set = format!("task.env=\"{}\"", cfg.task.env.name());
    for &preset in ESTIMATOR_PRESETS {
        let preset_cfg =
            match TrainConfig::resolve(Some(preset), None, std::slice::from_ref(&env_set)) {
                Ok(c) => c,
                Err(e) => {
                    skipped.push((preset.into(), format!("its preset does not resolve: {e}")));
                    continue;
                }
            };
        let mut est_cfg = cfg.clone();
        est_cfg.advantage = preset_cfg.advantage.clone();
        let needs = est_cfg.advantage.needs();
        if needs.critic_values && trainer.critic.is_none() {
            skipped.push((
                preset.into(),
                "needs a trained critic: audit a checkpoint of a PPO-family run (`--run`), \
                 which holds one"
                    .into(),
            ));
            continue;
        }
        if needs.trees {
            skipped.push((preset.into(), "needs tree rollouts".into()));
            continue;
        }
        let mut scored: Vec<ScoredEpisode> = episodes.to_vec();
        if needs.turn_rewards {
            // The turn rewards of the estimator's own reward; the score stays the run's.
            let mut missing = None;
            for e in &mut scored {
                match trainer
                    .task
                    .score_episode(&preset_cfg.reward, &e.episode, &e.golds)
                {
                    Ok(o) if !o.turn_rewards.is_empty() => e.turn_rewards = o.turn_rewards,
                    Ok(_) => {
                        missing = Some(format!(
                            "its reward {} gives no turn rewards on this task",
                            preset_cfg.reward.name()
                        ))
                    }
                    Err(err) => missing = Some(format!("its reward fails here: {err:#}")),
                }
            }
            if let Some(why) = missing {
                skipped.push((preset.into(), why));
                continue;
            }
        }
        if needs.info_gain {
            let g = gains.get_or_insert_with(|| {
                let eps: Vec<Episode> = episodes.iter().map(|e| e.episode.clone()).collect();
                let first: Vec<String> = episodes
                    .iter()
                    .map(|e| e.golds.first().cloned().unwrap_or_default())
                    .collect();
                tracing::info!(
                    episodes = eps.len(),
                    "credit audit: information-gain probes"
                );
                crate::rollout::info_gain::probe(
                    &trainer.sampler,
                    &trainer.tokenizer,
                    cfg.task.format,
                    &eps,
                    &first,
                )
                .map(|p| p.gains)
                .map_err(|e| format!("{e:#}"))
            });
            match g {
                Ok(g) => {
                    for (e, gain) in scored.iter_mut().zip(g) {
                        e.info_gain = Some(gain.clone());
                    }
                }
                Err(why) => {
                    skipped.push((preset.into(), format!("the probes fail here: {why}")));
                    continue;
                }
            }
        }
        // GAE reads the checkpoint's critic at every response token of the panel's episodes,
        // as a training step does (without KL in the reward: the credit of the outcome).
        let values = match (&trainer.critic, needs.critic_values) {
            (Some(critic), true) => {
                let rows: Vec<Row> = scored
                    .iter()
                    .map(|e| {
                        Row::from_trajectory(&e.episode.trajectory, cfg.rollout.train_on_forced)
                    })
                    .collect();
                tracing::info!(episodes = rows.len(), "credit audit: the critic's values");
                Some(
                    critic
                        .values(&rows, 64, cfg.optim.share_prefix)
                        .context("the critic's values of the audit's panel")?,
                )
            }
            _ => None,
        };
        let rows =
            crate::trainer::advantage::compute(&est_cfg, &scored, None, values.as_deref(), None)
                .with_context(|| format!("the {preset} estimator on the audit's panel"))?;
        out.push((
            preset.to_string(),
            audited
                .iter()
                .map(|&i| rows.details[i].turns.clone())
                .collect(),
        ));
    }
    let mut rng = SplitMix64::new(seed ^ 0x7261_6e64_6f6d);
    let random = audited
        .iter()
        .map(|&i| {
            (0..episodes[i].episode.trajectory.num_turns())
                .map(|_| 2.0 * rng.next_f64() - 1.0)
                .collect()
        })
        .collect();
    out.push((RANDOM.to_string(), random));
    Ok((out, skipped))
}
