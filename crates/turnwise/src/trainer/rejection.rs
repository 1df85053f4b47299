//! Rejection-sampling fine-tuning (RFT), T2PO's cold start (t2po.md App. B.1, spec §8.5): the
//! current policy answers training questions with the RL prompting, tool format and rollout
//! control (chains, with the T2PO thinking intervention, turn resampling and memory window when
//! configured); every rollout is scored with the run's reward, the rollouts whose score is at or
//! above a threshold are kept, and the policy is fine-tuned on them with the warm start's
//! supervised step ([`crate::update::sft_step`]: negative log-likelihood of the agent tokens
//! only; observations and forced tokens are masked out) for a few epochs. Settings:
//! [`crate::config::RsftConfig`].

use anyhow::{Context, Result, bail};
use turnwise_core::metric_keys as mk;
use turnwise_model::optim::AdamW;
use turnwise_model::rng::TurnRng;

use super::{Trainer, adamw, shuffle};
use crate::config::RsftConfig;
use crate::rollout::{Episode, EpisodeSpec, RolloutControl, run_chains_with, turn_seed};
use crate::task::{QaItem, TaskSet};
use crate::update::{Row, sft_step};

/// Episodes rolled out together in one batch.
const SAMPLING_CHUNK: usize = 64;

/// Where a rejection-sampling fine-tuning stands, reported to the caller's callback.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RsftProgress {
    /// `done` of `total` rollouts are sampled and scored.
    Sampled {
        /// Rollouts done.
        done: usize,
        /// Rollouts in all.
        total: usize,
    },
    /// Sampling is over; the fine-tuning will make `steps` updates.
    Filtered {
        /// Rollouts kept.
        kept: usize,
        /// Rollouts sampled.
        sampled: usize,
        /// Optimizer steps to come (0 when nothing was kept).
        steps: u64,
    },
    /// One optimizer update was made.
    Step {
        /// Update number, from 1.
        step: u64,
        /// Updates in all.
        total: u64,
        /// Epoch of the update, from 1.
        epoch: usize,
        /// Mean negative log-likelihood per agent token of the batch.
        loss: f64,
        /// Learning rate.
        lr: f64,
    },
}

/// What a rejection-sampling fine-tuning did.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct RsftReport {
    /// Questions answered.
    pub questions: usize,
    /// Rollouts sampled.
    pub sampled: usize,
    /// Rollouts kept (score at or above the threshold, with at least one agent token).
    pub kept: usize,
    /// `kept / sampled`.
    pub kept_fraction: f64,
    /// Questions with at least one kept rollout.
    pub questions_covered: usize,
    /// Mean reward of all sampled rollouts.
    pub score_mean: f64,
    /// Mean EM of all sampled rollouts.
    pub em_mean: f64,
    /// Fraction of sampled rollouts whose format the reward accepted.
    pub format_ok: f64,
    /// Optimizer updates applied.
    pub steps: u64,
    /// Updates skipped for a non-finite loss or gradient.
    pub skipped_steps: u64,
    /// Mean loss of each epoch (empty when nothing was kept).
    pub epoch_loss: Vec<f64>,
    /// Seconds spent sampling and scoring.
    pub sampling_seconds: f64,
    /// Seconds spent fine-tuning.
    pub training_seconds: f64,
}

impl RsftReport {
    /// The summary as metrics (`rsft/...`), for the run's metrics file.
    pub fn to_metrics(&self) -> std::collections::BTreeMap<String, f64> {
        let mut m = std::collections::BTreeMap::new();
        m.insert(mk::sft::RSFT_QUESTIONS.into(), self.questions as f64);
        m.insert(mk::sft::RSFT_SAMPLED.into(), self.sampled as f64);
        m.insert(mk::sft::RSFT_KEPT.into(), self.kept as f64);
        m.insert(mk::sft::RSFT_KEPT_FRACTION.into(), self.kept_fraction);
        m.insert(
            mk::sft::RSFT_QUESTIONS_COVERED.into(),
            self.questions_covered as f64,
        );
        m.insert(mk::sft::RSFT_SCORE_MEAN.into(), self.score_mean);
        m.insert(mk::sft::RSFT_EM_MEAN.into(), self.em_mean);
        m.insert(mk::sft::RSFT_FORMAT_OK.into(), self.format_ok);
        m.insert(mk::sft::RSFT_STEPS.into(), self.steps as f64);
        m.insert(
            mk::sft::RSFT_SKIPPED_STEPS.into(),
            self.skipped_steps as f64,
        );
        if let Some(&l) = self.epoch_loss.first() {
            m.insert(mk::sft::RSFT_LOSS_FIRST_EPOCH.into(), l);
        }
        if let Some(&l) = self.epoch_loss.last() {
            m.insert(mk::sft::RSFT_LOSS_LAST_EPOCH.into(), l);
        }
        m.insert(mk::timing::RSFT_SAMPLING.into(), self.sampling_seconds);
        m.insert(mk::timing::RSFT_TRAINING.into(), self.training_seconds);
        m
    }
}

impl Trainer {
    /// Rejection-sampling fine-tuning with the settings of `config.rsft` (it runs whether or
    /// not `rsft.enabled` is set; the pipeline checks the flag). Samples
    /// `rsft.rollouts_per_question` rollouts of each of `rsft.questions` training questions at
    /// `rsft.temperature`, scores them with the run's reward, keeps those scoring at or above
    /// `rsft.threshold` and fine-tunes the policy on them for `rsft.epochs` epochs of
    /// `rsft.batch_size` rollouts (a fresh AdamW, constant `rsft.lr`). When nothing is kept the
    /// weights are left as they are and the report says so. `on_progress` sees every stage.
    pub fn rejection_finetune(
        &mut self,
        on_progress: &mut dyn FnMut(RsftProgress),
    ) -> Result<RsftReport> {
        let c = self.config.rsft.clone();
        if c.epochs > 5 {
            tracing::warn!(
                epochs = c.epochs,
                "T2PO limits rejection fine-tuning to 5 epochs: more degrades the later RL"
            );
        }
        let mut rng = TurnRng::seed_from_u64(self.config.seed ^ 0x7273_6674);
        let train = self.task.warm_start_questions();
        if train.is_empty() {
            bail!("rejection fine-tuning needs training questions, and the task has none");
        }
        let mut picks: Vec<usize> = (0..train.len()).collect();
        shuffle(&mut picks, &mut rng);
        picks.truncate(c.questions.min(train.len()));
        let questions: Vec<_> = picks.iter().map(|&i| train[i]).collect();

        // Sample.
        let t0 = std::time::Instant::now();
        let base_seed = rng.next_u64();
        let specs = self.rsft_specs(&questions, base_seed, c.rollouts_per_question)?;
        let total = specs.len();
        let mut report = RsftReport {
            questions: questions.len(),
            sampled: total,
            ..RsftReport::default()
        };
        let rows = self.rsft_sample(&c, &specs, &questions, &mut report, on_progress)?;
        report.sampling_seconds = t0.elapsed().as_secs_f64();
        let per_epoch = rows.len().div_ceil(c.batch_size) as u64;
        let steps = per_epoch * c.epochs as u64;
        on_progress(RsftProgress::Filtered {
            kept: rows.len(),
            sampled: total,
            steps,
        });
        tracing::info!(
            kept = rows.len(),
            sampled = total,
            threshold = c.threshold,
            "rejection sampling done"
        );
        if rows.is_empty() {
            tracing::warn!(
                threshold = c.threshold,
                sampled = total,
                "no rollout reached the rejection threshold: the fine-tuning is skipped"
            );
            return Ok(report);
        }

        // Fine-tune.
        let t1 = std::time::Instant::now();
        let opt = self.rsft_train(&c, &rows, &mut rng, steps, &mut report, on_progress)?;
        report.training_seconds = t1.elapsed().as_secs_f64();
        // The RL optimizer's f32 master copies (bf16 weights) follow the fine-tuned weights.
        self.optimizer.sync_masters(Some(&opt))?;
        Ok(report)
    }

    /// The rollouts of rejection sampling: `per_question` of each of `questions`, seeded from
    /// `base_seed`.
    fn rsft_specs(
        &self,
        questions: &[&QaItem],
        base_seed: u64,
        per_question: usize,
    ) -> Result<Vec<EpisodeSpec>> {
        let mut specs = Vec::with_capacity(questions.len() * per_question);
        for (g, q) in questions.iter().enumerate() {
            let prompt_ids = self.tokenizer.encode(&self.task.prompt(q)?)?;
            for k in 0..per_question {
                let i = g * per_question + k;
                specs.push(EpisodeSpec {
                    id: format!("rsft-{}-{k}", q.id),
                    prompt_uid: format!("{g}:{}", q.id),
                    prompt_ids: prompt_ids.clone(),
                    task: TaskSet::env_task(q),
                    seed: turn_seed(base_seed, i),
                });
            }
        }
        Ok(specs)
    }

    /// Rolls out `specs` (with the RL rollouts' control) in chunks, scores each rollout against
    /// its question of `questions` and returns the supervised rows of those at or above the
    /// threshold; the sampling figures go into `report`.
    fn rsft_sample(
        &self,
        c: &RsftConfig,
        specs: &[EpisodeSpec],
        questions: &[&QaItem],
        report: &mut RsftReport,
        on_progress: &mut dyn FnMut(RsftProgress),
    ) -> Result<Vec<Row>> {
        let total = specs.len();
        let decoding = self.decoding(c.temperature);
        // The RL rollouts' control (T2PO thinking intervention, turn resampling, memory
        // window), so the kept rollouts look like what RL will sample.
        let control = RolloutControl::from_config(
            &self.config.rollout,
            self.config.task.format,
            &self.tokenizer,
        )?;
        let mut rows = Vec::new();
        let mut covered = vec![false; questions.len()];
        let mut done = 0;
        on_progress(RsftProgress::Sampled { done, total });
        for (chunk_index, chunk) in specs.chunks(SAMPLING_CHUNK).enumerate() {
            let episodes = {
                let policy = self.rollout_policy();
                let env = self.make_env();
                run_chains_with(&policy, chunk.to_vec(), &env, &decoding, &control)?.episodes
            };
            for (j, ep) in episodes.iter().enumerate() {
                let i = chunk_index * SAMPLING_CHUNK + j;
                let g = i / c.rollouts_per_question;
                let out = self.score_episode(ep, &questions[g].golden_answers)?;
                report.score_mean += out.score;
                report.em_mean += out.em;
                report.format_ok += f64::from(u8::from(out.format_ok));
                if out.score >= c.threshold
                    && let Some(row) = self.training_row(ep)
                {
                    rows.push(row);
                    covered[g] = true;
                }
            }
            done += episodes.len();
            on_progress(RsftProgress::Sampled { done, total });
        }
        let n = total.max(1) as f64;
        report.score_mean /= n;
        report.em_mean /= n;
        report.format_ok /= n;
        report.kept = rows.len();
        report.kept_fraction = rows.len() as f64 / n;
        report.questions_covered = covered.iter().filter(|&&c| c).count();
        Ok(rows)
    }

    /// Fine-tunes the policy on `rows` for `c.epochs` epochs of `c.batch_size` rows (order
    /// shuffled by `rng`, `steps` updates in all) with a fresh AdamW, which it returns; the
    /// training figures go into `report`.
    fn rsft_train(
        &mut self,
        c: &RsftConfig,
        rows: &[Row],
        rng: &mut TurnRng,
        steps: u64,
        report: &mut RsftReport,
        on_progress: &mut dyn FnMut(RsftProgress),
    ) -> Result<AdamW> {
        let mut opt = AdamW::new(self.trainable_vars(), adamw(&self.config, 0.1))?;
        let mut step = 0u64;
        for epoch in 1..=c.epochs {
            let mut order: Vec<usize> = (0..rows.len()).collect();
            shuffle(&mut order, rng);
            let (mut sum, mut count) = (0.0, 0usize);
            for batch in order.chunks(c.batch_size) {
                let refs: Vec<&Row> = batch.iter().map(|&i| &rows[i]).collect();
                step += 1;
                match sft_step(&self.policy, &mut opt, &refs, c.lr, 1.0)
                    .context("rejection fine-tuning step")?
                {
                    Some((loss, _)) => {
                        sum += loss;
                        count += 1;
                        report.steps += 1;
                        on_progress(RsftProgress::Step {
                            step,
                            total: steps,
                            epoch,
                            loss,
                            lr: c.lr,
                        });
                    }
                    None => {
                        report.skipped_steps += 1;
                        tracing::warn!(step, "non-finite rejection fine-tuning loss: skipped");
                    }
                }
            }
            report.epoch_loss.push(if count > 0 {
                sum / count as f64
            } else {
                f64::NAN
            });
        }
        Ok(opt)
    }

    /// The run's reward of one episode (what an RL step would score it).
    fn score_episode(
        &self,
        ep: &Episode,
        gold: &[String],
    ) -> Result<turnwise_core::reward::RewardOutput> {
        self.task.score_episode(&self.config.reward, ep, gold)
    }

    /// The supervised row of an episode: the whole response, loss on the sampled agent tokens
    /// only (`None` when there is none).
    fn training_row(&self, ep: &Episode) -> Option<Row> {
        let row = Row::from_trajectory(&ep.trajectory, self.config.rollout.train_on_forced);
        row.loss_mask.contains(&1).then_some(row)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TrainConfig;
    use turnwise_model::model::weights::sorted_vars;

    fn tiny(extra: &[&str]) -> TrainConfig {
        let mut sets: Vec<String> = [
            "task.world.countries=4",
            "task.world.cities=8",
            "task.world.companies=6",
            "task.world.persons=16",
            "task.world.questions.train=40",
            "task.world.questions.validation=8",
            "task.world.questions.test=8",
            "model.hidden_size=32",
            "model.num_layers=2",
            "model.num_heads=4",
            "model.num_kv_heads=2",
            "model.intermediate_size=64",
            "sft.steps=3",
            "sft.batch_size=4",
            "rollout.max_turn_tokens=12",
            "rollout.max_response_tokens=120",
            "rsft.enabled=true",
            "rsft.questions=5",
            "rsft.rollouts_per_question=2",
            "rsft.batch_size=4",
            "rsft.epochs=2",
        ]
        .map(String::from)
        .to_vec();
        sets.extend(extra.iter().map(|s| s.to_string()));
        TrainConfig::resolve(Some("grpo"), None, &sets).unwrap()
    }

    fn weights(t: &Trainer) -> Vec<f32> {
        sorted_vars(&t.varmap)
            .iter()
            .flat_map(|(_, v)| {
                v.as_tensor()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            })
            .collect()
    }

    #[test]
    fn keeps_rollouts_at_or_above_the_threshold_and_fine_tunes_on_them() {
        // `em` scores lie in [0, 1], so a threshold of -1 keeps every rollout.
        let mut t = Trainer::new(tiny(&["rsft.threshold=-1.0"])).unwrap();
        let before = weights(&t);
        let mut events = Vec::new();
        let r = t.rejection_finetune(&mut |e| events.push(e)).unwrap();
        assert_eq!(r.questions, 5);
        assert_eq!(r.sampled, 10);
        assert_eq!(r.kept, 10);
        assert_eq!(r.kept_fraction, 1.0);
        assert_eq!(r.questions_covered, 5);
        // 10 rows in batches of 4: 3 steps per epoch, 2 epochs.
        assert_eq!(r.steps + r.skipped_steps, 6);
        assert_eq!(r.epoch_loss.len(), 2);
        assert!(r.epoch_loss.iter().all(|l| l.is_finite() && *l > 0.0));
        assert_ne!(
            before,
            weights(&t),
            "the fine-tuning left the weights unchanged"
        );
        assert_eq!(
            events.first(),
            Some(&RsftProgress::Sampled { done: 0, total: 10 })
        );
        assert!(events.contains(&RsftProgress::Filtered {
            kept: 10,
            sampled: 10,
            steps: 6
        }));
        let steps: Vec<u64> = events
            .iter()
            .filter_map(|e| match e {
                RsftProgress::Step { step, total, .. } => {
                    assert_eq!(*total, 6);
                    Some(*step)
                }
                _ => None,
            })
            .collect();
        assert_eq!(steps.len() as u64, r.steps);
        let m = r.to_metrics();
        assert_eq!(m["rsft/kept_fraction"], 1.0);
        assert!(m.contains_key("rsft/loss_last_epoch"));
    }

    #[test]
    fn nothing_kept_leaves_the_weights_alone_and_the_run_is_deterministic() {
        // No `em` score reaches 2.
        let mut t = Trainer::new(tiny(&["rsft.threshold=2.0"])).unwrap();
        let before = weights(&t);
        let r = t.rejection_finetune(&mut |_| {}).unwrap();
        assert_eq!((r.kept, r.steps), (0, 0));
        assert_eq!(r.kept_fraction, 0.0);
        assert!(r.epoch_loss.is_empty());
        assert_eq!(before, weights(&t));

        // Same seed, same result.
        let run = || {
            let mut t = Trainer::new(tiny(&["rsft.threshold=0.0"])).unwrap();
            let r = t.rejection_finetune(&mut |_| {}).unwrap();
            (r.kept, r.epoch_loss, weights(&t))
        };
        assert_eq!(run(), run());
    }

    #[test]
    fn invalid_settings_name_the_field() {
        for (set, field) in [
            ("rsft.questions=0", "rsft.questions"),
            ("rsft.rollouts_per_question=0", "rsft.rollouts_per_question"),
            ("rsft.temperature=0.0", "rsft.temperature"),
            ("rsft.threshold=nan", "rsft.threshold"),
            ("rsft.epochs=0", "rsft.epochs"),
            ("rsft.lr=-1.0", "rsft.lr"),
            ("rsft.batch_size=0", "rsft.batch_size"),
            ("rsft.bogus=1", "rsft.bogus"),
        ] {
            let err = TrainConfig::resolve(Some("grpo"), None, &[set.to_string()])
                .unwrap_err()
                .to_string();
            assert!(err.contains(field), "{set}: {err}");
        }
        let t2po = TrainConfig::resolve(Some("t2po"), None, &[]).unwrap();
        assert!(
            t2po.rsft.enabled,
            "the t2po preset turns rejection fine-tuning on"
        );
        assert!(!TrainConfig::default().rsft.enabled);
    }
}
