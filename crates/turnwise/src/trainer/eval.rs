//! Evaluation on one named split: EM, F1, SubEM, format validity, tool calls, turns and tokens
//! per answer, broken down by hop count; greedy or sampled. Splits are never pooled: every
//! result names its split and its number of questions.

use std::collections::BTreeMap;

use anyhow::Result;
use turnwise_core::grammar::search_r1::AnswerRule;
use turnwise_core::reward::{RewardInput, em, squad_f1, sub_em};
use turnwise_env::world::Split;

use super::Trainer;
use crate::rollout::{Episode, EpisodeSpec, RolloutControl, run_chains_with};
use crate::run::PairedGain;
use crate::task::{QaItem, TaskSet};
use turnwise_core::trajectory::{Trajectory, TurnAction};

/// Results of one evaluation.
///
/// A game's evaluation ([`EvalResult::is_game`]) is serialized (`turnwise eval`, summary.json)
/// and logged with its own figures only: the success rate (`success` and `success_se`; logged
/// as `em` and `em_se`), steps to success and the invalid-action rate, with format validity,
/// turns and tokens; the search task's answer figures (F1, SubEM, answered, searches, EM by hop)
/// are left out.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EvalResult {
    /// The split evaluated: `train`, `validation` or `test`.
    pub split: String,
    /// Questions evaluated: the first `n` of the split (fewer than asked when the split is
    /// smaller).
    pub n: usize,
    /// Exact match.
    pub em: f64,
    /// Standard error of `em` (binomial).
    pub em_se: f64,
    /// SQuAD F1.
    pub f1: f64,
    /// Substring EM.
    pub sub_em: f64,
    /// Fraction of episodes whose agent wrote an answer (extracted from its own turns as the
    /// rewards do: the last `<answer>` block, or for the boxed format the first block's last
    /// `\boxed{}`).
    pub answered: f64,
    /// Fraction of turns with a valid format.
    pub format_ok: f64,
    /// Mean searches per question.
    pub tool_calls: f64,
    /// Mean turns per question.
    pub turns: f64,
    /// Mean agent tokens per question.
    pub agent_tokens: f64,
    /// EM and question count by hop count (questions of unknown hop count are left out).
    pub em_by_hops: BTreeMap<usize, (f64, usize)>,
    /// Games: mean turns of the won episodes (0 when none was won); `None` for the search task.
    pub steps_to_success: Option<f64>,
    /// Games: fraction of turns whose action the game could not parse; `None` for the search
    /// task.
    pub invalid_actions: Option<f64>,
    /// The parts of a composite training reward (the two-turn rubrics: `tool_execution`,
    /// `search_result_presence`, …), each a mean over the questions; empty otherwise.
    pub reward_parts: BTreeMap<String, f64>,
    /// Samples drawn per question (`eval.samples`; 1, the default, is one episode a question).
    /// With more, every figure above is a mean over all `n × samples` episodes, i.e. mean@k,
    /// and `em_se` is the standard error over questions of each question's mean EM.
    pub samples: usize,
    /// pass@k for k = 1, 2, 4, … up to `samples` (and `samples` itself): the chance that at
    /// least one of k samples of a question is right (EM 1, a game won), by the unbiased
    /// estimator of Chen et al. (2021) over the `samples` drawn, averaged over questions.
    /// Empty when one sample per question was drawn.
    pub pass_at: BTreeMap<usize, f64>,
}

impl serde::Serialize for EvalResult {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("split", &self.split)?;
        m.serialize_entry("n", &self.n)?;
        if self.is_game() {
            m.serialize_entry("success", &self.em)?;
            m.serialize_entry("success_se", &self.em_se)?;
            m.serialize_entry("steps_to_success", &self.steps_to_success)?;
            m.serialize_entry("invalid_actions", &self.invalid_actions)?;
            m.serialize_entry("format_ok", &self.format_ok)?;
            m.serialize_entry("turns", &self.turns)?;
            m.serialize_entry("agent_tokens", &self.agent_tokens)?;
            if self.samples > 1 {
                m.serialize_entry("samples", &self.samples)?;
                m.serialize_entry("pass_at", &self.pass_at_named())?;
            }
            return m.end();
        }
        m.serialize_entry("em", &self.em)?;
        m.serialize_entry("em_se", &self.em_se)?;
        m.serialize_entry("f1", &self.f1)?;
        m.serialize_entry("sub_em", &self.sub_em)?;
        m.serialize_entry("answered", &self.answered)?;
        m.serialize_entry("format_ok", &self.format_ok)?;
        m.serialize_entry("tool_calls", &self.tool_calls)?;
        m.serialize_entry("turns", &self.turns)?;
        m.serialize_entry("agent_tokens", &self.agent_tokens)?;
        m.serialize_entry("em_by_hops", &self.em_by_hops)?;
        if !self.reward_parts.is_empty() {
            m.serialize_entry("reward_parts", &self.reward_parts)?;
        }
        if self.samples > 1 {
            m.serialize_entry("samples", &self.samples)?;
            m.serialize_entry("pass_at", &self.pass_at_named())?;
        }
        m.end()
    }
}

impl EvalResult {
    /// [`EvalResult::pass_at`] keyed `pass@k`, as summaries print it.
    fn pass_at_named(&self) -> BTreeMap<String, f64> {
        self.pass_at
            .iter()
            .map(|(k, v)| (format!("pass@{k}"), *v))
            .collect()
    }

    /// Whether this is a game's evaluation (it has the invalid-action rate).
    pub fn is_game(&self) -> bool {
        self.invalid_actions.is_some()
    }

    /// Metrics under `prefix` (e.g. `eval/test/greedy`, see [`eval_prefix`]), with the number of
    /// questions as `{prefix}/n`; a game's only with its own figures (see [`EvalResult`]).
    pub fn to_metrics(&self, prefix: &str) -> BTreeMap<String, f64> {
        let mut m = BTreeMap::new();
        m.insert(format!("{prefix}/n"), self.n as f64);
        m.insert(format!("{prefix}/em"), self.em);
        m.insert(format!("{prefix}/em_se"), self.em_se);
        m.insert(format!("{prefix}/format_ok"), self.format_ok);
        m.insert(format!("{prefix}/turns"), self.turns);
        m.insert(format!("{prefix}/agent_tokens"), self.agent_tokens);
        if self.samples > 1 {
            m.insert(format!("{prefix}/samples"), self.samples as f64);
            m.insert(format!("{prefix}/mean@{}", self.samples), self.em);
            for (k, v) in &self.pass_at {
                m.insert(format!("{prefix}/pass@{k}"), *v);
            }
        }
        if self.is_game() {
            m.insert(
                format!("{prefix}/steps_to_success"),
                self.steps_to_success.unwrap_or(0.0),
            );
            m.insert(
                format!("{prefix}/invalid_actions"),
                self.invalid_actions.unwrap_or(0.0),
            );
            return m;
        }
        m.insert(format!("{prefix}/f1"), self.f1);
        m.insert(format!("{prefix}/sub_em"), self.sub_em);
        m.insert(format!("{prefix}/answered"), self.answered);
        m.insert(format!("{prefix}/tool_calls"), self.tool_calls);
        for (h, (e, n)) in &self.em_by_hops {
            m.insert(format!("{prefix}/em/hop{h}"), *e);
            m.insert(format!("{prefix}/n/hop{h}"), *n as f64);
        }
        for (name, v) in &self.reward_parts {
            m.insert(format!("{prefix}/{REWARD_PART}{name}"), *v);
        }
        m
    }

    /// The evaluation of `split` logged under `prefix` by [`EvalResult::to_metrics`], read back
    /// from a metrics line (`get` returns a key's value); `None` when the line has no
    /// `{prefix}/em`.
    pub fn from_metrics(
        split: &str,
        prefix: &str,
        get: impl Fn(&str) -> Option<f64>,
    ) -> Option<Self> {
        let field = |k: &str| get(&format!("{prefix}/{k}"));
        let em = field("em")?;
        let mut em_by_hops = BTreeMap::new();
        for h in 0..=16usize {
            if let Some(e) = field(&format!("em/hop{h}")) {
                let n = field(&format!("n/hop{h}")).unwrap_or(0.0) as usize;
                em_by_hops.insert(h, (e, n));
            }
        }
        let samples = field("samples").map_or(1, |k| k as usize);
        let mut pass_at = BTreeMap::new();
        for k in pass_at_ks(samples) {
            if let Some(v) = field(&format!("pass@{k}")) {
                pass_at.insert(k, v);
            }
        }
        Some(Self {
            split: split.to_owned(),
            n: field("n").unwrap_or(0.0) as usize,
            samples,
            pass_at,
            em,
            em_se: field("em_se").unwrap_or(0.0),
            f1: field("f1").unwrap_or(0.0),
            sub_em: field("sub_em").unwrap_or(0.0),
            answered: field("answered").unwrap_or(0.0),
            format_ok: field("format_ok").unwrap_or(0.0),
            tool_calls: field("tool_calls").unwrap_or(0.0),
            turns: field("turns").unwrap_or(0.0),
            agent_tokens: field("agent_tokens").unwrap_or(0.0),
            em_by_hops,
            steps_to_success: field("steps_to_success"),
            invalid_actions: field("invalid_actions"),
            // The parts a reward may log (the two-turn rubrics).
            reward_parts: turnwise_core::reward::two_turn::PARTS
                .iter()
                .filter_map(|p| Some(((*p).to_owned(), field(&format!("{REWARD_PART}{p}"))?)))
                .collect(),
        })
    }
}

/// The k of the pass@k an evaluation with `samples` samples per question reports: 1, 2, 4, …
/// below `samples`, and `samples` itself; none for one sample.
pub fn pass_at_ks(samples: usize) -> Vec<usize> {
    if samples <= 1 {
        return Vec::new();
    }
    let mut ks: Vec<usize> = std::iter::successors(Some(1usize), |k| k.checked_mul(2))
        .take_while(|&k| k < samples)
        .collect();
    ks.push(samples);
    ks
}

/// The unbiased pass@k estimate from `n` samples of which `c` are right (Chen et al. 2021,
/// "Evaluating Large Language Models Trained on Code", eq. 1): 1 − C(n−c, k) / C(n, k),
/// computed as 1 − ∏_{i=n−c+1}^{n} (1 − k/i) for stability. Needs `k ≤ n`.
pub fn pass_at_k(n: usize, c: usize, k: usize) -> f64 {
    assert!(k >= 1 && k <= n && c <= n, "pass@{k} of {c} right in {n}");
    if n - c < k {
        return 1.0;
    }
    1.0 - ((n - c + 1)..=n)
        .map(|i| 1.0 - k as f64 / i as f64)
        .product::<f64>()
}

/// The key prefix of a reward part in an evaluation's metrics (`eval/test/greedy/r_exact_match`).
pub const REWARD_PART: &str = "r_";

/// The metrics prefix of an evaluation of `split` with decoding `mode` (`greedy`, `sampled`):
/// `eval/<split>/<mode>`.
pub fn eval_prefix(split: Split, mode: &str) -> String {
    format!("eval/{}/{mode}", split.name())
}

/// One evaluated question: what was asked, what the agent did and how it scored.
#[derive(Debug, Clone, serde::Serialize)]
pub struct EvalEpisode {
    /// The question's id in the world.
    pub question_id: String,
    /// Which of the question's samples this is (0 with one sample per question).
    pub sample: usize,
    /// The question text.
    pub question: String,
    /// Hops from the subject to the answer.
    pub hops: usize,
    /// Accepted answers.
    pub golden_answers: Vec<String>,
    /// The agent's answer, extracted from its own turns as the rewards do, if it wrote one.
    pub answer: Option<String>,
    /// Exact match of `answer`.
    pub em: f64,
    /// Token F1 of `answer`.
    pub f1: f64,
    /// The decoded response: agent turns and observations.
    pub text: String,
    /// The token-exact trajectory.
    pub trajectory: Trajectory,
}

impl EvalEpisode {
    /// The question's outcome alone, as a run directory keeps it (`evals/`).
    pub fn outcome(&self) -> QuestionOutcome {
        QuestionOutcome {
            question_id: self.question_id.clone(),
            hops: self.hops,
            em: self.em,
            f1: self.f1,
            answer: self.answer.clone(),
        }
    }
}

/// One outcome per question from the episodes of an evaluation (in their order, a question's
/// samples consecutive): with several samples a question's EM and F1 are their means (mean@k)
/// and its answer the first sample's, so two evaluations of the same questions still pair
/// question by question ([`paired_gain`]).
pub fn question_outcomes(episodes: &[EvalEpisode]) -> Vec<QuestionOutcome> {
    let mut out: Vec<(QuestionOutcome, usize)> = Vec::new();
    for e in episodes {
        match out.last_mut() {
            Some((q, k)) if q.question_id == e.question_id && e.sample > 0 => {
                q.em += e.em;
                q.f1 += e.f1;
                *k += 1;
            }
            _ => out.push((e.outcome(), 1)),
        }
    }
    out.into_iter()
        .map(|(mut q, k)| {
            q.em /= k as f64;
            q.f1 /= k as f64;
            q
        })
        .collect()
}

/// How one evaluated question went: what a run keeps of every evaluation
/// (`evals/<split>-<mode>-step-N.jsonl`), so that two evaluations of the same questions can be
/// compared question by question ([`paired_gain`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct QuestionOutcome {
    /// The question's id in the world (a game's episode id).
    pub question_id: String,
    /// Hops from the subject to the answer (0: unknown).
    pub hops: usize,
    /// Exact match (a game's success).
    pub em: f64,
    /// Token F1.
    pub f1: f64,
    /// The agent's answer, if it wrote one.
    pub answer: Option<String>,
}

/// Why two evaluations cannot be compared question by question.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GainError {
    /// They evaluated different numbers of questions.
    #[error(
        "the evaluations have {before} and {after} questions; a paired gain needs the same questions"
    )]
    Count {
        /// Questions before.
        before: usize,
        /// Questions after.
        after: usize,
    },
    /// They evaluated other questions, or in another order.
    #[error(
        "question {index} is {before:?} before and {after:?} after; a paired gain needs the same questions in the same order"
    )]
    Question {
        /// Position in the evaluation.
        index: usize,
        /// Its id before.
        before: String,
        /// Its id after.
        after: String,
    },
    /// No question was evaluated.
    #[error("no question was evaluated")]
    Empty,
}

/// The [`PairedGain`] from `before` to `after`, two evaluations of the same questions in the
/// same order.
pub fn paired_gain(
    before: &[QuestionOutcome],
    after: &[QuestionOutcome],
) -> Result<PairedGain, GainError> {
    if before.len() != after.len() {
        return Err(GainError::Count {
            before: before.len(),
            after: after.len(),
        });
    }
    if before.is_empty() {
        return Err(GainError::Empty);
    }
    for (index, (b, a)) in before.iter().zip(after).enumerate() {
        if b.question_id != a.question_id {
            return Err(GainError::Question {
                index,
                before: b.question_id.clone(),
                after: a.question_id.clone(),
            });
        }
    }
    let n = before.len();
    let d: Vec<f64> = before.iter().zip(after).map(|(b, a)| a.em - b.em).collect();
    let gain = d.iter().sum::<f64>() / n as f64;
    let se = if n > 1 {
        let var = d.iter().map(|x| (x - gain).powi(2)).sum::<f64>() / (n - 1) as f64;
        (var / n as f64).sqrt()
    } else {
        0.0
    };
    let mean = |xs: &[QuestionOutcome]| xs.iter().map(|q| q.em).sum::<f64>() / n as f64;
    Ok(PairedGain {
        n,
        before: mean(before),
        after: mean(after),
        gain,
        se,
        improved: d.iter().filter(|&&x| x > 0.0).count(),
        regressed: d.iter().filter(|&&x| x < 0.0).count(),
    })
}

impl Trainer {
    /// Evaluates on the first `n` questions of `split`, greedy (`temperature` 0) or sampled.
    pub fn evaluate(
        &self,
        split: Split,
        n: usize,
        temperature: f64,
        seed: u64,
    ) -> Result<EvalResult> {
        Ok(self.evaluate_with_episodes(split, n, temperature, seed)?.0)
    }

    /// [`Trainer::evaluate`], also returning one [`EvalEpisode`] per question (in the order
    /// the questions were asked) for inspection: `turnwise eval --dump FILE` writes them.
    pub fn evaluate_with_episodes(
        &self,
        split: Split,
        n: usize,
        temperature: f64,
        seed: u64,
    ) -> Result<(EvalResult, Vec<EvalEpisode>)> {
        self.evaluate_samples(split, n, temperature, seed, 1)
    }

    /// [`Trainer::evaluate_with_episodes`] with `samples` episodes per question (sampled
    /// decoding; `samples` must be 1 when `temperature` is 0): the figures are means over every
    /// episode (mean@k), [`EvalResult::pass_at`] holds pass@k, and the episodes come question
    /// by question, a question's samples consecutive. The first sample of every question is
    /// the episode a one-sample evaluation with the same seed draws.
    pub fn evaluate_samples(
        &self,
        split: Split,
        n: usize,
        temperature: f64,
        seed: u64,
        samples: usize,
    ) -> Result<(EvalResult, Vec<EvalEpisode>)> {
        anyhow::ensure!(samples >= 1, "eval.samples must be at least 1, got 0");
        anyhow::ensure!(
            samples == 1 || temperature > 0.0,
            "{samples} samples per question need sampled decoding (temperature > 0): greedy \
             decoding draws the same episode every time"
        );
        let questions: Vec<_> = self.task.questions(split).into_iter().take(n).collect();
        let nq = questions.len();
        let specs = self.eval_specs(&questions, seed, samples)?;
        // The question of each episode, in the episodes' order.
        let questions: Vec<_> = questions
            .iter()
            .flat_map(|&q| std::iter::repeat_n(q, samples))
            .collect();
        let episodes = self.eval_episodes(&specs, temperature, split)?;
        let mut tally = EvalTally::new(
            EvalResult {
                split: split.name().to_owned(),
                n: nq,
                samples,
                ..EvalResult::default()
            },
            self.task.scored_by_return(),
            episodes.len(),
        );
        self.score_eval_episodes(&mut tally, &episodes, &questions, samples)?;
        Ok(tally.finish(episodes.len(), samples))
    }

    /// The episodes of an evaluation: `samples` per question, a question's samples
    /// consecutive; sample `j` of question `i` is seeded by episode index `i + j·nq`.
    fn eval_specs(
        &self,
        questions: &[&QaItem],
        seed: u64,
        samples: usize,
    ) -> Result<Vec<EpisodeSpec>> {
        let nq = questions.len();
        let mut specs = Vec::with_capacity(nq * samples);
        for (i, q) in questions.iter().enumerate() {
            let prompt_ids = self.tokenizer.encode(&self.task.prompt(q)?)?;
            for j in 0..samples {
                specs.push(EpisodeSpec {
                    id: if j == 0 {
                        format!("eval-{}", q.id)
                    } else {
                        format!("eval-{}-s{j}", q.id)
                    },
                    prompt_uid: q.id.clone(),
                    prompt_ids: prompt_ids.clone(),
                    task: TaskSet::env_task(q),
                    seed: crate::rollout::turn_seed(seed, i + j * nq),
                });
            }
        }
        Ok(specs)
    }

    /// Plays the evaluation episodes `specs` at `temperature`: through the agent program when
    /// there is one, else as rollout chains, 64 at a time.
    fn eval_episodes(
        &self,
        specs: &[EpisodeSpec],
        temperature: f64,
        split: Split,
    ) -> Result<Vec<Episode>> {
        let policy = self.rollout_policy();
        let env = self.make_env();
        let mut decoding = self.decoding(temperature);
        decoding.max_response_tokens = self.config.rollout.max_response_tokens;
        // The agent's context is part of the agent: with a memory window (GiGPO's and T2PO's
        // verl-agent prompts re-render the task and the last P turns) it sees at evaluation
        // what it saw in training. The training-time controls (TTI, TDS) do not run here.
        let control = RolloutControl {
            memory_window: self.config.rollout.memory_window,
            ..RolloutControl::default()
        };
        let mut episodes = Vec::new();
        if let Some(out) = self.run_harness(specs, &decoding, split.name()) {
            // The agent program's episodes: per question its last trajectory (the one with its
            // answer); a failed episode is an empty one, scored as no answer.
            let out = out?;
            let mut last: Vec<Option<Episode>> = specs.iter().map(|_| None).collect();
            for (ep, (&src, &fin)) in out
                .episodes
                .into_iter()
                .zip(out.sources.iter().zip(&out.is_final))
            {
                if fin {
                    last[src] = Some(ep);
                }
            }
            episodes = specs
                .iter()
                .zip(last)
                .map(|(spec, ep)| ep.unwrap_or_else(|| Episode::empty(spec)))
                .collect();
        } else {
            for chunk in specs.chunks(64) {
                episodes.extend(
                    run_chains_with(&policy, chunk.to_vec(), &env, &decoding, &control)?.episodes,
                );
            }
        }
        Ok(episodes)
    }

    /// Scores each episode against its question (`questions[k]` for `episodes[k]`) into
    /// `tally`: EM, F1 and SubEM of the answer its agent wrote (a game's: whether it won),
    /// reward parts, tool calls, turns, tokens, format validity, and its [`EvalEpisode`].
    fn score_eval_episodes(
        &self,
        tally: &mut EvalTally,
        episodes: &[Episode],
        questions: &[&QaItem],
        samples: usize,
    ) -> Result<()> {
        let format = self.config.task.format.grammar();
        let game = tally.game;
        // A composite reward's parts (the two-turn rubrics), as training logs them; other
        // rewards have none and are not scored again.
        let has_parts = !game && !self.config.reward.part_names().is_empty();
        let parts_of = |ep: &Episode, golds: &[String]| -> Result<Vec<_>> {
            if !has_parts {
                return Ok(Vec::new());
            }
            Ok(self
                .task
                .score_episode(&self.config.reward, ep, golds)?
                .parts)
        };
        let r = &mut tally.r;
        for (k, (ep, q)) in episodes.iter().zip(questions).enumerate() {
            let golds = &q.golden_answers;
            // The rewards' extraction: an answer the agent wrote inside one of its own turns,
            // never text of an observation or the prompt.
            let turns = super::reward_turns(ep);
            let answer = RewardInput::from_turns(&turns, golds)
                .answer(format, AnswerRule::LastMatch)
                .map(str::to_owned);
            let (e, f, s) = match &answer {
                // A game's success is its EM (there is no answer to read).
                _ if game => {
                    let w = f64::from(u8::from(ep.won));
                    (w, w, w)
                }
                Some(a) => (em(a, golds), squad_f1(a, golds), sub_em(a, golds)),
                None => (0.0, 0.0, 0.0),
            };
            if ep.won {
                tally.won += 1;
                tally.won_turns += ep.trajectory.num_turns();
            }
            tally.invalid += ep
                .trajectory
                .turns
                .iter()
                .filter(|t| matches!(t.action, TurnAction::Invalid { .. }))
                .count();
            for (name, v) in parts_of(ep, golds)? {
                *r.reward_parts.entry(name.to_owned()).or_default() += v;
            }
            r.em += e;
            r.f1 += f;
            r.sub_em += s;
            r.answered += f64::from(u8::from(answer.is_some()));
            r.tool_calls += ep.trajectory.search_count() as f64;
            r.turns += ep.trajectory.num_turns() as f64;
            r.agent_tokens += ep.trajectory.agent_token_count() as f64;
            tally.turns_total += ep.trajectory.turns.len();
            tally.fmt_ok += ep.trajectory.turns.iter().filter(|t| t.format_ok).count();
            // Hop count 0 means unknown (Search-R1 data without a `hops` field): no breakdown.
            if q.hops() > 0 {
                let h = r.em_by_hops.entry(q.hops()).or_insert((0.0, 0));
                h.0 += e;
                h.1 += 1;
            }
            tally.dumped.push(EvalEpisode {
                question_id: q.id.clone(),
                sample: k % samples,
                question: q.text.clone(),
                hops: q.hops(),
                golden_answers: golds.clone(),
                answer,
                em: e,
                f1: f,
                text: ep.response_text(),
                trajectory: ep.trajectory.clone(),
            });
        }
        Ok(())
    }
}

/// The sums of an evaluation's scored episodes ([`Trainer::evaluate_samples`]).
struct EvalTally {
    /// The figures, summed until [`Self::finish`] turns them into means.
    r: EvalResult,
    /// Whether the task is a game (scored by its return).
    game: bool,
    /// Agent turns over every episode.
    turns_total: usize,
    /// Agent turns in the format.
    fmt_ok: usize,
    /// Episodes won.
    won: usize,
    /// Turns of the episodes won.
    won_turns: usize,
    /// Invalid actions.
    invalid: usize,
    /// One [`EvalEpisode`] per episode scored.
    dumped: Vec<EvalEpisode>,
}

impl EvalTally {
    fn new(r: EvalResult, game: bool, episodes: usize) -> Self {
        Self {
            r,
            game,
            turns_total: 0,
            fmt_ok: 0,
            won: 0,
            won_turns: 0,
            invalid: 0,
            dumped: Vec::with_capacity(episodes),
        }
    }

    /// The means over the `episodes` episodes (`samples` per question), the standard error
    /// and pass@k over the questions, and a game's own figures.
    fn finish(self, episodes: usize, samples: usize) -> (EvalResult, Vec<EvalEpisode>) {
        let Self {
            mut r,
            game,
            turns_total,
            fmt_ok,
            won,
            won_turns,
            invalid,
            dumped,
        } = self;
        let n = episodes.max(1) as f64;
        r.em /= n;
        r.f1 /= n;
        r.sub_em /= n;
        r.answered /= n;
        r.tool_calls /= n;
        r.turns /= n;
        r.agent_tokens /= n;
        for v in r.reward_parts.values_mut() {
            *v /= n;
        }
        r.format_ok = fmt_ok as f64 / turns_total.max(1) as f64;
        // Over questions: each question's mean EM (its one EM with one sample, where this is
        // the binomial error).
        let per_question: Vec<(f64, usize)> = dumped
            .chunks(samples)
            .map(|c| {
                let right = c.iter().filter(|e| e.em >= 1.0).count();
                (c.iter().map(|e| e.em).sum::<f64>() / c.len() as f64, right)
            })
            .collect();
        let nq_f = per_question.len().max(1) as f64;
        r.em_se = (per_question
            .iter()
            .map(|(m, _)| (m - r.em).powi(2))
            .sum::<f64>()
            / nq_f
            / nq_f)
            .sqrt();
        for k in pass_at_ks(samples) {
            let p = per_question
                .iter()
                .map(|&(_, c)| pass_at_k(samples, c, k))
                .sum::<f64>()
                / nq_f;
            r.pass_at.insert(k, p);
        }
        if game {
            r.steps_to_success = Some(won_turns as f64 / won.max(1) as f64);
            r.invalid_actions = Some(invalid as f64 / turns_total.max(1) as f64);
        }
        for v in r.em_by_hops.values_mut() {
            v.0 /= v.1.max(1) as f64;
            // Counted per episode: the questions are every `samples` of them.
            v.1 /= samples;
        }
        (r, dumped)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcomes(ems: &[f64]) -> Vec<QuestionOutcome> {
        ems.iter()
            .enumerate()
            .map(|(i, &em)| QuestionOutcome {
                question_id: format!("test_{i}"),
                hops: 1,
                em,
                f1: em,
                answer: None,
            })
            .collect()
    }

    /// Differences [0, 1, 0, 0, −1]: mean 0, sample variance 2/4, so the error is
    /// √(0.5 / 5) = 0.316228 with one question up and one down.
    #[test]
    fn paired_gain_of_a_known_vector() {
        let g = paired_gain(
            &outcomes(&[1.0, 0.0, 1.0, 0.0, 1.0]),
            &outcomes(&[1.0, 1.0, 1.0, 0.0, 0.0]),
        )
        .unwrap();
        assert_eq!((g.n, g.improved, g.regressed), (5, 1, 1));
        assert!((g.before - 0.6).abs() < 1e-12 && (g.after - 0.6).abs() < 1e-12);
        assert!(g.gain.abs() < 1e-12);
        assert!((g.se - 0.1f64.sqrt()).abs() < 1e-6, "{}", g.se);
        // Three up, none down, of four: mean 0.75, sample variance 0.25, error 0.25.
        let g = paired_gain(
            &outcomes(&[0.0, 0.0, 0.0, 1.0]),
            &outcomes(&[1.0, 1.0, 1.0, 1.0]),
        )
        .unwrap();
        assert!((g.gain - 0.75).abs() < 1e-12 && (g.se - 0.25).abs() < 1e-12);
    }

    /// The paired error counts only changed outcomes: unchanged questions add nothing to the
    /// differences, and identical evaluations have no error at all.
    #[test]
    fn unchanged_questions_carry_no_paired_error() {
        let same = outcomes(&[1.0, 0.0, 1.0, 1.0, 0.0, 0.0]);
        let g = paired_gain(&same, &same).unwrap();
        assert_eq!((g.gain, g.se, g.improved, g.regressed), (0.0, 0.0, 0, 0));
        // One flip among many agreeing questions: far below the binomial errors of either.
        let mut before = outcomes(&[0.0; 400]);
        let mut after = before.clone();
        for (i, q) in before.iter_mut().enumerate().take(200) {
            q.em = 1.0;
            after[i].em = 1.0;
        }
        after[300].em = 1.0;
        let g = paired_gain(&before, &after).unwrap();
        let binomial = (0.5f64 * 0.5 / 400.0).sqrt();
        assert!(g.se < binomial / 5.0, "{} vs {binomial}", g.se);
    }

    /// Chen et al.'s estimator on hand-computed cases: 2 right of 5 gives pass@1 = 2/5,
    /// pass@2 = 1 − C(3,2)/C(5,2) = 0.7, pass@4 = 1 − 0 = 1 (only 3 wrong to pick 4 from);
    /// none right gives 0 and all right 1.
    #[test]
    fn pass_at_k_of_known_counts() {
        assert!((pass_at_k(5, 2, 1) - 0.4).abs() < 1e-12);
        assert!((pass_at_k(5, 2, 2) - 0.7).abs() < 1e-12);
        assert!((pass_at_k(5, 2, 3) - 0.9).abs() < 1e-12);
        assert_eq!(pass_at_k(5, 2, 4), 1.0);
        assert_eq!(pass_at_k(8, 0, 4), 0.0);
        assert_eq!(pass_at_k(8, 8, 1), 1.0);
        // 1 of 10, k = 3: 1 − C(9,3)/C(10,3) = 1 − 84/120 = 0.3.
        assert!((pass_at_k(10, 1, 3) - 0.3).abs() < 1e-12);
        assert_eq!(pass_at_ks(1), Vec::<usize>::new());
        assert_eq!(pass_at_ks(8), vec![1, 2, 4, 8]);
        assert_eq!(pass_at_ks(6), vec![1, 2, 4, 6]);
    }

    /// pass@k never falls as k grows, and pass@1 is the fraction right.
    #[test]
    fn pass_at_k_rises_with_k() {
        for n in 1..=12 {
            for c in 0..=n {
                assert!((pass_at_k(n, c, 1) - c as f64 / n as f64).abs() < 1e-12);
                for k in 1..n {
                    assert!(pass_at_k(n, c, k + 1) >= pass_at_k(n, c, k) - 1e-12);
                }
            }
        }
    }

    fn episode(id: &str, sample: usize, em: f64) -> EvalEpisode {
        EvalEpisode {
            question_id: id.into(),
            sample,
            question: String::new(),
            hops: 2,
            golden_answers: vec![],
            answer: Some(format!("a{sample}")),
            em,
            f1: em,
            text: String::new(),
            trajectory: Trajectory {
                id: format!("{id}-{sample}"),
                prompt_uid: id.into(),
                prompt_ids: vec![],
                segments: vec![],
                turns: vec![],
                finish: Default::default(),
                outcome_reward: None,
                turn_rewards: vec![],
            },
        }
    }

    /// A question's samples become one outcome with their mean EM; one-sample evaluations are
    /// unchanged, and a question asked twice in a row with one sample stays two questions.
    #[test]
    fn question_outcomes_average_a_questions_samples() {
        let eps = [
            episode("q1", 0, 1.0),
            episode("q1", 1, 0.0),
            episode("q1", 2, 1.0),
            episode("q1", 3, 1.0),
            episode("q2", 0, 0.0),
            episode("q2", 1, 0.0),
            episode("q2", 2, 0.0),
            episode("q2", 3, 1.0),
        ];
        let q = question_outcomes(&eps);
        assert_eq!(q.len(), 2);
        assert_eq!((q[0].question_id.as_str(), q[0].em), ("q1", 0.75));
        assert_eq!((q[1].question_id.as_str(), q[1].em), ("q2", 0.25));
        assert_eq!(q[0].answer.as_deref(), Some("a0"));
        let single = [episode("q1", 0, 1.0), episode("q1", 0, 0.0)];
        assert_eq!(question_outcomes(&single).len(), 2);
    }

    #[test]
    fn other_questions_are_refused() {
        let a = outcomes(&[1.0, 0.0]);
        assert_eq!(
            paired_gain(&a, &outcomes(&[1.0])),
            Err(GainError::Count {
                before: 2,
                after: 1
            })
        );
        let mut b = a.clone();
        b[1].question_id = "validation_1".into();
        let e = paired_gain(&a, &b).unwrap_err();
        assert!(e.to_string().contains("question 1 is \"test_1\""), "{e}");
        assert_eq!(paired_gain(&[], &[]), Err(GainError::Empty));
    }
}
