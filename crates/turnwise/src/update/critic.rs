//! The PPO critic (spec §3.3, §5.10): a value model initialised from the policy's weights,
//! its values of the states before each response token, and the clipped value-loss update.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result, bail};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use turnwise_core::metric_keys as mk;
use turnwise_model::ModelConfig;
use turnwise_model::device::Placement;
use turnwise_model::loss::value::{ValueLossConfig, explained_variance, value_loss};
use turnwise_model::model::critic::{
    Critic, SCORE_BIAS, SCORE_WEIGHT, critic_varmap_from_policy, trunk_config,
};
use turnwise_model::model::transformer::varmap_tensors;
use turnwise_model::model::weights::{
    load_safetensors, save_safetensors, sorted_vars, varmap_from_tensors,
};
use turnwise_model::optim::{AdamW, AdamWConfig, GradAccumulator, Gradients};

use super::{
    Row, loss_tokens, minibatch_denominators, pack, per_row_no_grad, response_values, row_shards,
    sort_rows,
};
use crate::shard;

/// File of a checkpoint holding the critic's weights (trunk and value head, Hugging Face names).
pub const CRITIC_WEIGHTS_FILE: &str = "critic.safetensors";
/// File of a checkpoint holding the critic optimizer's moments (`{param}.exp_avg`,
/// `{param}.exp_avg_sq`).
pub const CRITIC_OPTIMIZER_FILE: &str = "critic_optimizer.safetensors";

/// A trainable critic with its optimizer.
pub struct CriticModel {
    config: ModelConfig,
    varmap: VarMap,
    model: Critic,
    detached: Critic,
    optimizer: AdamW,
}

impl CriticModel {
    /// A critic whose trunk copies `policy` (named tensors) and whose value head is fresh,
    /// trained by AdamW with `optim`.
    pub fn from_policy(
        config: &ModelConfig,
        policy: &std::collections::HashMap<String, Tensor>,
        seed: u64,
        optim: AdamWConfig,
    ) -> Result<Self> {
        let varmap = critic_varmap_from_policy(config, policy, seed)
            .context("building the critic from the policy")?;
        let tc = trunk_config(config);
        let model = Critic::from_varmap(&tc, &varmap)?;
        let detached = Critic::detached_from_varmap(&tc, &varmap)?;
        let optimizer = AdamW::new(sorted_vars(&varmap), optim)?;
        Ok(Self {
            config: tc,
            varmap,
            model,
            detached,
            optimizer,
        })
    }

    /// Writes the critic's weights ([`CRITIC_WEIGHTS_FILE`]) and its optimizer's moments
    /// ([`CRITIC_OPTIMIZER_FILE`]) into the checkpoint folder `dir`; the optimizer's step count
    /// ([`CriticModel::optimizer_steps`]) goes into the caller's trainer state.
    pub fn save(&self, dir: &Path) -> Result<()> {
        let weights = dir.join(CRITIC_WEIGHTS_FILE);
        save_safetensors(
            &Placement::cpu().tensors(varmap_tensors(&self.varmap, true))?,
            &weights,
        )
        .with_context(|| format!("writing {}", weights.display()))?;
        let moments = dir.join(CRITIC_OPTIMIZER_FILE);
        save_safetensors(&self.optimizer.state_tensors(), &moments)
            .with_context(|| format!("writing {}", moments.display()))?;
        Ok(())
    }

    /// Restores a critic saved by [`CriticModel::save`] in `dir` for a policy of configuration
    /// `policy_config`, its optimizer at `optimizer_steps` updates: the same weights, moments
    /// and step count, so that training continues exactly (`optim` are the optimizer's settings,
    /// which the checkpoint does not hold), placed on the policy's device and dtype.
    pub fn load(
        policy_config: &ModelConfig,
        dir: &Path,
        optimizer_steps: u64,
        optim: AdamWConfig,
        placement: &Placement,
    ) -> Result<Self> {
        let path = dir.join(CRITIC_WEIGHTS_FILE);
        let desc = path.display().to_string();
        let tensors = load_safetensors(&path, DType::F32, &Device::Cpu)
            .with_context(|| format!("reading the critic weights {desc}"))?;
        let tensors = placement.tensors(tensors)?;
        let tc = trunk_config(policy_config);
        let varmap = varmap_from_tensors(&tc, &tensors, &desc)
            .with_context(|| format!("the critic weights {desc} do not fit the policy"))?;
        {
            let mut data = varmap.data().lock().unwrap_or_else(|e| e.into_inner());
            for name in [SCORE_WEIGHT, SCORE_BIAS] {
                match tensors.get(name) {
                    Some(t) => {
                        data.insert(name.to_string(), Var::from_tensor(&t.contiguous()?)?);
                    }
                    None if name == SCORE_BIAS => {}
                    None => bail!("{desc} has no value head (`{name}`)"),
                }
            }
        }
        let model = Critic::from_varmap(&tc, &varmap)?;
        let detached = Critic::detached_from_varmap(&tc, &varmap)?;
        let path = dir.join(CRITIC_OPTIMIZER_FILE);
        let moments = load_safetensors(&path, DType::F32, &Device::Cpu)
            .with_context(|| format!("reading the critic optimizer state {}", path.display()))?;
        let mut optimizer = AdamW::new(sorted_vars(&varmap), optim)?;
        optimizer
            .load_state(&moments, optimizer_steps)
            .with_context(|| format!("restoring the critic optimizer from {}", path.display()))?;
        Ok(Self {
            config: tc,
            varmap,
            model,
            detached,
            optimizer,
        })
    }

    /// Updates the critic's optimizer has made (its step count, saved with a checkpoint).
    pub fn optimizer_steps(&self) -> u64 {
        self.optimizer.step_count()
    }

    /// The critic's weights.
    pub fn varmap(&self) -> &VarMap {
        &self.varmap
    }

    /// The trunk configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Values of the states before each response token of every row (no graph), in chunks of
    /// at most `chunk` rows ([`per_row_no_grad`]). Sharing prefixes (`optim.share_prefix`),
    /// each chunk runs its rows' shared prefixes through the trunk once ([`response_values`]);
    /// the values equal the unshared pass's to rounding.
    pub fn values(&self, rows: &[Row], chunk: usize, share_prefix: bool) -> Result<Vec<Vec<f32>>> {
        per_row_no_grad(self.detached.trunk(), rows, chunk, share_prefix, |packed| {
            response_values(&self.detached, packed)
        })
    }

    /// Clipped value-loss epochs over `rows` (whose `returns` hold the GAE targets) with the
    /// values `old_values` of the rollout: `cfg.epochs` passes, each over the rows in the order
    /// `order(n)` gives (seeded by the caller, like the actor's) cut into mini-batches of
    /// `cfg.mini_batch` rows, one optimizer step per mini-batch (verl's critic `ppo_epochs` and
    /// `ppo_mini_batch_size`). Metrics: the means over the mini-batches of `critic/vf_loss`,
    /// `critic/vf_clipfrac`, `critic/vpred_mean`, `critic/grad_norm`, and
    /// `critic/vf_explained_var` of the rollout's values against the returns (verl
    /// `compute_data_metrics`, spec §7), and the counts [`mk::critic::APPLIED_UPDATES`] and
    /// [`mk::critic::SKIPPED_UPDATES`] (mini-batches whose loss or gradient was not finite).
    pub fn update(
        &mut self,
        rows: &[Row],
        old_values: &[Vec<f32>],
        cfg: &CriticUpdate<'_>,
        order: &mut dyn FnMut(usize) -> Vec<usize>,
    ) -> Result<BTreeMap<String, f64>> {
        let mut sums: BTreeMap<String, (f64, usize)> = BTreeMap::new();
        let n = rows.len();
        if n == 0 {
            return Ok(BTreeMap::new());
        }
        if old_values.len() != n {
            bail!(
                "critic update: {} rows but {} rows of old values",
                n,
                old_values.len()
            );
        }
        let mini = if cfg.mini_batch == 0 {
            n
        } else {
            cfg.mini_batch.min(n)
        };
        let as_f64 = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<f64>>();
        let returns: Vec<Vec<f64>> = rows.iter().map(|r| as_f64(&r.returns)).collect();
        let values: Vec<Vec<f64>> = old_values.iter().map(|v| as_f64(v)).collect();
        let masks: Vec<Vec<f64>> = rows
            .iter()
            .map(|r| r.loss_mask.iter().map(|&m| f64::from(m)).collect())
            .collect();
        let mut out = BTreeMap::new();
        if let Some(ev) = explained_variance(&returns, &values, &masks) {
            out.insert(mk::critic::VF_EXPLAINED_VAR.to_string(), ev);
        }
        let (mut applied, mut skipped) = (0usize, 0usize);
        for _ in 0..cfg.epochs.max(1) {
            let perm = order(n);
            for mb in perm.chunks(mini) {
                // The mini-batch's loss, cut into one shard per core (shard.rs):
                // each shard divides by the whole mini-batch's denominators. Sharing
                // prefixes, the shards are runs of the rows in token order (rows that share a
                // prefix meet in a shard, which runs it once), as the actor's are.
                let denominators = minibatch_denominators(rows, mb);
                let model = &self.model;
                let vars = self.optimizer.vars();
                let device = model.trunk().device();
                let k = shard::training_shard_count(model.trunk(), mb.len());
                let mut sorted = mb.to_vec();
                sort_rows(rows, &mut sorted, cfg.share_prefix);
                let shards = row_shards(rows, &sorted, k, cfg.share_prefix);
                let parts = shard::map_chunks(k, &shards, |shard: &Vec<usize>| {
                    let refs: Vec<&Row> = shard.iter().map(|&i| &rows[i]).collect();
                    let mut packed = pack(&refs, device)?;
                    if !cfg.share_prefix {
                        packed = packed.unshared();
                    }
                    let l = packed.response_width;
                    let mut old = vec![0f32; shard.len() * l];
                    for (k, &i) in shard.iter().enumerate() {
                        old[k * l..k * l + old_values[i].len()].copy_from_slice(&old_values[i]);
                    }
                    let old = Tensor::from_vec(old, (shard.len(), l), device)?;
                    // Values in f32 (a bf16 critic's too), as log-probs are: the loss
                    // and its metrics are computed in f32.
                    let v = response_values(model, &packed)?;
                    let loss_out = value_loss(
                        &v,
                        &old,
                        &packed.returns,
                        &packed.loss_mask,
                        cfg.loss,
                        Some(denominators),
                    )?;
                    let value = f64::from(loss_out.loss.to_scalar::<f32>()?);
                    let tokens = loss_tokens(rows, shard);
                    if !value.is_finite() {
                        return Ok((None, loss_out.metrics.to_map(), tokens));
                    }
                    let mut acc = GradAccumulator::new();
                    acc.add(&loss_out.loss.backward()?, vars, 1.0)?;
                    Ok((Some(acc.take()), loss_out.metrics.to_map(), tokens))
                })?;
                let mut acc = GradAccumulator::new();
                let mut finite = true;
                let mut shard_metrics: BTreeMap<String, f64> = BTreeMap::new();
                for (grads, metrics, tokens) in parts {
                    let Some(grads) = grads else {
                        finite = false;
                        break;
                    };
                    acc.add_gradients(grads)?;
                    for (k, v) in metrics {
                        // The loss is additive over shards; the rest are means over tokens.
                        let share = if k == mk::critic::VF_LOSS {
                            v
                        } else {
                            v * tokens / denominators.tokens
                        };
                        *shard_metrics.entry(k).or_insert(0.0) += share;
                    }
                }
                if !finite {
                    tracing::warn!("non-finite critic loss: update skipped");
                    skipped += 1;
                    continue;
                }
                let grads = acc.take();
                let norm = grads.global_norm()?;
                if !norm.is_finite() {
                    tracing::warn!("non-finite critic gradient: update skipped");
                    skipped += 1;
                    continue;
                }
                // The clip is applied as the update reads the gradients (the same bits).
                let clip = Gradients::clip_factor(norm, cfg.grad_clip);
                self.optimizer
                    .step_scaled(&grads, cfg.lr, clip)
                    .with_context(|| format!("the critic's update (critic.lr = {})", cfg.lr))?;
                applied += 1;
                for (k, v) in shard_metrics {
                    let e = sums.entry(k).or_insert((0.0, 0));
                    e.0 += v;
                    e.1 += 1;
                }
                let e = sums.entry(mk::critic::GRAD_NORM.into()).or_insert((0.0, 0));
                e.0 += norm;
                e.1 += 1;
            }
        }
        out.extend(sums.into_iter().map(|(k, (s, c))| (k, s / c.max(1) as f64)));
        out.insert(mk::critic::APPLIED_UPDATES.into(), applied as f64);
        out.insert(mk::critic::SKIPPED_UPDATES.into(), skipped as f64);
        Ok(out)
    }
}

/// Settings of one critic update ([`CriticModel::update`]).
pub struct CriticUpdate<'a> {
    /// The clipped value loss.
    pub loss: &'a ValueLossConfig,
    /// Learning rate.
    pub lr: f64,
    /// Gradient-norm bound.
    pub grad_clip: f64,
    /// Passes over the batch (`optim.ppo_epochs`).
    pub epochs: usize,
    /// Rows per optimizer step (`optim.mini_batch_size`; 0: all).
    pub mini_batch: usize,
    /// Run the rows' shared prefixes through the trunk once (`optim.share_prefix`).
    pub share_prefix: bool,
}
