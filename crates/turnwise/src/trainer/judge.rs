//! LLM-judge turn rewards in training (`[judge]`, turn-level-rewards.md §5 and App. C.3).
//!
//! After a rollout, every episode's turns (each turn's text with the observation after it) go
//! to an OpenAI-compatible chat endpoint with the paper's per-turn rubric
//! ([`turnwise_env::judge::turn_prompt`]); the scores it returns for the intermediate turns
//! become the episode's R^I_k in place of the rules' scores of the same rubric
//! (`reward = "mt_ppo_turn"`). The last turn's reward R^F and the episode's score stay the
//! rules' verifiable outcome (spec §2.4; the paper judges turns and verifies the outcome): the
//! judge is never asked for the final turn's score in choice mode, and its free-text score of
//! it is dropped. The endpoint is either a model served inside the run (`judge.serve`,
//! `turnwise serve` on a free loopback port) or any server at `judge.base_url`; with neither
//! (mt-ppo-judge as shipped) the judge refuses to start
//! ([`JudgeSettings::require_endpoint`]).
//!
//! Before RL the judge is calibrated ([`Trainer::calibrate_judge`]): the starting policy rolls
//! out `judge.calibration_questions` validation questions, the rules and the judge score each
//! intermediate turn, and a judge agreeing on less than `judge.min_rubric_agreement` of them
//! stops the run ([`TurnJudge::check_calibration`]), naming the judge, its agreement, the floor
//! and the fix.
//!
//! `judge.mode` says how the scores are asked for ([`turnwise_env::judge::JudgeMode`]):
//! `"free"`, one request per episode whose free-text `<score>` block is parsed, or `"choice"`,
//! one request per intermediate turn whose reply is constrained to the rubric's possible
//! scores for that turn (vLLM's `guided_choice` after a prefilled score block,
//! `continue_final_message`), so a small judge's verdict always parses.
//!
//! Episodes are judged concurrently (`judge.concurrency`; in choice mode an episode's turns go
//! one after the other, each request continuing the scores picked before), requests are
//! retried on transient failures, and may be cached on disk. An episode of one turn has nothing
//! to judge and is not sent. An episode the judge cannot score is scored by the rules instead,
//! or stops the step (`judge.on_failure`); a judge that fails on more than
//! `judge.max_failure_rate` of a round's judged rollouts stops the run, naming the judge and
//! the rate. The step's metrics say how it went ([`JudgeStats`]): `judge/episodes` (rollouts
//! sent), `judge/failures`, `judge/failure_rate`, `judge/requests` (HTTP requests sent),
//! `judge/cache_hits`, `judge/turn_score/mean` (over the intermediate turns judged),
//! `judge/rubric_agreement` (the share of those turns whose judge score equals the rules'
//! score) and `timing_s/judge`.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use turnwise_core::metric_keys as mk;
use turnwise_core::reward::RewardOutput;
use turnwise_env::client::{ClientConfig, RetryPolicy};
use turnwise_env::judge::{JudgeConfig, LlmJudge};

use crate::config::{JudgeFailure, JudgeSettings};
use crate::rollout::{Episode, EpisodeSpec, run_chains};
use crate::task::TaskSet;
use turnwise_env::world::Split;

use super::Trainer;
use crate::rollout::host::{HostOptions, ServedPolicy};

/// The judge of a run: the client, and the server it started when `judge.serve` is set.
pub struct TurnJudge {
    judge: LlmJudge,
    settings: JudgeSettings,
    /// Kept alive for the run; dropped (stopped) with the trainer.
    _server: Option<Box<dyn ServedPolicy>>,
}

impl std::fmt::Debug for TurnJudge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TurnJudge")
            .field("judge", &self.judge)
            .field("serving", &self._server.as_ref().map(|s| s.url()))
            .finish()
    }
}

/// Turns within this distance count as the same score in `judge/rubric_agreement`.
const AGREEMENT_TOL: f64 = 1e-6;

impl TurnJudge {
    /// Starts the judge: serves `settings.serve` when set, then connects the client.
    pub fn start(settings: &JudgeSettings) -> Result<Self> {
        settings.require_endpoint()?;
        let (server, base_url, model) = match &settings.serve {
            Some(spec) => {
                let t = Instant::now();
                let served = crate::rollout::host::installed("judge.serve")?
                    .load(Path::new(spec))
                    .with_context(|| format!("judge.serve = {spec:?}"))?;
                let options = HostOptions {
                    name: settings.model.clone(),
                    weight_version: None,
                };
                let server = served
                    .start(&options)
                    .with_context(|| format!("serving the judge {spec}"))?;
                tracing::info!(
                    judge = %spec,
                    url = %server.url(),
                    secs = t.elapsed().as_secs_f64(),
                    "judge served"
                );
                let url = format!("{}/v1", server.url());
                (Some(server), url, settings.model.clone())
            }
            None => (None, settings.base_url.clone(), settings.model.clone()),
        };
        let timeout = Duration::from_secs_f64(settings.timeout_secs);
        let config = JudgeConfig {
            base_url,
            model,
            api_key_env: settings.api_key_env.clone(),
            client: ClientConfig {
                timeout,
                connect_timeout: timeout.min(Duration::from_secs(10)),
                retry: RetryPolicy::new(settings.max_attempts, Duration::from_millis(200)),
                use_system_proxy: false,
            },
            cache_dir: settings.cache_dir.clone(),
            temperature: 0.0,
            max_tokens: Some(settings.max_tokens),
            mode: settings.mode,
        };
        let judge = LlmJudge::new(config).context("the judge client")?;
        Ok(Self {
            judge,
            settings: settings.clone(),
            _server: server,
        })
    }

    /// The chat-completions URL the judge asks.
    pub fn url(&self) -> &str {
        self.judge.url()
    }

    /// The judge as errors name it: its model, where it is served from (`judge.serve`) and
    /// the URL it is asked at.
    pub fn name(&self) -> String {
        match &self.settings.serve {
            Some(spec) => format!(
                "{:?} (served from {spec}) at {}",
                self.settings.model,
                self.url()
            ),
            None => format!("{:?} at {}", self.settings.model, self.url()),
        }
    }

    /// The judge's scores of every episode's intermediate turns (all but the last), asked
    /// concurrently; `None` for an episode of one turn (nothing to judge, nothing sent).
    fn judge_intermediate(
        &self,
        episodes: &[Episode],
        questions: &[String],
        golds: &[Vec<String>],
    ) -> Vec<Option<Result<Vec<f64>, String>>> {
        let verdicts = crate::parallel::map_indices(
            episodes.len(),
            self.settings.concurrency,
            |i| {
                let turns: Vec<String> = episodes[i]
                    .turn_texts
                    .iter()
                    .map(|(g, o)| format!("{g}{}", o.as_deref().unwrap_or("")))
                    .collect();
                self.judge
                    .intermediate_turn_scores(&questions[i], &golds[i], &turns)
                    .map_err(|e| e.to_string())
            },
            |_| false,
        );
        verdicts
            .into_iter()
            .zip(episodes)
            .map(|(v, ep)| {
                (ep.turn_texts.len() > 1).then(|| v.unwrap_or_else(|| Err("not judged".into())))
            })
            .collect()
    }

    /// Replaces the intermediate turn rewards R^I_k of `outputs` (the rules' scores of each
    /// episode) by the judge's; the last turn's reward R^F and the episode's score stay the
    /// rules' (spec §2.4). `questions[i]` and `golds[i]` are episode `i`'s. Returns what
    /// happened.
    pub fn rescore(
        &self,
        episodes: &[Episode],
        questions: &[String],
        golds: &[Vec<String>],
        outputs: &mut [RewardOutput],
    ) -> Result<JudgeStats> {
        let t0 = Instant::now();
        let (requests0, hits0) = (self.judge.requests_sent(), self.judge.cache_hits());
        let verdicts = self.judge_intermediate(episodes, questions, golds);
        let (mut sent, mut failures, mut turns, mut agree, mut sum) = (0usize, 0, 0, 0, 0.0);
        let mut first_error = None;
        for (i, v) in verdicts.into_iter().enumerate() {
            let Some(verdict) = v else { continue };
            sent += 1;
            let inter = outputs[i].turn_rewards.len().saturating_sub(1);
            match verdict {
                Ok(scores) if scores.len() == inter => {
                    let rules = &mut outputs[i].turn_rewards[..inter];
                    for (j, r) in scores.iter().zip(rules.iter()) {
                        agree += usize::from((j - r).abs() < AGREEMENT_TOL);
                        sum += j;
                    }
                    turns += inter;
                    rules.copy_from_slice(&scores);
                }
                Ok(scores) => {
                    failures += 1;
                    first_error.get_or_insert_with(|| {
                        format!(
                            "{}: {} scores for {inter} intermediate turns",
                            episodes[i].trajectory.id,
                            scores.len(),
                        )
                    });
                }
                Err(e) => {
                    failures += 1;
                    first_error
                        .get_or_insert_with(|| format!("{}: {e}", episodes[i].trajectory.id));
                }
            }
        }
        if failures > 0 {
            let e = first_error.unwrap_or_default();
            let rate = failures as f64 / sent as f64;
            let limit = self.settings.max_failure_rate;
            match self.settings.on_failure {
                JudgeFailure::Error => {
                    return Err(anyhow!(
                        "the judge {} failed on {failures} of {sent} rollouts; the first: {e} \
                         (judge.on_failure = \"rubric\" scores those by the rules instead)",
                        self.name()
                    ));
                }
                JudgeFailure::Rubric if rate > limit => {
                    return Err(anyhow!(
                        "the judge {} failed on {failures} of {sent} rollouts ({:.1}%), above \
                         judge.max_failure_rate = {limit}: the step would train on the rules' \
                         turn rewards instead of the judge's; the first failure: {e}",
                        self.name(),
                        100.0 * rate
                    ));
                }
                JudgeFailure::Rubric => tracing::warn!(
                    judge = %self.name(),
                    failures,
                    rollouts = sent,
                    max_failure_rate = limit,
                    "the judge failed on {failures} of {sent} rollouts, scored by the rules \
                     instead; the first: {e}"
                ),
            }
        }
        let stats = JudgeStats {
            episodes: sent,
            failures,
            turns,
            agreeing_turns: agree,
            score_sum: sum,
            seconds: t0.elapsed().as_secs_f64(),
            requests: self.judge.requests_sent() - requests0,
            cache_hits: self.judge.cache_hits() - hits0,
        };
        tracing::info!(
            mode = ?self.settings.mode,
            episodes = sent,
            failures,
            requests = stats.requests,
            cache_hits = stats.cache_hits,
            secs = stats.seconds,
            "judged the rollouts"
        );
        Ok(stats)
    }

    /// Calibrates the judge against the rules on `episodes` (held-out rollouts; `rules[i]` is
    /// episode `i`'s verifiable reward): both score every intermediate turn, and the agreement
    /// is the share of those turns whose scores are equal ([`JudgeCalibration`]).
    pub fn calibrate(
        &self,
        episodes: &[Episode],
        questions: &[String],
        golds: &[Vec<String>],
        rules: &[RewardOutput],
    ) -> JudgeCalibration {
        let t0 = Instant::now();
        let requests0 = self.judge.requests_sent();
        let verdicts = self.judge_intermediate(episodes, questions, golds);
        let mut c = JudgeCalibration {
            rollouts: episodes.len(),
            ..JudgeCalibration::default()
        };
        for (i, v) in verdicts.into_iter().enumerate() {
            let Some(verdict) = v else { continue };
            let inter = &rules[i].turn_rewards[..rules[i].turn_rewards.len().saturating_sub(1)];
            c.judged += 1;
            c.turns += inter.len();
            match verdict {
                Ok(scores) if scores.len() == inter.len() => {
                    c.scored_turns += inter.len();
                    for (j, r) in scores.iter().zip(inter) {
                        c.agreeing_turns += usize::from((j - r).abs() < AGREEMENT_TOL);
                        c.sign_agreeing_turns += usize::from(j.signum() == r.signum());
                        c.judge_sum += j;
                        c.rules_sum += r;
                    }
                }
                Ok(scores) => {
                    c.failures += 1;
                    c.first_failure.get_or_insert_with(|| {
                        format!(
                            "{}: {} scores for {} intermediate turns",
                            episodes[i].trajectory.id,
                            scores.len(),
                            inter.len()
                        )
                    });
                }
                Err(e) => {
                    c.failures += 1;
                    c.first_failure
                        .get_or_insert_with(|| format!("{}: {e}", episodes[i].trajectory.id));
                }
            }
        }
        c.requests = self.judge.requests_sent() - requests0;
        c.seconds = t0.elapsed().as_secs_f64();
        c
    }

    /// Stops the run when `c`'s agreement is under `judge.min_rubric_agreement`, naming the
    /// judge, its agreement, the floor and the fix.
    pub fn check_calibration(&self, c: &JudgeCalibration) -> Result<()> {
        let floor = self.settings.min_rubric_agreement;
        if floor <= 0.0 {
            return Ok(());
        }
        let fix = "point judge.base_url at a stronger judge (an OpenAI-compatible server of a \
                   larger instruct model: vLLM, or `turnwise serve`), or lower \
                   judge.min_rubric_agreement explicitly to train on this judge's turn rewards";
        let Some(a) = c.agreement() else {
            return Err(anyhow!(
                "the judge {}'s calibration found no intermediate turn to score in {} \
                 held-out rollouts, so its agreement with the rules cannot be measured against \
                 judge.min_rubric_agreement = {floor}: raise judge.calibration_questions, or set \
                 judge.min_rubric_agreement = 0 to train without the check",
                self.name(),
                c.rollouts
            ));
        };
        if a < floor {
            let failed = match &c.first_failure {
                Some(e) => format!(
                    "; it could not score {} of {} rollouts (counted as disagreeing), the \
                     first: {e}",
                    c.failures, c.judged
                ),
                None => String::new(),
            };
            return Err(anyhow!(
                "the judge {} agrees with the rules on {} of {} held-out intermediate turns \
                 (judge/calibration/rubric_agreement = {a:.3}), under \
                 judge.min_rubric_agreement = {floor}: its turn rewards would be noise, so the \
                 run stops before RL{failed}. Fix: {fix}",
                self.name(),
                c.agreeing_turns,
                c.turns
            ));
        }
        Ok(())
    }
}

/// The judge's calibration against the rules before RL: the starting policy's rollouts on
/// held-out (validation) questions, every intermediate turn scored by the rules (R^I_k) and by
/// the judge. `judge/calibration/rubric_agreement` = agreeing turns / intermediate turns, where
/// a turn agrees when the two scores are equal to 1e-6 and the turns of a rollout the judge
/// could not score count as disagreeing.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JudgeCalibration {
    /// Rollouts of the calibration.
    pub rollouts: usize,
    /// Of those, rollouts with at least one intermediate turn (sent to the judge).
    pub judged: usize,
    /// Of those, rollouts the judge could not score.
    pub failures: usize,
    /// Intermediate turns of the judged rollouts.
    pub turns: usize,
    /// Of those, turns whose judge score equals the rules' score.
    pub agreeing_turns: usize,
    /// Of those, turns whose judge score has the rules' sign (−, 0, +): a coarser agreement,
    /// logged for reading, not checked.
    pub sign_agreeing_turns: usize,
    /// Intermediate turns the judge scored (those of the rollouts it did not fail on).
    pub scored_turns: usize,
    /// Sum of the judge's scores of the turns it scored.
    pub judge_sum: f64,
    /// Sum of the rules' scores of those turns.
    pub rules_sum: f64,
    /// Chat requests sent.
    pub requests: usize,
    /// Seconds spent judging.
    pub seconds: f64,
    /// The first failure's message.
    pub first_failure: Option<String>,
}

impl JudgeCalibration {
    /// The share of intermediate turns on which the judge agrees with the rules (`None` when
    /// there is no intermediate turn).
    pub fn agreement(&self) -> Option<f64> {
        (self.turns > 0).then(|| self.agreeing_turns as f64 / self.turns as f64)
    }

    /// The `judge/calibration/…` metrics.
    pub fn metrics(&self) -> BTreeMap<String, f64> {
        let mut m = BTreeMap::new();
        m.insert(mk::judge::CALIBRATION_ROLLOUTS.into(), self.rollouts as f64);
        m.insert(mk::judge::CALIBRATION_EPISODES.into(), self.judged as f64);
        m.insert(mk::judge::CALIBRATION_FAILURES.into(), self.failures as f64);
        m.insert(mk::judge::CALIBRATION_TURNS.into(), self.turns as f64);
        m.insert(mk::judge::CALIBRATION_REQUESTS.into(), self.requests as f64);
        m.insert(mk::timing::JUDGE_CALIBRATION.into(), self.seconds);
        if let Some(a) = self.agreement() {
            let t = self.turns as f64;
            m.insert(mk::judge::CALIBRATION_RUBRIC_AGREEMENT.into(), a);
            m.insert(
                mk::judge::CALIBRATION_SIGN_AGREEMENT.into(),
                self.sign_agreeing_turns as f64 / t,
            );
        }
        if self.scored_turns > 0 {
            let scored = self.scored_turns as f64;
            m.insert(
                mk::judge::CALIBRATION_JUDGE_SCORE_MEAN.into(),
                self.judge_sum / scored,
            );
            m.insert(
                mk::judge::CALIBRATION_RUBRIC_SCORE_MEAN.into(),
                self.rules_sum / scored,
            );
        }
        m
    }

    /// One line for the run's output.
    pub fn line(&self) -> String {
        match self.agreement() {
            Some(a) => format!(
                "judge calibration: agrees with the rules on {} of {} held-out intermediate turns \
                 ({a:.3}; same sign on {}), {} of {} rollouts unscored",
                self.agreeing_turns,
                self.turns,
                self.sign_agreeing_turns,
                self.failures,
                self.judged
            ),
            None => format!(
                "judge calibration: no intermediate turn in {} held-out rollouts",
                self.rollouts
            ),
        }
    }
}

/// What the judge did in a step (summed over DAPO refill rounds).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct JudgeStats {
    /// Episodes sent.
    pub episodes: usize,
    /// Episodes the judge could not score.
    pub failures: usize,
    /// Intermediate turns scored by the judge.
    pub turns: usize,
    /// Of those, turns whose judge score equals the rules' score.
    pub agreeing_turns: usize,
    /// Sum of the judge's turn scores.
    pub score_sum: f64,
    /// Seconds spent judging.
    pub seconds: f64,
    /// Chat requests sent to the judge (cache hits excluded; in choice mode one per turn).
    pub requests: usize,
    /// Chat requests answered from the verdict cache.
    pub cache_hits: usize,
}

impl JudgeStats {
    /// Adds another round's totals.
    pub fn merge(&mut self, o: &Self) {
        self.episodes += o.episodes;
        self.failures += o.failures;
        self.turns += o.turns;
        self.agreeing_turns += o.agreeing_turns;
        self.score_sum += o.score_sum;
        self.seconds += o.seconds;
        self.requests += o.requests;
        self.cache_hits += o.cache_hits;
    }

    /// The `judge/…` metrics.
    pub fn metrics(&self) -> BTreeMap<String, f64> {
        let mut m = BTreeMap::new();
        m.insert(mk::judge::EPISODES.into(), self.episodes as f64);
        m.insert(mk::judge::FAILURES.into(), self.failures as f64);
        if self.episodes > 0 {
            m.insert(
                mk::judge::FAILURE_RATE.into(),
                self.failures as f64 / self.episodes as f64,
            );
        }
        m.insert(mk::judge::REQUESTS.into(), self.requests as f64);
        m.insert(mk::judge::CACHE_HITS.into(), self.cache_hits as f64);
        m.insert(mk::timing::JUDGE.into(), self.seconds);
        if self.turns > 0 {
            let t = self.turns as f64;
            m.insert(mk::judge::TURN_SCORE_MEAN.into(), self.score_sum / t);
            m.insert(
                mk::judge::RUBRIC_AGREEMENT.into(),
                self.agreeing_turns as f64 / t,
            );
        }
        m
    }
}

/// The held-out rollouts of the judge's calibration and the rules' scores of them.
#[derive(Debug)]
pub struct CalibrationRollouts {
    /// The starting policy's rollouts, one per validation question.
    pub episodes: Vec<Episode>,
    /// Each rollout's question as the judge reads it.
    pub questions: Vec<String>,
    /// Each rollout's gold answers.
    pub golds: Vec<Vec<String>>,
    /// Each rollout's verifiable reward (`turn_rewards` holds R^I_k, then R^F).
    pub rules: Vec<RewardOutput>,
}

impl Trainer {
    /// The rollouts of the judge's calibration: the current policy on the first
    /// `judge.calibration_questions` validation questions (one rollout each, at
    /// `rollout.temperature`, seeded from the run's seed), scored by the rules.
    pub fn calibration_rollouts(&self) -> Result<CalibrationRollouts> {
        let n = self.config.judge.calibration_questions;
        let questions: Vec<_> = self
            .task
            .questions(Split::Validation)
            .into_iter()
            .take(n)
            .collect();
        let seed = self.config.seed ^ 0x006a_7564_6765; // "judge"
        let mut specs = Vec::with_capacity(questions.len());
        for (i, q) in questions.iter().enumerate() {
            specs.push(EpisodeSpec {
                id: format!("judge-calibration-{}", q.id),
                prompt_uid: q.id.clone(),
                prompt_ids: self.tokenizer.encode(&self.task.prompt(q)?)?,
                task: TaskSet::env_task(q),
                seed: crate::rollout::turn_seed(seed, i),
            });
        }
        let policy = self.rollout_policy();
        let env = self.make_env();
        let mut decoding = self.decoding(self.config.rollout.temperature);
        decoding.max_response_tokens = self.config.rollout.max_response_tokens;
        let mut episodes = Vec::with_capacity(specs.len());
        for chunk in specs.chunks(64) {
            episodes.extend(run_chains(&policy, chunk.to_vec(), &env, &decoding)?);
        }
        let golds: Vec<Vec<String>> = questions.iter().map(|q| q.golden_answers.clone()).collect();
        let prompts: Vec<String> = specs
            .iter()
            .map(|s| s.task.prompt.clone().unwrap_or_default())
            .collect();
        let rules = episodes
            .iter()
            .zip(&golds)
            .map(|(ep, gold)| self.task.score_episode(&self.config.reward, ep, gold))
            .collect::<Result<Vec<_>>>()?;
        Ok(CalibrationRollouts {
            episodes,
            questions: prompts,
            golds,
            rules,
        })
    }

    /// The judge's calibration before RL ([`JudgeCalibration`]) on
    /// [`Trainer::calibration_rollouts`]: the judge scores their intermediate turns. `None`
    /// without a judge or with `judge.calibration_questions = 0`. It logs its line; the caller
    /// checks it ([`TurnJudge::check_calibration`]).
    pub fn calibrate_judge(&self) -> Result<Option<JudgeCalibration>> {
        let Some(judge) = &self.judge else {
            return Ok(None);
        };
        if self.config.judge.calibration_questions == 0 {
            return Ok(None);
        }
        let r = self.calibration_rollouts()?;
        let c = judge.calibrate(&r.episodes, &r.questions, &r.golds, &r.rules);
        tracing::info!(judge = %judge.name(), "{}", c.line());
        Ok(Some(c))
    }

    /// The run's judge, if any.
    pub fn judge(&self) -> Option<&TurnJudge> {
        self.judge.as_ref()
    }
}
