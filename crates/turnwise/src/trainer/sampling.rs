//! The batch of one RL step: generation rounds (rollout, reward, DAPO's overlong shaping,
//! information-gain probes) and DAPO dynamic sampling over them (spec §2.7, §6.4).
//!
//! A step generates one round of `rollout.prompts_per_step` prompts × `rollout.group_size`
//! rollouts. With `rollout.filter_zero_variance_groups` on, only informative groups
//! ([`super::advantage::informative_groups`], on `rollout.filter_metric`: by default accuracy,
//! the outcome before DAPO's overlong shaping, as in verl's DAPO recipe) are trained on, and
//! while fewer than `prompts_per_step` are informative the step generates further rounds of
//! `prompts_per_step` fresh prompts (next in the step's seeded permutation of the training
//! questions, fresh sampling seeds), at most `rollout.max_num_gen_batches` rounds in all. The first
//! `prompts_per_step` informative groups, in generation order, make the batch (verl DAPO
//! truncates the same way). A batch still short after the last round trains on the informative
//! groups it has, with a warning; verl raises an error there instead.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use anyhow::Result;
use turnwise_core::metric_keys as mk;
use turnwise_core::reward::{RewardOutput, overlong_penalty};

use super::Trainer;
use crate::config::{FilterMetric, RolloutStrategy};
use crate::rollout::tree::TreeBatch;
use crate::rollout::{Episode, EpisodeSpec, RolloutControl, RolloutStats, run_chains_with};
use crate::task::TaskSet;
use crate::trainer::harness::HarnessRollout;

/// One episode through the step: the rollout, and what the reward, DAPO's overlong shaping and
/// the information-gain probes made of it. The group filter, the estimators, the metrics and the
/// samples read these records; nothing about an episode is kept in a parallel column.
#[derive(Debug, Clone)]
pub struct ScoredEpisode {
    /// The rollout.
    pub episode: Episode,
    /// Its prompt group, unique over the rounds of a step.
    pub group: usize,
    /// Its question's gold answers.
    pub golds: Vec<String>,
    /// Its score: the reward's score plus the overlong penalty.
    pub score: f64,
    /// The reward's score (always the rules': a judge scores intermediate turns only), before
    /// the overlong penalty.
    pub reward_score: f64,
    /// Its per-turn rewards (empty when the reward has none).
    pub turn_rewards: Vec<f64>,
    /// Its EM.
    pub em: f64,
    /// Whether its format was valid.
    pub format_ok: bool,
    /// The named parts of its reward (the two-turn rubrics; empty otherwise).
    pub reward_parts: Vec<(&'static str, f64)>,
    /// DAPO's overlong penalty added to its score (0 when off or short enough).
    pub overlong: f64,
    /// Information gain of each process turn (IGPO, A2TGPO; `None` without probes).
    pub info_gain: Option<Vec<f64>>,
}

impl ScoredEpisode {
    /// `episode` in prompt group `group` with score `score` and per-turn rewards
    /// `turn_rewards`: what the estimators read. Its EM is the score, its format valid, with no
    /// reward parts, overlong penalty or information gain (set the fields for more).
    pub fn new(episode: Episode, group: usize, score: f64, turn_rewards: Vec<f64>) -> Self {
        Self {
            episode,
            group,
            golds: Vec::new(),
            score,
            reward_score: score,
            turn_rewards,
            em: score,
            format_ok: true,
            reward_parts: Vec::new(),
            overlong: 0.0,
            info_gain: None,
        }
    }

    /// The value DAPO's group filter compares within a prompt group (`rollout.filter_metric`):
    /// the EM, the reward's score before the overlong penalty, or the score with it.
    pub fn filter_value(&self, metric: FilterMetric) -> f64 {
        match metric {
            FilterMetric::Acc => self.em,
            FilterMetric::Score => self.reward_score,
            FilterMetric::SeqReward => self.score,
        }
    }
}

/// What the information-gain probes of a batch ran.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProbeCounts {
    /// Probes run.
    pub probes: usize,
    /// Probes whose ground-truth span was empty.
    pub failures: usize,
}

/// The batch of one step: the episodes of one or more generation rounds and what generating
/// them did.
#[derive(Debug, Clone, Default)]
pub struct StepBatch {
    /// The episodes, in generation order.
    pub episodes: Vec<ScoredEpisode>,
    /// The information-gain probes (IGPO, A2TGPO).
    pub probes: Option<ProbeCounts>,
    /// Tree bookkeeping of tree rollouts (its `leaf_of` follows `episodes`).
    pub trees: Option<TreeBatch>,
    /// Rollout-control totals of chain rollouts.
    pub stats: RolloutStats,
    /// Generation rounds in the batch.
    pub rounds: usize,
    /// Seconds spent generating (rollout and reward).
    pub gen_seconds: f64,
    /// Seconds spent on information-gain probes.
    pub ig_seconds: f64,
    /// What the LLM judge did (`[judge]`).
    pub judge: Option<super::judge::JudgeStats>,
    /// What the harness's agent program did (`rollout.backend = "harness"`).
    pub harness: Option<crate::trainer::harness::HarnessStats>,
}

impl StepBatch {
    /// Number of prompt groups (one past the largest group id).
    pub fn num_groups(&self) -> usize {
        self.episodes.iter().map(|e| e.group + 1).max().unwrap_or(0)
    }

    /// Appends a later round, its group and tree ids shifted past this batch's.
    pub fn append(&mut self, other: StepBatch) {
        let group_offset = self.num_groups();
        self.episodes
            .extend(other.episodes.into_iter().map(|mut e| {
                e.group += group_offset;
                e
            }));
        self.probes = match (self.probes.take(), other.probes) {
            (Some(a), Some(b)) => Some(ProbeCounts {
                probes: a.probes + b.probes,
                failures: a.failures + b.failures,
            }),
            (a, b) => a.or(b),
        };
        self.trees = match (self.trees.take(), other.trees) {
            (Some(mut a), Some(b)) => {
                let tree_offset = a.trees.len();
                a.trees.extend(b.trees.into_iter().map(|mut t| {
                    t.group += group_offset;
                    t
                }));
                a.leaf_of
                    .extend(b.leaf_of.iter().map(|&(t, l)| (t + tree_offset, l)));
                Some(a)
            }
            (a, b) => a.or(b),
        };
        self.stats.merge(&other.stats);
        self.judge = match (self.judge.take(), other.judge) {
            (Some(mut a), Some(b)) => {
                a.merge(&b);
                Some(a)
            }
            (a, b) => a.or(b),
        };
        self.harness = match (self.harness.take(), other.harness) {
            (Some(mut a), Some(b)) => {
                a.merge(b);
                Some(a)
            }
            (a, b) => a.or(b),
        };
        self.rounds += other.rounds;
        self.gen_seconds += other.gen_seconds;
        self.ig_seconds += other.ig_seconds;
    }

    /// The episodes of the groups in `keep` (in batch order); trees are kept whole.
    pub fn select(&self, keep: &BTreeSet<usize>) -> StepBatch {
        let idx: Vec<usize> = (0..self.episodes.len())
            .filter(|&i| keep.contains(&self.episodes[i].group))
            .collect();
        StepBatch {
            episodes: idx.iter().map(|&i| self.episodes[i].clone()).collect(),
            probes: self.probes,
            trees: self.trees.as_ref().map(|t| TreeBatch {
                trees: t.trees.clone(),
                leaf_of: idx.iter().map(|&i| t.leaf_of[i]).collect(),
                forks: t.forks.clone(),
                prompts: t.prompts,
            }),
            stats: self.stats.clone(),
            rounds: self.rounds,
            gen_seconds: self.gen_seconds,
            ig_seconds: self.ig_seconds,
            judge: self.judge,
            harness: self.harness.clone(),
        }
    }
}

/// The episodes one generation round played ([`Trainer::generate_round`]), each with its
/// prompt group, gold answers and question text.
struct RoundEpisodes {
    /// The episodes, in generation order.
    episodes: Vec<Episode>,
    /// Each episode's prompt group within the round.
    groups: Vec<usize>,
    /// Each episode's question's gold answers.
    golds: Vec<Vec<String>>,
    /// Each episode's question text.
    questions: Vec<String>,
    /// Tree bookkeeping of tree rollouts.
    trees: Option<TreeBatch>,
    /// Rollout-control totals of chain rollouts.
    stats: RolloutStats,
    /// The agent program's rollout (`rollout.backend = "harness"`).
    harness: Option<HarnessRollout>,
}

impl Trainer {
    /// One generation round: rollouts of the RL training questions `picks` (indices into
    /// `task.rl_questions()`), `rollout.group_size` per question with fresh seeds from the
    /// trainer's generator, scored by the configured reward plus DAPO's overlong penalty, with
    /// information-gain probes when configured. `round` (0 for a step's first round) keeps
    /// episode ids and prompt uids of refill rounds distinct; `group_offset` is the number of
    /// groups generated before in this step.
    pub fn generate_round(
        &mut self,
        picks: &[usize],
        round: usize,
        group_offset: usize,
    ) -> Result<StepBatch> {
        let t0 = Instant::now();
        let base_seed = self.rng.next_u64();
        let specs = self.round_specs(picks, round, group_offset, base_seed)?;
        let RoundEpisodes {
            mut episodes,
            groups,
            golds,
            questions,
            trees,
            stats,
            harness,
        } = self.play_round(specs, base_seed)?;

        // Rewards, and DAPO's overlong shaping of the score (spec §2.7).
        let mut batch = StepBatch::default();
        let (outs, penalties) =
            self.score_round(&mut batch, &mut episodes, &golds, &questions, harness)?;
        batch.gen_seconds = t0.elapsed().as_secs_f64();

        // Information gain.
        let t1 = Instant::now();
        let mut gains = self.probe_round(&mut batch, &episodes, &golds)?;
        batch.ig_seconds = t1.elapsed().as_secs_f64();
        batch.episodes = episodes
            .into_iter()
            .zip(outs)
            .zip(penalties)
            .zip(groups.into_iter().zip(golds))
            .map(
                |(((episode, out), overlong), (group, golds))| ScoredEpisode {
                    score: out.score + overlong,
                    reward_score: out.score,
                    em: out.em,
                    format_ok: out.format_ok,
                    reward_parts: out.parts,
                    turn_rewards: out.turn_rewards,
                    overlong,
                    info_gain: gains.as_mut().and_then(Iterator::next),
                    episode,
                    group,
                    golds,
                },
            )
            .collect();
        batch.trees = trees;
        batch.stats = stats;
        batch.rounds = 1;
        Ok(batch)
    }

    /// The episodes of one generation round ([`Trainer::generate_round`]): `group_size` per
    /// pick, seeded from `base_seed`.
    fn round_specs(
        &self,
        picks: &[usize],
        round: usize,
        group_offset: usize,
        base_seed: u64,
    ) -> Result<Vec<EpisodeSpec>> {
        let r = &self.config.rollout;
        let train = self.task.rl_questions();
        let mut specs = Vec::new();
        for (g, &qi) in picks.iter().enumerate() {
            let q = train[qi];
            let prompt_ids = self.tokenizer.encode(&self.task.prompt(q)?)?;
            let step_tag = match round {
                0 => format!("s{}", self.step + 1),
                _ => format!("s{}r{round}", self.step + 1),
            };
            for k in 0..r.group_size {
                specs.push(EpisodeSpec {
                    id: format!("{step_tag}-{}-{k}", q.id),
                    prompt_uid: format!("{}:{}", group_offset + g, q.id),
                    prompt_ids: prompt_ids.clone(),
                    task: TaskSet::env_task(q),
                    seed: crate::rollout::turn_seed(base_seed, g * r.group_size + k),
                });
            }
        }
        Ok(specs)
    }

    /// Plays the episodes `specs` of a round: through the agent program (harness), as chains,
    /// or as trees (seeded from `base_seed`); each episode comes with its prompt group, gold
    /// answers and question.
    fn play_round(&self, specs: Vec<EpisodeSpec>, base_seed: u64) -> Result<RoundEpisodes> {
        let cfg = &self.config;
        let r = &cfg.rollout;
        let decoding = self.decoding(r.temperature);
        let mut groups: Vec<usize> = (0..specs.len()).map(|i| i / r.group_size).collect();
        let golds: Vec<Vec<String>> = specs.iter().map(|s| s.task.answers.clone()).collect();
        let questions: Vec<String> = specs
            .iter()
            .map(|s| s.task.prompt.clone().unwrap_or_default())
            .collect();
        let mut stats = RolloutStats::default();
        let mut harness = None;
        let (episodes, trees) = match r.strategy {
            RolloutStrategy::Chain if self.harness_enabled() => {
                let mut out = self
                    .run_harness(&specs, &decoding, "train")
                    .expect("the harness is enabled")?;
                // Episodes follow the programs that succeeded (one per trajectory).
                groups = out.sources.iter().map(|&i| groups[i]).collect();
                let episodes = std::mem::take(&mut out.episodes);
                harness = Some(out);
                (episodes, None)
            }
            RolloutStrategy::Chain => {
                let policy = self.rollout_policy();
                let env = self.make_env();
                let control = RolloutControl::from_config(r, cfg.task.format, &self.tokenizer)?;
                let out = run_chains_with(&policy, specs, &env, &decoding, &control)?;
                stats = out.stats;
                (out.episodes, None)
            }
            _ => {
                let policy = self.rollout_policy();
                let env = self.make_env();
                let out = crate::rollout::tree::run_trees(
                    &policy,
                    specs,
                    r.group_size,
                    &env,
                    &decoding,
                    r,
                    base_seed,
                )?;
                groups = out.groups.clone();
                (out.episodes, Some(out.trees))
            }
        };
        let (golds, questions): (Vec<Vec<String>>, Vec<String>) = match &trees {
            None => match &harness {
                Some(h) => h
                    .sources
                    .iter()
                    .map(|&i| (golds[i].clone(), questions[i].clone()))
                    .unzip(),
                None => (golds, questions),
            },
            Some(_) => groups
                .iter()
                .map(|&g| {
                    let i = g * r.group_size;
                    (golds[i].clone(), questions[i].clone())
                })
                .unzip(),
        };
        Ok(RoundEpisodes {
            episodes,
            groups,
            golds,
            questions,
            trees,
            stats,
            harness,
        })
    }

    /// The reward of each episode of a round (with the judge's rescoring and a harness
    /// program's own reward, whose stats go into `batch`), and DAPO's overlong penalty, both
    /// written into the episodes' trajectories. Returns the reward outputs and the penalties.
    fn score_round(
        &self,
        batch: &mut StepBatch,
        episodes: &mut [Episode],
        golds: &[Vec<String>],
        questions: &[String],
        harness: Option<HarnessRollout>,
    ) -> Result<(Vec<RewardOutput>, Vec<f64>)> {
        let cfg = &self.config;
        let overlong_cfg = cfg
            .overlong_buffer
            .enable
            .then(|| cfg.overlong_buffer.to_core(cfg.rollout.max_response_tokens));
        // The reward reads the agent's turns only (never the prompt or a notice's text); a
        // game's is the environment's return. The judge, when on, rescores the turns.
        let mut outs = episodes
            .iter()
            .zip(golds)
            .map(|(ep, gold)| self.task.score_episode(&cfg.reward, ep, gold))
            .collect::<Result<Vec<_>>>()?;
        if let Some(judge) = &self.judge {
            batch.judge = Some(judge.rescore(episodes, questions, golds, &mut outs)?);
        }
        // A harness episode's score: the program's reward when it gives one; a program whose
        // history was re-rendered gave several trajectories, each trained with the score of its
        // last (the one holding the answer).
        if let Some(h) = harness {
            let mut final_score = std::collections::HashMap::new();
            for (k, out) in outs.iter().enumerate() {
                if h.is_final[k] {
                    final_score.insert(h.sources[k], h.program_rewards[k].unwrap_or(out.score));
                }
            }
            for (k, out) in outs.iter_mut().enumerate() {
                out.score = final_score[&h.sources[k]];
            }
            batch.harness = Some(h.stats);
        }
        let mut penalties = Vec::with_capacity(episodes.len());
        for (ep, out) in episodes.iter_mut().zip(&outs) {
            let penalty = overlong_cfg
                .as_ref()
                .map_or(0.0, |c| overlong_penalty(ep.trajectory.response_len(), c));
            ep.trajectory.outcome_reward = Some(out.score + penalty);
            ep.trajectory.turn_rewards = out.turn_rewards.clone();
            penalties.push(penalty);
        }
        Ok((outs, penalties))
    }

    /// The information gain of each process turn of a round's episodes (IGPO, A2TGPO), probed
    /// against each episode's first gold answer, when `rollout.info_gain` is on; the probe
    /// counts go into `batch`.
    fn probe_round(
        &self,
        batch: &mut StepBatch,
        episodes: &[Episode],
        golds: &[Vec<String>],
    ) -> Result<Option<std::vec::IntoIter<Vec<f64>>>> {
        if !self.config.rollout.info_gain {
            return Ok(None);
        }
        let first: Vec<String> = golds
            .iter()
            .map(|g| g.first().cloned().unwrap_or_default())
            .collect();
        let probed = crate::rollout::info_gain::probe(
            &self.sampler,
            &self.tokenizer,
            self.config.task.format,
            episodes,
            &first,
        )?;
        batch.probes = Some(ProbeCounts {
            probes: probed.probes,
            failures: probed.failures,
        });
        Ok(Some(probed.gains.into_iter()))
    }

    /// The batch of one step: the first round, then, under DAPO dynamic sampling, refill rounds
    /// until `prompts_per_step` groups are informative or `max_num_gen_batches` rounds ran.
    /// Returns every generated episode, the selection to train on (`None`: all of them), and
    /// the `batch/*` metrics: `batch/informative_groups` (informative groups generated),
    /// `batch/filtered_groups` (groups the filter dropped as uninformative; 0 with the filter
    /// off) and `batch/refill_rounds` (rounds after the first).
    #[allow(clippy::type_complexity)]
    pub fn sample_batch(
        &mut self,
    ) -> Result<(StepBatch, Option<StepBatch>, BTreeMap<String, f64>)> {
        let cfg = self.config.clone();
        let r = &cfg.rollout;
        let n_train = self.task.rl_questions().len();
        if n_train == 0 && cfg.task.search_r1.is_some() {
            anyhow::bail!("no training questions for RL: set task.search_r1.train = FILE");
        }
        if n_train == 0 {
            anyhow::bail!(
                "no training questions for RL (with task.rl_subject_fraction = {}, no training \
                 subject was reserved; raise it or set it to 0)",
                cfg.task.rl_subject_fraction
            );
        }
        // Prompts: a seeded permutation of the training questions, taken in order by the
        // rounds (a fresh permutation when it runs out).
        let permutation = |rng: &mut turnwise_model::rng::TurnRng| {
            let mut p: Vec<usize> = (0..n_train).collect();
            super::shuffle(&mut p, rng);
            p
        };
        let mut order = permutation(&mut self.rng);
        let mut next = 0usize;
        let mut take = |rng: &mut turnwise_model::rng::TurnRng| {
            if next >= order.len() {
                order = permutation(rng);
                next = 0;
            }
            let end = (next + r.prompts_per_step).min(order.len());
            let picks = order[next..end].to_vec();
            next = end;
            picks
        };
        let picks = take(&mut self.rng);
        let mut all = self.generate_round(&picks, 0, 0)?;
        // Tree estimators need their groups whole (the filter may not drop a tree's rollouts).
        let filter = r.filter_zero_variance_groups
            && turnwise_core::advantage::Estimator::filterable(&cfg.advantage);
        let informative = |b: &StepBatch| super::advantage::informative_groups(&cfg, &b.episodes);
        let mut useful = informative(&all);
        while filter && useful.len() < r.prompts_per_step && all.rounds < r.max_num_gen_batches {
            let picks = take(&mut self.rng);
            let offset = all.num_groups();
            let more = self.generate_round(&picks, all.rounds, offset)?;
            all.append(more);
            useful = informative(&all);
            tracing::debug!(
                round = all.rounds,
                informative = useful.len(),
                "dynamic sampling refill"
            );
        }
        let total = all.num_groups();
        let mut metrics = BTreeMap::new();
        metrics.insert(mk::batch::INFORMATIVE_GROUPS.into(), useful.len() as f64);
        metrics.insert(mk::batch::REFILL_ROUNDS.into(), (all.rounds - 1) as f64);
        let dropped = if filter { total - useful.len() } else { 0 };
        metrics.insert(mk::batch::FILTERED_GROUPS.into(), dropped as f64);
        if !filter {
            self.report_zero_signal(&all, &mut metrics);
            return Ok((all, None, metrics));
        }
        if useful.len() < r.prompts_per_step {
            tracing::warn!(
                step = self.step + 1,
                informative = useful.len(),
                wanted = r.prompts_per_step,
                rounds = all.rounds,
                "dynamic sampling: too few informative groups after \
                 rollout.max_num_gen_batches rounds; training on those"
            );
        }
        let keep: BTreeSet<usize> = useful.into_iter().take(r.prompts_per_step).collect();
        let selected = all.select(&keep);
        self.report_zero_signal(&selected, &mut metrics);
        Ok((all, Some(selected), metrics))
    }

    /// Reports a step that learns nothing: when no group of `trained` (the batch the update
    /// reads) carries a signal on the score the estimator reads (tied rewards in every group,
    /// and no turn, step or information-gain signal either; [`super::advantage::informative_groups`]
    /// on `seq_reward`), the step's metrics get `batch/zero_signal = 1` and a warning names the
    /// step. The metric is absent from every other step, so the metrics of runs with signal are
    /// unchanged.
    fn report_zero_signal(&self, trained: &StepBatch, metrics: &mut BTreeMap<String, f64>) {
        let mut on_score = self.config.clone();
        on_score.rollout.filter_metric = FilterMetric::SeqReward;
        if !super::advantage::informative_groups(&on_score, &trained.episodes).is_empty() {
            return;
        }
        metrics.insert(mk::batch::ZERO_SIGNAL.into(), 1.0);
        let groups: BTreeSet<usize> = trained.episodes.iter().map(|e| e.group).collect();
        let which = match groups.len() {
            0 => "no group is left to train on".to_string(),
            n => format!(
                "every group has zero signal (the rollouts of each of the {n} groups tie on \
                 the reward)"
            ),
        };
        tracing::warn!(
            "step {}: {which}: the advantages are 0 and the step learns nothing. The questions \
             may be too hard or too easy for the policy, or the reward may not tell its answers \
             apart; a warm start, a larger rollout.group_size or \
             rollout.filter_zero_variance_groups (DAPO's dynamic sampling) can help",
            self.step + 1,
        );
    }
}
