//! The keys of `metrics.jsonl`, one constant each: what the trainer, the losses and the
//! rollouts write, and what the report, the plots, the study and `turnwise runs` read, named
//! once here so that a renamed key is renamed everywhere it is written or read.
//!
//! An estimator's own keys stay in its file (`Estimator::metrics`, `metric_docs` in
//! `advantage/`): they are part of the method. A key with a variable part (`reward/{name}`,
//! `eval/{split}/{mode}/em`, `actor/pg_clipfrac_mb{k}`) is built where it is written, from the
//! prefix its module names. `crates/turnwise/tests/architecture.rs`'s
//! `metric_keys_are_named_once` fails on a key written as a literal anywhere else in production
//! code.
//!
//! Most names are verl's (`actor/*`, `critic/*`, `response_length/*`, `timing_s/*`), so that a
//! turnwise run and a verl run plot on the same axes.

/// Declares `$name` as key `$key` with its doc, and `ALL`, every key of the module.
macro_rules! keys {
    ($($(#[doc = $doc:literal])+ $name:ident = $key:literal;)+) => {
        $(
            $(#[doc = $doc])+
            pub const $name: &str = $key;
        )+
        /// Every key of this module, in declaration order.
        pub const ALL: &[&str] = &[$($key),+];
    };
}

/// The policy update (verl's `actor/*`), per RL step: means over its mini-batches unless said.
pub mod actor {
    keys! {
        /// The policy-gradient loss, aggregated as the loss's `loss_agg_mode` says.
        PG_LOSS = "actor/pg_loss";
        /// The actor's whole loss: policy gradient plus the KL and entropy terms.
        LOSS = "actor/loss";
        /// Token share whose clipped surrogate binds (clip active).
        PG_CLIPFRAC = "actor/pg_clipfrac";
        /// Token share clipped at the upper bound (A > 0).
        PG_CLIPFRAC_HIGH = "actor/pg_clipfrac_high";
        /// Token share clipped at the lower bound (A < 0).
        PG_CLIPFRAC_LOW = "actor/pg_clipfrac_low";
        /// Token share where the dual clip binds (A < 0); 0 without a dual clip.
        PG_CLIPFRAC_LOWER = "actor/pg_clipfrac_lower";
        /// Mean of −log r over loss tokens: the k1 KL of the behaviour policy to the new one.
        PPO_KL = "actor/ppo_kl";
        /// The KL-to-reference loss term (KL in the loss).
        KL_LOSS = "actor/kl_loss";
        /// Its coefficient.
        KL_COEF = "actor/kl_coef";
        /// Mean token entropy of the policy on the loss tokens.
        ENTROPY = "actor/entropy";
        /// The entropy aggregated as the loss aggregates (the entropy bonus's input).
        ENTROPY_AGG = "actor/entropy_agg";
        /// Gradient norm before clipping.
        GRAD_NORM = "actor/grad_norm";
        /// Learning rate of the step.
        LR = "actor/lr";
        /// Optimizer steps applied in the RL step.
        OPTIMIZER_STEPS = "actor/optimizer_steps";
        /// Optimizer steps skipped (a non-finite gradient).
        SKIPPED_UPDATES = "actor/skipped_updates";
        /// 1 when the step had too few rows for its update structure's mini-batches and took
        /// one on-policy optimizer step (absent otherwise).
        ON_POLICY_FALLBACK = "actor/on_policy_fallback";
        /// KL in the reward: the batch mean of the per-rollout KL subtracted (spec §5.8).
        REWARD_KL_PENALTY = "actor/reward_kl_penalty";
        /// KL in the reward: its coefficient β this step.
        REWARD_KL_PENALTY_COEFF = "actor/reward_kl_penalty_coeff";
        /// The clipping-bias correction's norm ‖C‖₂ (spec §5.6), summed over mini-batches.
        CLIP_BIAS_NORM = "actor/clip_bias_norm";
        /// The clipping-bias correction's scale of the step (1 without correction).
        CLIP_BIAS_SCALE = "actor/clip_bias_scale";
        /// The clipping-bias scale over the off-policy mini-batches only.
        CLIP_BIAS_SCALE_OFFPOLICY = "actor/clip_bias_scale_offpolicy";
        /// Loss tokens in the clipped set of §5.6, summed over mini-batches.
        CLIP_BIAS_NUM_CLIPPED = "actor/clip_bias_num_clipped";
        /// ‖∇_θ S‖₂ of the clipped-token surrogate, when the gradient space is configured.
        CLIP_BIAS_GRAD_NORM = "actor/clip_bias_grad_norm";
        /// What every clipping-bias key starts with.
        CLIP_BIAS_PREFIX = "actor/clip_bias_";
        /// Turns with at least one loss token.
        NUM_TURNS = "actor/num_turns";
        /// 1 when turns come from explicit turn ids, 0 when from the masks' boundaries.
        TURN_RULE_EXPLICIT = "actor/turn_rule_explicit";
        /// The turn-level KL-entropy diagnostic (spec §7).
        TURN_KL_ENTROPY = "actor/turn_kl_entropy";
        /// Samples with at most one turn.
        SINGLE_TURN_COUNT = "actor/single_turn_count";
        /// Tokens whose forward pass a shared prompt prefix saved.
        SHARED_PREFIX_TOKENS = "actor/shared_prefix_tokens";
        /// Their share of the update's tokens.
        SHARED_PREFIX_FRAC = "actor/shared_prefix_frac";
        /// Truncated importance sampling: mean weight of the sampler–trainer correction.
        TIS_WEIGHT_MEAN = "actor/tis_weight_mean";
        /// Truncated importance sampling: share of tokens whose weight hit the cap.
        TIS_CAPPED_FRAC = "actor/tis_capped_frac";
    }
}

/// Scores, rewards, advantages and the critic (verl's `critic/*`).
pub mod critic {
    keys! {
        /// Mean episode score (the reward the estimator normalises).
        SCORE_MEAN = "critic/score/mean";
        /// Largest episode score.
        SCORE_MAX = "critic/score/max";
        /// Smallest episode score.
        SCORE_MIN = "critic/score/min";
        /// Mean reward as the estimator receives it (a rollout's token rewards' sum, KL in the
        /// reward included; else its outcome plus its turn rewards).
        REWARDS_MEAN = "critic/rewards/mean";
        /// Largest reward as the estimator receives it.
        REWARDS_MAX = "critic/rewards/max";
        /// Smallest reward as the estimator receives it.
        REWARDS_MIN = "critic/rewards/min";
        /// Mean advantage over loss tokens.
        ADVANTAGES_MEAN = "critic/advantages/mean";
        /// Largest advantage.
        ADVANTAGES_MAX = "critic/advantages/max";
        /// Smallest advantage.
        ADVANTAGES_MIN = "critic/advantages/min";
        /// Train exact match under another tool's name (read, never written here).
        EM_MEAN = "critic/em/mean";
        /// The value loss.
        VF_LOSS = "critic/vf_loss";
        /// Token share where the value clip binds.
        VF_CLIPFRAC = "critic/vf_clipfrac";
        /// Mean predicted value.
        VPRED_MEAN = "critic/vpred_mean";
        /// Explained variance of the returns by the values before the update.
        VF_EXPLAINED_VAR = "critic/vf_explained_var";
        /// The critic's gradient norm.
        GRAD_NORM = "critic/grad_norm";
        /// Critic optimizer steps applied.
        APPLIED_UPDATES = "critic/applied_updates";
        /// Critic optimizer steps skipped (a non-finite gradient).
        SKIPPED_UPDATES = "critic/skipped_updates";
    }
}

/// The trained batch.
pub mod batch {
    keys! {
        /// Rollouts kept for the update.
        KEPT_ROLLOUTS = "batch/kept_rollouts";
        /// Training rows before step samples are cut (one per trajectory).
        TRAJECTORY_ROWS = "batch/trajectory_rows";
        /// Training rows the update saw (step samples when `optim.samples = "step"`).
        TRAIN_ROWS = "batch/train_rows";
        /// DAPO's filter: prompt groups with a learning signal.
        INFORMATIVE_GROUPS = "batch/informative_groups";
        /// DAPO's filter: prompt groups dropped.
        FILTERED_GROUPS = "batch/filtered_groups";
        /// DAPO's filter: extra generation rounds to fill the batch.
        REFILL_ROUNDS = "batch/refill_rounds";
        /// 1 when no group of the trained batch carried a learning signal (absent otherwise).
        ZERO_SIGNAL = "batch/zero_signal";
    }
}

/// The training episodes' outcomes.
pub mod train {
    keys! {
        /// Mean exact match of the step's episodes.
        EM = "train/em";
        /// Mean F1 (read; runs of other tools write it).
        F1 = "train/f1";
        /// Share of episodes whose output keeps the format rule.
        FORMAT_OK = "train/format_ok";
        /// Mean invalid actions per episode.
        INVALID_ACTIONS = "train/invalid_actions";
        /// Mean reward under another tool's name (read, never written here).
        REWARD = "train/reward";
    }
}

/// The reward's components (`reward/{component}` for each component a reward reports).
pub mod reward {
    keys! {
        /// The overlong penalty (DAPO, spec §2.7), as `/mean` and `/frac`.
        OVERLONG_PENALTY = "reward/overlong_penalty";
        /// Mean overlong penalty.
        OVERLONG_PENALTY_MEAN = "reward/overlong_penalty/mean";
        /// Share of episodes the overlong penalty hit.
        OVERLONG_PENALTY_FRAC = "reward/overlong_penalty/frac";
        /// MT-PPO's rubric: the tool-execution turn reward.
        TOOL_EXECUTION = "reward/tool_execution";
        /// MT-PPO's rubric: the search-result-presence turn reward.
        SEARCH_RESULT_PRESENCE = "reward/search_result_presence";
        /// MT-PPO's rubric: the exact-match outcome.
        EXACT_MATCH = "reward/exact_match";
        /// Mean reward under another tool's name (read, never written here).
        MEAN = "reward/mean";
        /// Exact match under another tool's name (read, never written here).
        EM = "reward/em";
    }
}

/// Response and prompt lengths (verl's), in tokens.
pub mod length {
    keys! {
        /// Mean response length (agent and observation tokens).
        RESPONSE_MEAN = "response_length/mean";
        /// Longest response.
        RESPONSE_MAX = "response_length/max";
        /// Shortest response.
        RESPONSE_MIN = "response_length/min";
        /// Share of responses cut at the response budget.
        RESPONSE_CLIP_RATIO = "response_length/clip_ratio";
        /// Mean of the agent's own tokens per response.
        RESPONSE_AGENT_MEAN = "response_length/agent_mean";
        /// Mean prompt length.
        PROMPT_MEAN = "prompt_length/mean";
        /// Longest prompt.
        PROMPT_MAX = "prompt_length/max";
        /// Shortest prompt.
        PROMPT_MIN = "prompt_length/min";
    }
}

/// The environment: turns and tool calls.
pub mod env {
    keys! {
        /// Mean agent turns per episode.
        TURNS_MEAN = "env/turns/mean";
        /// Mean tool calls (searches) per episode.
        TOOL_CALLS_MEAN = "env/tool_calls/mean";
        /// Mean turns under another tool's name (read, never written here).
        NUM_TURNS_MEAN = "num_turns/mean";
        /// Mean tool calls under another tool's name (read, never written here).
        TOOL_CALL_COUNTS_MEAN = "tool_call_counts/mean";
    }
}

/// Information-gain probes (IGPO, A2TGPO).
pub mod info_gain {
    keys! {
        /// Probes scored in the step.
        PROBES = "info_gain/probes";
        /// Probes that failed.
        PROBE_FAILURES = "info_gain/probe_failures";
        /// Mean information gain per process turn.
        MEAN = "info_gain/mean";
    }
}

/// The rollout strategy's own decisions (T2PO's thinking intervention and turn resampling,
/// the memory window, the KV context, asynchronous weights).
pub mod rollout {
    keys! {
        /// Turns where the thinking intervention fired.
        TTI_TRIGGERED = "rollout/tti_triggered";
        /// Its share of eligible turns.
        TTI_TRIGGER_RATE = "rollout/tti_trigger_rate";
        /// Tokens forced by the intervention.
        FORCED_TOKENS = "rollout/forced_tokens";
        /// Turn resampling: regenerations drawn.
        TDS_REGENERATIONS = "rollout/tds_regenerations";
        /// Turn resampling: regenerations per eligible turn.
        TDS_REGENERATIONS_PER_TURN = "rollout/tds_regenerations_per_turn";
        /// Turn resampling: turns regenerated at least once.
        TDS_REGENERATED_TURNS = "rollout/tds_regenerated_turns";
        /// Turn resampling: the most regenerations of one turn.
        TDS_MAX_REGENERATIONS = "rollout/tds_max_regenerations";
        /// Turn resampling: tokens of discarded draws.
        TDS_DISCARDED_TOKENS = "rollout/tds_discarded_tokens";
        /// Turn resampling: turns the rule looked at.
        TDS_ELIGIBLE_TURNS = "rollout/tds_eligible_turns";
        /// Turn resampling: share of eligible turns whose first draw was kept.
        TDS_ACCEPTED_FIRST_SHARE = "rollout/tds_accepted_first_share";
        /// Turn resampling: share of eligible turns that used the whole budget.
        TDS_BUDGET_EXHAUSTED_SHARE = "rollout/tds_budget_exhausted_share";
        /// Turn resampling: 10 % quantile of the first draws' gap Γ.
        TDS_GAP_P10 = "rollout/tds_gap_p10";
        /// Turn resampling: median gap Γ of first draws (the distribution η is calibrated on).
        TDS_GAP_P50 = "rollout/tds_gap_p50";
        /// Turn resampling: 90 % quantile of the first draws' gap Γ.
        TDS_GAP_P90 = "rollout/tds_gap_p90";
        /// Turn resampling: median gap Γ of the kept draws.
        TDS_KEPT_GAP_P50 = "rollout/tds_kept_gap_p50";
        /// Turns the memory window dropped from the context.
        MEMORY_TRUNCATED_TURNS = "rollout/memory_truncated_turns";
        /// Mean context tokens a turn was sampled from.
        CONTEXT_TOKENS_MEAN = "rollout/context_tokens/mean";
        /// Share of the context served from the KV cache.
        CACHED_CONTEXT_FRACTION = "rollout/cached_context_fraction";
        /// Mean steps between the weights a rollout used and the trained ones.
        WEIGHT_STALENESS_MEAN = "rollout/weight_staleness/mean";
        /// Most steps between them.
        WEIGHT_STALENESS_MAX = "rollout/weight_staleness/max";
        /// What the sampler–trainer log-prob mismatch's keys start with.
        LOGPROB_MISMATCH = "rollout/logprob_mismatch";
    }
}

/// Tree rollouts (AT2PO, Tree-GRPO).
pub mod tree {
    keys! {
        /// Leaves per prompt.
        LEAVES = "tree/leaves";
        /// Mean trees per prompt group that reached a leaf.
        LABELS_PER_GROUP = "tree/labels_per_group";
        /// Mean leaf depth in turns.
        DEPTH_MEAN = "tree/depth/mean";
        /// Deepest leaf.
        DEPTH_MAX = "tree/depth/max";
        /// Forks per prompt.
        FORKS = "tree/forks";
        /// Mean entropy of the forked nodes.
        FORK_ENTROPY_MEAN = "tree/fork_entropy/mean";
    }
}

/// GiGPO's step samples, as the trainer placed their rewards.
pub mod gigpo {
    keys! {
        /// Step samples whose invalid-action or format penalty was applied.
        PENALISED_STEPS = "gigpo/penalised_steps";
    }
}

/// The LLM judge's turn rewards and its calibration against the rules.
pub mod judge {
    keys! {
        /// Episodes judged.
        EPISODES = "judge/episodes";
        /// Episodes whose judging failed.
        FAILURES = "judge/failures";
        /// Their share.
        FAILURE_RATE = "judge/failure_rate";
        /// Requests sent to the judge.
        REQUESTS = "judge/requests";
        /// Verdicts served from the cache.
        CACHE_HITS = "judge/cache_hits";
        /// Mean turn score the judge gave.
        TURN_SCORE_MEAN = "judge/turn_score/mean";
        /// Share of turns where the judge and the rules agree.
        RUBRIC_AGREEMENT = "judge/rubric_agreement";
        /// Calibration: rollouts scored.
        CALIBRATION_ROLLOUTS = "judge/calibration/rollouts";
        /// Calibration: episodes judged.
        CALIBRATION_EPISODES = "judge/calibration/episodes";
        /// Calibration: episodes whose judging failed.
        CALIBRATION_FAILURES = "judge/calibration/failures";
        /// Calibration: turns compared.
        CALIBRATION_TURNS = "judge/calibration/turns";
        /// Calibration: requests sent.
        CALIBRATION_REQUESTS = "judge/calibration/requests";
        /// Calibration: share of turns where judge and rules agree.
        CALIBRATION_RUBRIC_AGREEMENT = "judge/calibration/rubric_agreement";
        /// Calibration: share of turns where their signs agree.
        CALIBRATION_SIGN_AGREEMENT = "judge/calibration/sign_agreement";
        /// Calibration: mean judge score.
        CALIBRATION_JUDGE_SCORE_MEAN = "judge/calibration/judge_score/mean";
        /// Calibration: mean rule score.
        CALIBRATION_RUBRIC_SCORE_MEAN = "judge/calibration/rubric_score/mean";
    }
}

/// Rollouts by the user's agent programs (the harness backend).
pub mod harness {
    keys! {
        /// Episodes made.
        EPISODES = "harness/episodes";
        /// Program runs that failed (`harness/failed/{kind}` by kind).
        FAILED = "harness/failed";
        /// Trajectories reconstructed from the sessions.
        SEGMENTS = "harness/segments";
        /// Requests recorded.
        REQUESTS = "harness/requests";
        /// Of the requests after a session's first, the share that continued their trajectory.
        APPEND_RATE = "harness/append_rate";
        /// Requests whose prompt was spliced onto the session's token ids.
        SPLICED = "harness/spliced";
        /// Requests whose plain re-tokenisation would have drifted from the recorded tokens.
        RETOKENIZATION_DIFFERS = "harness/retokenization_differs";
        /// Mean program wall time.
        PROGRAM_SECONDS_MEAN = "harness/program_seconds/mean";
        /// Longest program wall time.
        PROGRAM_SECONDS_MAX = "harness/program_seconds/max";
        /// Share of tool calls that parsed (`/turn_{t}` per turn).
        TOOL_CALLS_PARSE_RATE = "harness/tool_calls/parse_rate";
    }
}

/// The supervised phases: the warm start and rejection-sampling fine-tuning.
pub mod sft {
    keys! {
        /// Warm-start loss.
        LOSS = "sft/loss";
        /// Warm-start learning rate.
        LR = "sft/lr";
        /// Rejection sampling: its loss.
        RSFT_LOSS = "rsft/loss";
        /// Rejection sampling: its learning rate.
        RSFT_LR = "rsft/lr";
        /// Rejection sampling: the epoch of the line.
        RSFT_EPOCH = "rsft/epoch";
        /// Rejection sampling: questions sampled.
        RSFT_QUESTIONS = "rsft/questions";
        /// Rejection sampling: episodes sampled.
        RSFT_SAMPLED = "rsft/sampled";
        /// Rejection sampling: episodes kept.
        RSFT_KEPT = "rsft/kept";
        /// Rejection sampling: their share.
        RSFT_KEPT_FRACTION = "rsft/kept_fraction";
        /// Rejection sampling: questions with a kept episode.
        RSFT_QUESTIONS_COVERED = "rsft/questions_covered";
        /// Rejection sampling: mean score of the sampled episodes.
        RSFT_SCORE_MEAN = "rsft/score_mean";
        /// Rejection sampling: their mean exact match.
        RSFT_EM_MEAN = "rsft/em_mean";
        /// Rejection sampling: their format-ok share.
        RSFT_FORMAT_OK = "rsft/format_ok";
        /// Rejection sampling: optimizer steps.
        RSFT_STEPS = "rsft/steps";
        /// Rejection sampling: steps skipped (a non-finite gradient).
        RSFT_SKIPPED_STEPS = "rsft/skipped_steps";
        /// Rejection sampling: mean loss of the first epoch.
        RSFT_LOSS_FIRST_EPOCH = "rsft/loss_first_epoch";
        /// Rejection sampling: mean loss of the last epoch.
        RSFT_LOSS_LAST_EPOCH = "rsft/loss_last_epoch";
    }
}

/// Evaluations (`eval/{split}/{mode}/{metric}`), and the names older runs and other tools use.
pub mod eval {
    keys! {
        /// Test split, greedy decoding, exact match.
        TEST_GREEDY_EM = "eval/test/greedy/em";
        /// Test split, greedy decoding, F1.
        TEST_GREEDY_F1 = "eval/test/greedy/f1";
        /// Test split, sampled decoding, exact match.
        TEST_SAMPLED_EM = "eval/test/sampled/em";
        /// Test split, sampled decoding, F1.
        TEST_SAMPLED_F1 = "eval/test/sampled/f1";
        /// Validation split, greedy decoding, exact match.
        VALIDATION_GREEDY_EM = "eval/validation/greedy/em";
        /// Validation split, greedy decoding, F1.
        VALIDATION_GREEDY_F1 = "eval/validation/greedy/f1";
        /// Validation split, greedy decoding, turns per episode.
        VALIDATION_GREEDY_TURNS = "eval/validation/greedy/turns";
        /// Validation split, greedy decoding, tool calls per episode.
        VALIDATION_GREEDY_TOOL_CALLS = "eval/validation/greedy/tool_calls";
        /// Greedy exact match without a split (older runs).
        GREEDY_EM = "eval/greedy/em";
        /// Greedy F1 without a split (older runs).
        GREEDY_F1 = "eval/greedy/f1";
        /// Greedy turns without a split (older runs).
        GREEDY_TURNS = "eval/greedy/turns";
        /// Greedy tool calls without a split (older runs).
        GREEDY_TOOL_CALLS = "eval/greedy/tool_calls";
        /// Sampled exact match without a split (older runs).
        SAMPLED_EM = "eval/sampled/em";
        /// Sampled F1 without a split (older runs).
        SAMPLED_F1 = "eval/sampled/f1";
        /// Exact match without split or mode (older runs).
        EM = "eval/em";
        /// F1 without split or mode (older runs).
        F1 = "eval/f1";
        /// Turns without split or mode (older runs).
        TURNS = "eval/turns";
        /// Tool calls without split or mode (older runs).
        TOOL_CALLS = "eval/tool_calls";
        /// What every evaluation key starts with.
        PREFIX = "eval/";
    }
}

/// Wall time per phase, in seconds (verl's `timing_s/*`).
pub mod timing {
    keys! {
        /// The whole RL step.
        STEP = "timing_s/step";
        /// Generation.
        GEN = "timing_s/gen";
        /// Information-gain probes.
        INFO_GAIN = "timing_s/info_gain";
        /// The behaviour log-probs before an off-policy update.
        OLD_LOG_PROB = "timing_s/old_log_prob";
        /// The update (actor and critic).
        UPDATE = "timing_s/update";
        /// The actor's update.
        UPDATE_ACTOR = "timing_s/update_actor";
        /// The judge's verdicts.
        JUDGE = "timing_s/judge";
        /// The judge's calibration.
        JUDGE_CALIBRATION = "timing_s/judge_calibration";
        /// Rejection sampling's generation.
        RSFT_SAMPLING = "timing_s/rsft_sampling";
        /// Rejection sampling's training.
        RSFT_TRAINING = "timing_s/rsft_training";
        /// An evaluation.
        EVAL = "timing_s/eval";
        /// Setting up the run.
        SETUP = "timing_s/setup";
        /// The warm start.
        WARM_START = "timing_s/warm_start";
        /// Syncing weights to an inference server.
        WEIGHT_SYNC = "timing_s/weight_sync";
        /// What every timing key starts with.
        PREFIX = "timing_s/";
    }
}

/// Throughput and the model's size.
pub mod perf {
    keys! {
        /// Prompt and response tokens of the step's episodes per second of the step.
        THROUGHPUT = "perf/throughput";
        /// The policy's parameters.
        MODEL_PARAMETERS = "model/parameters";
        /// The parameters the run trains (LoRA: the adapters').
        MODEL_TRAINABLE_PARAMETERS = "model/trainable_parameters";
    }
}

/// Every key this module names, module by module.
pub fn all() -> impl Iterator<Item = &'static str> {
    [
        actor::ALL,
        critic::ALL,
        batch::ALL,
        train::ALL,
        reward::ALL,
        length::ALL,
        env::ALL,
        info_gain::ALL,
        rollout::ALL,
        tree::ALL,
        gigpo::ALL,
        judge::ALL,
        harness::ALL,
        sft::ALL,
        eval::ALL,
        timing::ALL,
        perf::ALL,
    ]
    .into_iter()
    .flatten()
    .copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_is_named_once() {
        let mut seen = std::collections::BTreeSet::new();
        for k in all() {
            assert!(seen.insert(k), "{k} is named twice");
            assert!(k.contains('/'), "{k}");
        }
    }
}
