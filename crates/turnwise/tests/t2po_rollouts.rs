//! T2PO rollout control on a tiny model (spec §6.2 thinking intervention, §6.3 turn-level
//! resampling, §1.3 memory window) and its `[rollout]` configuration.

use turnwise::config::{AgentFormatName, TrainConfig};
use turnwise::rollout::{
    ChainRollout, Decoding, EpisodeSpec, REASONING_END_MARKERS, RolloutControl, attempt_seed,
    run_chains_with, turn_seed,
};
use turnwise::task::{TaskSet, prompt_text};
use turnwise::trainer::Trainer;
use turnwise::update::batch::Row;
use turnwise_core::control::TdsRule;
use turnwise_core::trajectory::Segment;
use turnwise_env::env::Environment;
use turnwise_env::world::{Split, ThoughtStyle};
use turnwise_model::sampling::{SamplingParams, generate};

mod common;
use common::tiny_overrides;

const MAX_TURN: usize = 12;
const MAX_RESPONSE: usize = 400;

/// A warm-started tiny T2PO-format trainer.
fn trainer() -> Trainer {
    let mut sets = tiny_overrides();
    sets.push(format!("rollout.max_response_tokens={MAX_RESPONSE}"));
    let cfg = TrainConfig::resolve(Some("t2po"), None, &sets).unwrap();
    let mut t = Trainer::new(cfg).unwrap();
    t.warm_start(&mut |_, _, _| {}).unwrap();
    t
}

fn specs(t: &Trainer, n: usize) -> Vec<EpisodeSpec> {
    t.task
        .questions(Split::Train)
        .iter()
        .take(n)
        .enumerate()
        .map(|(i, q)| EpisodeSpec {
            id: format!("e{i}"),
            prompt_uid: q.id.clone(),
            prompt_ids: t.tokenizer.encode(&prompt_text(&q.text)).unwrap(),
            task: TaskSet::env_task(q),
            seed: 1000 + i as u64,
        })
        .collect()
}

fn decoding() -> Decoding {
    Decoding {
        temperature: 1.0,
        top_p: 1.0,
        top_k: 0,
        max_turn_tokens: MAX_TURN,
        max_response_tokens: MAX_RESPONSE,
    }
}

/// Control with everything off (the t2po preset's forced queue tokenised).
fn control_off(t: &Trainer) -> RolloutControl {
    let mut r = t.config.rollout.clone();
    r.tti.enabled = false;
    r.tds.enabled = false;
    r.memory_window = None;
    RolloutControl::from_config(&r, AgentFormatName::T2po, &t.tokenizer).unwrap()
}

fn rollout(t: &Trainer, specs: Vec<EpisodeSpec>, control: &RolloutControl) -> ChainRollout {
    let policy = t.rollout_policy();
    let env = || Ok(Box::new(t.task.env()?) as Box<dyn Environment>);
    run_chains_with(&policy, specs, &env, &decoding(), control).unwrap()
}

/// Per turn: (agent tokens, forced flags) and the response offset where the turn starts.
fn turns_of(traj: &turnwise_core::trajectory::Trajectory) -> Vec<(Vec<u32>, Vec<bool>, usize)> {
    let mut out = Vec::new();
    let mut pos = 0;
    for seg in &traj.segments {
        if let Segment::Agent(a) = seg {
            let forced = (0..a.ids.len()).map(|k| a.is_forced(k)).collect();
            out.push((a.ids.clone(), forced, pos));
        }
        pos += seg.ids().len();
    }
    out
}

/// Regenerates one turn alone: its tokens when sampled from `context` with `seed` under the
/// budget of a single-episode batch.
fn replay(t: &Trainer, context: Vec<u32>, seed: u64, response_before: usize) -> Vec<u32> {
    let room = MAX_RESPONSE.saturating_sub(response_before).max(1);
    let params = SamplingParams {
        temperature: 1.0,
        top_p: 1.0,
        top_k: 0,
        max_new_tokens: MAX_TURN.min(room),
        stop_token_ids: t.rollout_policy().stop_ids.to_vec(),
        stop_strings: Vec::new(),
        top_logprobs: 0,
    };
    generate(&t.sampler, &[context], &[seed], &params, None)
        .unwrap()
        .remove(0)
        .tokens
}

#[test]
fn thinking_intervention_forces_end_of_thinking_and_masks_it() {
    let t = trainer();
    // ε far above any |ΔM| ≤ 1 with a one-variation window: the rule fires at t = L_min + 1 = 3
    // in every turn whose reasoning span is still open there.
    let mut r = t.config.rollout.clone();
    r.tds.enabled = false;
    r.memory_window = None;
    r.tti.enabled = true;
    r.tti.window = 0;
    r.tti.epsilon = 10.0;
    r.tti.min_tokens = 2;
    r.tti.max_tokens = None;
    let on = RolloutControl::from_config(&r, AgentFormatName::T2po, &t.tokenizer).unwrap();
    let end = t.tokenizer.token_to_id("</think>").unwrap();
    let action = t.tokenizer.token_to_id("<action>").unwrap();
    assert_eq!(on.forced_ids, vec![end, action], "T2PO queue, \\n dropped");
    let out_on = rollout(&t, specs(&t, 6), &on);
    let out_off = rollout(&t, specs(&t, 6), &control_off(&t));

    let mut fired = 0;
    for (ep, ep_off) in out_on.episodes.iter().zip(&out_off.episodes) {
        ep.trajectory.validate().unwrap();
        let turns = turns_of(&ep.trajectory);
        assert_eq!(turns.len(), ep.turn_control.len());
        for (k, ((ids, forced, _), tc)) in turns.iter().zip(&ep.turn_control).enumerate() {
            let n_forced = forced.iter().filter(|&&f| f).count();
            assert_eq!(n_forced, tc.forced_tokens);
            match tc.tti_trigger {
                Some(t_star) => {
                    fired += 1;
                    assert_eq!(t_star, 3, "{} turn {k}", ep.trajectory.id);
                    // The queue follows t* and nothing else is forced.
                    let q = (ids.len() - 3).min(2);
                    assert!(q >= 1);
                    assert_eq!(&ids[3..3 + q], &on.forced_ids[..q]);
                    let want: Vec<bool> = (0..ids.len()).map(|i| (3..3 + q).contains(&i)).collect();
                    assert_eq!(forced, &want);
                    let seg = ep
                        .trajectory
                        .agent_segments()
                        .nth(k)
                        .expect("agent segment");
                    assert!((3..3 + q).all(|i| seg.logprobs[i] == 0.0), "p(forced) = 1");
                }
                None => {
                    assert_eq!(n_forced, 0);
                    // Not fired: the turn was too short or its span closed before t = 3.
                    let head = t.tokenizer.decode(&ids[..ids.len().min(3)], false).unwrap();
                    assert!(
                        ids.len() <= 3 || REASONING_END_MARKERS.iter().any(|m| head.contains(m)),
                        "{} turn {k} should have fired: {head:?}",
                        ep.trajectory.id
                    );
                }
            }
        }
        // Forced tokens are out of the loss by default, in it with train_on_forced.
        let flat = ep.trajectory.flatten(false);
        let flat_all = ep.trajectory.flatten(true);
        let mut k = 0;
        for seg in &ep.trajectory.segments {
            if let Segment::Agent(a) = seg {
                for j in 0..a.ids.len() {
                    assert_eq!(flat.loss_mask[k + j], u8::from(!a.is_forced(j)));
                    assert_eq!(flat_all.loss_mask[k + j], 1);
                }
            }
            k += seg.ids().len();
        }
        // Same seeds: the first turn is sampled identically up to the trigger.
        let first_on = &turns[0].0;
        let first_off = &turns_of(&ep_off.trajectory)[0].0;
        let upto = ep.turn_control[0].tti_trigger.unwrap_or(first_on.len());
        assert_eq!(&first_on[..upto], &first_off[..upto]);
    }
    assert!(fired > 0, "the intervention never fired");
    assert_eq!(out_on.stats.tti_triggered, fired);
    let m = out_on.stats.metrics(&on);
    assert_eq!(m["rollout/tti_triggered"], fired as f64);
    assert!(m["rollout/forced_tokens"] >= fired as f64);

    // TTI off: nothing forced, nothing triggered.
    for ep in &out_off.episodes {
        assert!(
            ep.trajectory
                .agent_segments()
                .all(|a| a.forced_count() == 0)
        );
        assert!(ep.turn_control.iter().all(|c| c.tti_trigger.is_none()));
        let flat = ep.trajectory.flatten(false);
        let agent: usize = ep.trajectory.agent_token_count();
        assert_eq!(
            flat.loss_mask.iter().map(|&m| m as usize).sum::<usize>(),
            agent
        );
    }
    assert_eq!(out_off.stats.forced_tokens, 0);
}

#[test]
fn thinking_budget_fires_at_l_max() {
    let t = trainer();
    let mut r = t.config.rollout.clone();
    r.tds.enabled = false;
    r.tti.enabled = true;
    r.tti.min_tokens = 1000;
    r.tti.max_tokens = Some(2);
    let on = RolloutControl::from_config(&r, AgentFormatName::T2po, &t.tokenizer).unwrap();
    let out = rollout(&t, specs(&t, 4), &on);
    let mut fired = 0;
    for ep in &out.episodes {
        for (ids, forced, _) in turns_of(&ep.trajectory) {
            if forced.iter().any(|&f| f) {
                fired += 1;
                assert!(forced[2], "first forced token right after t = L_max = 2");
                assert_eq!(ids[2], on.forced_ids[0]);
                assert!(!forced[0] && !forced[1]);
            }
        }
    }
    assert!(fired > 0);
}

#[test]
fn turn_level_resampling_regenerates_flagged_turns_within_budget() {
    let t = trainer();
    let base = {
        let mut r = t.config.rollout.clone();
        r.tti.enabled = false;
        r.memory_window = None;
        r.tds.enabled = true;
        r.tds.rule = TdsRule::Paper;
        r
    };
    let make = |eta: f64, budget: usize, rule: TdsRule| {
        let mut r = base.clone();
        r.tds.eta = eta;
        r.tds.budget = budget;
        r.tds.rule = rule;
        RolloutControl::from_config(&r, AgentFormatName::T2po, &t.tokenizer).unwrap()
    };
    // η above any gap: every turn after the first (Γ¹ = ∞) is regenerated exactly `budget` times.
    for budget in [0usize, 1, 2] {
        let ctl = make(10.0, budget, TdsRule::Paper);
        let out = rollout(&t, specs(&t, 6), &ctl);
        let mut total = 0;
        let mut multi_turn = false;
        for ep in &out.episodes {
            for (k, tc) in ep.turn_control.iter().enumerate() {
                let want = if k == 0 { 0 } else { budget };
                assert_eq!(tc.regenerations, want, "{} turn {k}", ep.trajectory.id);
                assert!(tc.turn_score.is_some());
                total += tc.regenerations;
                multi_turn |= k > 0;
            }
        }
        assert!(multi_turn, "no episode had a second turn");
        assert_eq!(out.stats.tds_regenerations, total);
        assert!(out.stats.tds_max_regenerations <= budget);
        let m = out.stats.metrics(&ctl);
        assert_eq!(m["rollout/tds_regenerations"], total as f64);
        assert_eq!(m["rollout/tds_max_regenerations"], budget as f64);
    }
    // η = 0: Γ < 0 never holds, nothing is regenerated (paper and code rules alike).
    for rule in [TdsRule::Paper, TdsRule::Code] {
        let out = rollout(&t, specs(&t, 4), &make(0.0, 2, rule));
        assert_eq!(out.stats.tds_regenerations, 0);
    }
    // The kept turn is the last attempt: replay each turn alone from its context with the seed of
    // attempt `budget` (single-episode batches, so the token budget is known).
    let ctl = make(10.0, 2, TdsRule::Paper);
    let mut checked = 0;
    for spec in specs(&t, 3) {
        let seed = spec.seed;
        let out = rollout(&t, vec![spec.clone()], &ctl);
        let ep = &out.episodes[0];
        let flat = ep.trajectory.flatten(true);
        for (k, (ids, _, start)) in turns_of(&ep.trajectory).into_iter().enumerate() {
            let mut context = spec.prompt_ids.clone();
            context.extend_from_slice(&flat.ids[..start]);
            let attempt = ep.turn_control[k].regenerations;
            let again = replay(
                &t,
                context,
                attempt_seed(turn_seed(seed, k), attempt),
                start,
            );
            assert_eq!(again, ids, "{} turn {k}", ep.trajectory.id);
            checked += 1;
        }
    }
    assert!(checked >= 3);
}

/// Review F C1: at the t2po preset's own settings (its η and budget, TTI and the memory window
/// on), TDS selects. Some eligible turns are accepted on their first draw, some after a
/// regeneration before the budget is spent, not every turn spends the budget, and the kept
/// attempts' Γ is above the first attempts' Γ. With Φ normalised per turn (the old TDS) Γ
/// stayed below η and every eligible turn spent the budget.
#[test]
fn turn_level_resampling_selects_at_the_presets_eta() {
    let t = trainer();
    let ctl = RolloutControl::from_config(&t.config.rollout, AgentFormatName::T2po, &t.tokenizer)
        .unwrap();
    assert!(ctl.tds.enabled && ctl.tds.rule == TdsRule::Paper);
    let (eta, budget) = (ctl.tds.eta, ctl.tds.max_try);
    let out = rollout(&t, specs(&t, 32), &ctl);
    let (mut first_sum, mut kept_sum, mut eligible) = (0.0, 0.0, 0);
    let (mut at_once, mut later, mut spent) = (0, 0, 0);
    for ep in &out.episodes {
        for (k, tc) in ep.turn_control.iter().enumerate() {
            assert!(tc.turn_score.is_some(), "{} turn {k}", ep.trajectory.id);
            let (Some(first), Some(kept)) = (tc.first_gap, tc.kept_gap) else {
                assert_eq!(k, 0, "only an episode's first turn has no Γ");
                assert_eq!(tc.regenerations, 0);
                continue;
            };
            eligible += 1;
            first_sum += first;
            kept_sum += kept;
            match tc.regenerations {
                0 => {
                    assert!(first >= eta, "accepted at once with Γ = {first}");
                    at_once += 1;
                }
                r if r < budget => {
                    assert!(kept >= eta, "accepted after {r} with Γ = {kept}");
                    later += 1;
                }
                _ => spent += 1,
            }
        }
    }
    let m = out.stats.metrics(&ctl);
    assert_eq!(m["rollout/tds_eligible_turns"], eligible as f64);
    let share = |n: usize| n as f64 / eligible as f64;
    assert_eq!(m["rollout/tds_accepted_first_share"], share(at_once));
    assert_eq!(m["rollout/tds_budget_exhausted_share"], share(spent));
    assert!(m["rollout/tds_gap_p10"] <= m["rollout/tds_gap_p50"]);
    assert!(m["rollout/tds_gap_p50"] <= m["rollout/tds_gap_p90"]);
    eprintln!(
        "eligible {eligible}: accepted at once {at_once}, after a regeneration {later}, budget \
         spent {spent}; mean Γ first {:.3}, kept {:.3}; {m:?}",
        first_sum / eligible as f64,
        kept_sum / eligible as f64
    );
    assert!(eligible >= 20, "only {eligible} eligible turns");
    assert!(at_once > 0, "no turn accepted on its first draw");
    assert!(at_once < eligible, "no turn regenerated");
    assert!(
        later > 0,
        "no turn accepted before the budget after a regeneration"
    );
    assert!(spent < eligible, "every turn spent the budget");
    assert!(
        kept_sum > first_sum,
        "kept Γ {kept_sum} not above first-draw Γ {first_sum} (sums over {eligible} turns)"
    );
}

#[test]
fn memory_window_limits_the_context_to_the_last_p_turns() {
    let t = trainer();
    let mut r = t.config.rollout.clone();
    r.tti.enabled = false;
    r.tds.enabled = false;
    r.memory_window = Some(1);
    let ctl = RolloutControl::from_config(&r, AgentFormatName::T2po, &t.tokenizer).unwrap();
    let mut long = 0;
    for spec in specs(&t, 4) {
        let seed = spec.seed;
        let out = rollout(&t, vec![spec.clone()], &ctl);
        let ep = &out.episodes[0];
        let flat = ep.trajectory.flatten(true);
        let turns = turns_of(&ep.trajectory);
        let p = spec.prompt_ids.len();
        for (k, (ids, _, start)) in turns.iter().enumerate() {
            let tc = &ep.turn_control[k];
            // Prompt + turn k−1 and its observation only.
            let from = if k == 0 { 0 } else { turns[k - 1].2 };
            assert_eq!(tc.context_tokens, p + start - from, "turn {k}");
            assert_eq!(tc.memory_truncated, k >= 2);
            // The model saw exactly that context.
            let mut context = spec.prompt_ids.clone();
            context.extend_from_slice(&flat.ids[from..*start]);
            let again = replay(&t, context, turn_seed(seed, k), *start);
            assert_eq!(&again, ids, "{} turn {k}", ep.trajectory.id);
        }
        if turns.len() >= 3 {
            long += 1;
            assert!(out.stats.memory_truncated_turns >= 1);
        }
    }
    assert!(long > 0, "no episode reached a third turn");
    // Without a window every turn sees the whole history.
    let out = rollout(&t, specs(&t, 3), &control_off(&t));
    for ep in &out.episodes {
        let p = ep.trajectory.prompt_ids.len();
        for ((_, _, start), tc) in turns_of(&ep.trajectory).iter().zip(&ep.turn_control) {
            assert_eq!(tc.context_tokens, p + start);
            assert!(!tc.memory_truncated);
        }
    }
}

/// The t2po preset on the tiny world, with the preset's own rollout control (TTI, TDS, memory
/// window), turn budgets (48 / 400 tokens) and mini-batch, 8 prompts a step, and a warm start
/// long enough for a 64-wide model to write the oracle's long thoughts (150 steps of 4
/// demonstrations at lr 1e-2: SFT loss ≈ 0.15).
fn long_thought_trainer() -> Trainer {
    // `tiny_overrides` settings replaced here (the preset's own, or the ones below).
    let replaced = [
        "rollout.max_turn_tokens",
        "rollout.max_response_tokens",
        "rollout.prompts_per_step",
        "optim.mini_batch_size",
        "model.hidden_size",
        "model.intermediate_size",
        "sft.",
    ];
    let mut sets: Vec<String> = tiny_overrides()
        .into_iter()
        .filter(|s| !replaced.iter().any(|k| s.starts_with(k)))
        .collect();
    sets.extend(
        [
            "rollout.prompts_per_step=8",
            "model.hidden_size=64",
            "model.intermediate_size=128",
            "sft.steps=150",
            "sft.batch_size=4",
            "sft.lr=1e-2",
            "sft.warmup_steps=10",
        ]
        .map(String::from),
    );
    Trainer::new(TrainConfig::resolve(Some("t2po"), None, &sets).unwrap()).unwrap()
}

/// Per demonstrated agent turn, the number of trigger positions at which the thinking
/// intervention would cut reasoning the oracle wrote: `t* ∈ (L_min, p − 1]` where the turn's last reasoning token
/// is at `t = p` (`<think>` is `t = 1`; a trigger at `t* = p` only forces the `</think>` that
/// comes next). Also checks that every turn fits the turn budget.
fn cuttable_positions(t: &Trainer, task: &TaskSet) -> Vec<usize> {
    let open = t.tokenizer.token_to_id("<think>").unwrap();
    let close = t.tokenizer.token_to_id("</think>").unwrap();
    let min = t.config.rollout.tti.min_tokens;
    let demos = task
        .demonstrations(Split::Train, t.config.sft.noise, t.config.seed)
        .unwrap();
    let mut out = Vec::new();
    for d in &demos {
        for (text, _) in d.segments.iter().filter(|s| s.1) {
            let ids = t.tokenizer.encode(text).unwrap();
            assert!(
                ids.len() <= t.config.rollout.max_turn_tokens,
                "{} tokens: {text}",
                ids.len()
            );
            let at = |tok| ids.iter().position(|&i| i == tok).unwrap();
            let p = at(close) - at(open);
            out.push((p - 1).saturating_sub(min));
        }
    }
    out
}

/// Review D (t2po): on the default world's one-sentence thoughts the preset's TTI (L_min = 8)
/// fired on 1 of ~64 turns, and only where it forced the `</think>` the model was about to write.
/// On the long thoughts the preset sets (`task.world.thoughts = "long"`), the preset's own TTI
/// settings fire at a logged rate, cut reasoning the model would have continued, and the forced
/// tokens stay out of the loss of the rows the update trains on.
#[test]
fn t2po_presets_own_thinking_intervention_fires_on_long_thoughts() {
    let mut t = long_thought_trainer();
    let preset = TrainConfig::resolve(Some("t2po"), None, &[]).unwrap();
    assert_eq!(preset.task.world.thoughts, ThoughtStyle::Long);
    assert_eq!(t.config.task.world.thoughts, ThoughtStyle::Long);
    // No TTI override: the preset's α, N, ε, L_min, L_max and queue.
    assert_eq!(t.config.rollout.tti, preset.rollout.tti);
    assert!(t.config.rollout.tti.enabled && !t.config.rollout.train_on_forced);
    let min_tokens = t.config.rollout.tti.min_tokens;

    // Room for the rule: every long demonstrated thought leaves trigger positions that cut
    // reasoning; no short one does (its spans end by t = L_min + 1).
    let long = cuttable_positions(&t, &t.task);
    let mean = long.iter().sum::<usize>() as f64 / long.len() as f64;
    assert!(long.iter().all(|&n| n >= 8) && mean >= 15.0, "{long:?}");
    let mut short_task = t.config.task.clone();
    short_task.world.thoughts = ThoughtStyle::Short;
    let short = cuttable_positions(&t, &TaskSet::build(&short_task).unwrap());
    assert!(short.iter().all(|&n| n == 0), "{short:?}");

    t.warm_start(&mut |_, _, _| {}).unwrap();
    t.freeze_reference().unwrap();

    // The logged rate of a training step, and what it counts.
    let out = t.rl_step().unwrap();
    let m = &out.metrics;
    let controls = || out.episodes.iter().flat_map(|e| e.turn_control.iter());
    let turns = controls().count();
    let fired = controls().filter(|c| c.tti_trigger.is_some()).count();
    let forced: usize = controls().map(|c| c.forced_tokens).sum();
    let rate = m["rollout/tti_trigger_rate"];
    eprintln!("rollout/tti_trigger_rate = {rate} ({fired} of {turns} turns, {forced} forced)");
    assert!(rate > 0.0, "the preset's TTI never fired in {turns} turns");
    assert_eq!(rate, fired as f64 / turns as f64);
    assert_eq!(m["rollout/tti_triggered"], fired as f64);
    assert_eq!(m["rollout/forced_tokens"], forced as f64);
    assert!(controls().all(|c| c.tti_trigger.is_none_or(|t_star| t_star > min_tokens)));
    // The other controls' metrics count what the episodes record.
    assert!(m["rollout/tds_max_regenerations"] <= 2.0);
    let regenerations: usize = controls().map(|c| c.regenerations).sum();
    assert_eq!(m["rollout/tds_regenerations"], regenerations as f64);
    let truncated = controls().filter(|c| c.memory_truncated).count();
    assert_eq!(m["rollout/memory_truncated_turns"], truncated as f64);

    // Forced tokens are out of the loss of the trajectory rows and of the step samples the
    // preset trains on; every other agent token is in it.
    let (mut masked, mut flagged) = (0, 0);
    for e in &out.episodes {
        let traj = &e.trajectory;
        let row = Row::from_trajectory(traj, t.config.rollout.train_on_forced);
        let mut pos = 0;
        for seg in &traj.segments {
            if let Segment::Agent(a) = seg {
                for j in 0..a.ids.len() {
                    assert_eq!(row.loss_mask[pos + j], u8::from(!a.is_forced(j)));
                    flagged += usize::from(a.is_forced(j));
                }
            }
            pos += seg.ids().len();
        }
        let steps = row.step_samples(t.config.rollout.memory_window);
        let trained: usize = steps
            .iter()
            .flat_map(|r| &r.loss_mask)
            .map(|&x| usize::from(x))
            .sum();
        let n_forced: usize = traj.agent_segments().map(|a| a.forced_count()).sum();
        assert_eq!(trained, traj.agent_token_count() - n_forced);
        masked += n_forced;
    }
    assert_eq!((masked, flagged), (forced, forced));
    assert!(forced >= fired && forced > 0);

    // It cuts reasoning: replayed without the intervention (same context, same seed, the
    // attempt TDS kept), the model writes the same tokens up to t* and then keeps reasoning
    // where the intervention forced `</think>`.
    let policy = t.rollout_policy();
    let control =
        RolloutControl::from_config(&t.config.rollout, AgentFormatName::T2po, &t.tokenizer)
            .unwrap();
    let specs: Vec<EpisodeSpec> = t
        .task
        .questions(Split::Train)
        .iter()
        .take(24)
        .enumerate()
        .map(|(i, q)| EpisodeSpec {
            id: format!("e{i}"),
            prompt_uid: q.id.clone(),
            prompt_ids: t.tokenizer.encode(&t.task.prompt(q).unwrap()).unwrap(),
            task: TaskSet::env_task(q),
            seed: 1000 + i as u64,
        })
        .collect();
    let r = &t.config.rollout;
    let decoding = Decoding {
        temperature: 1.0,
        top_p: 1.0,
        top_k: 0,
        max_turn_tokens: r.max_turn_tokens,
        max_response_tokens: r.max_response_tokens,
    };
    let env = || Ok(Box::new(t.task.env()?) as Box<dyn Environment>);
    let out = run_chains_with(&policy, specs.clone(), &env, &decoding, &control).unwrap();
    let (mut cut, mut saved, mut checked) = (0, 0, 0);
    for (ep, spec) in out.episodes.iter().zip(&specs) {
        let flat = ep.trajectory.flatten(true);
        for (k, (ids, forced, start)) in turns_of(&ep.trajectory).into_iter().enumerate() {
            let tc = &ep.turn_control[k];
            let Some(t_star) = tc.tti_trigger else {
                continue;
            };
            assert!(!tc.memory_truncated && t_star > min_tokens);
            assert!(forced[t_star] && !forced[..t_star].iter().any(|&f| f));
            let mut context = spec.prompt_ids.clone();
            context.extend_from_slice(&flat.ids[..start]);
            let seed = attempt_seed(turn_seed(spec.seed, k), tc.regenerations);
            let params = SamplingParams {
                temperature: 1.0,
                top_p: 1.0,
                top_k: 0,
                max_new_tokens: r.max_turn_tokens,
                stop_token_ids: policy.stop_ids.to_vec(),
                stop_strings: Vec::new(),
                top_logprobs: 0,
            };
            let free = generate(&t.sampler, &[context], &[seed], &params, None)
                .unwrap()
                .remove(0)
                .tokens;
            assert_eq!(&free[..t_star], &ids[..t_star], "{} turn {k}", spec.id);
            checked += 1;
            // Reasoning tokens the free model wrote after t* before closing its span.
            let rest = t.tokenizer.decode(&free[t_star..], false).unwrap();
            let more = (t_star..free.len())
                .find(|&i| {
                    let text = t.tokenizer.decode(&free[t_star..=i], false).unwrap();
                    REASONING_END_MARKERS.iter().any(|m| text.contains(m))
                })
                .unwrap_or(free.len())
                - t_star;
            if more > 0 {
                cut += 1;
                saved += more;
            } else {
                assert!(REASONING_END_MARKERS.iter().any(|m| rest.starts_with(m)));
            }
        }
    }
    eprintln!(
        "replayed {checked} triggered turns: {cut} cut reasoning short, {saved} tokens saved"
    );
    assert!(checked > 0, "no turn triggered in the replayed rollouts");
    assert!(
        cut > 0,
        "every trigger only forced the `</think>` that came next"
    );
}

/// The t2po preset scores every step (EM on the answering step, −0.1 on each invalid step) and
/// those per-step rewards, not the environment's, are what its GiGPO-style estimator reads.
#[test]
fn t2po_step_rewards_carry_the_format_penalty_into_the_advantages() {
    let mut t = trainer();
    assert_eq!(t.config.reward.name(), "t2po_em");
    t.freeze_reference().unwrap();
    let out = t.rl_step().unwrap();
    let allowed = [0.0, -0.1, 1.0, 0.9];
    let mut penalised = 0;
    for e in &out.episodes {
        let tr = &e.trajectory.turn_rewards;
        assert_eq!(tr.len(), e.trajectory.num_turns(), "{}", e.trajectory.id);
        for &r in tr {
            assert!(allowed.iter().any(|a| (a - r).abs() < 1e-9), "{r}");
        }
        let (last, rest) = tr.split_last().unwrap();
        assert!(rest.iter().all(|&r| r <= 0.0));
        assert!((e.trajectory.outcome_reward.unwrap() - last).abs() < 1e-12);
        penalised += tr.iter().filter(|&&r| r < -0.05).count();
    }
    // Advantages from the step rewards differ from those of penalty-free rewards exactly when
    // some step was penalised.
    let groups: Vec<usize> = (0..out.episodes.len())
        .map(|i| i / t.config.rollout.group_size)
        .collect();
    let scores: Vec<f64> = out
        .episodes
        .iter()
        .map(|e| e.trajectory.outcome_reward.unwrap())
        .collect();
    let with: Vec<Vec<f64>> = out
        .episodes
        .iter()
        .map(|e| e.trajectory.turn_rewards.clone())
        .collect();
    let without: Vec<Vec<f64>> = with
        .iter()
        .map(|tr| tr.iter().map(|&r| r.max(0.0)).collect())
        .collect();
    let mut cfg = t.config.clone();
    cfg.rollout.filter_zero_variance_groups = false;
    let compute = |tr: &[Vec<f64>]| {
        turnwise::trainer::advantage::compute(
            &cfg,
            &common::scored(&out.episodes, &groups, &scores, tr, None),
            None,
            None,
            None,
        )
        .unwrap()
        .rows
        .iter()
        .map(|r| r.advantages.clone())
        .collect::<Vec<_>>()
    };
    let (a, b) = (compute(&with), compute(&without));
    // The tiny warm-started model writes invalid steps (23 with this seed): the check bites.
    assert!(penalised > 0);
    assert_ne!(a, b);
}

/// Review B 5.3 and review F m1: the format penalty lands on the invalid step only. The episode
/// score of every step sample is the episode's EM, minus that step's own penalty; the valid
/// steps of a trajectory with an invalid step are not lowered. The same holds of the step
/// returns GiGPO groups by anchor state (verl-agent discounts first, then takes the penalty off
/// that step's return): a step before an invalid one keeps the discounted return of the EM
/// rewards, without the γ^{k−j}·λ it lost when the penalty was discounted with the rewards.
#[test]
fn t2po_penalty_lowers_only_the_invalid_steps_sample() {
    use turnwise::trainer::advantage::{place_rewards, rollout_of};
    let mut t = trainer();
    t.freeze_reference().unwrap();
    let out = t.rl_step().unwrap();
    let gamma = t.config.to_toml().parse::<toml::Table>().unwrap()["advantage"]["gamma"]
        .as_float()
        .expect("advantage.gamma in the stored config");
    assert_eq!(gamma, 0.95, "the t2po preset's γ");
    // What the estimator groups: `R_k = Σ_{j≥k} γ^{j−k} r_j − p_k` (spec §3.7).
    let returns = |rewards: &[f64], penalties: &[f64]| {
        let mut out = vec![0.0; rewards.len()];
        let mut acc = 0.0;
        for k in (0..rewards.len()).rev() {
            acc = rewards[k] + gamma * acc;
            out[k] = acc - penalties.get(k).copied().unwrap_or(0.0);
        }
        out
    };
    let mut mixed = 0;
    let mut earlier_checked = 0;
    for e in &out.episodes {
        let tr = &e.trajectory.turn_rewards;
        let score = e.trajectory.outcome_reward.unwrap();
        let mut r = rollout_of(e, 0, score, tr, None);
        let penalised = place_rewards(&t.config, e, &mut r).unwrap();
        let steps = r
            .step_scores
            .clone()
            .expect("per-invalid-step placement sets step scores");
        let em: f64 = tr.iter().map(|&x| x.max(0.0)).sum::<f64>()
            + tr.iter().filter(|&&x| (x - 0.9).abs() < 1e-9).count() as f64 * 0.1;
        let mut seen = (false, false);
        for (k, &s) in steps.iter().enumerate() {
            let invalid = tr[k] < -0.05 || (tr[k] - 0.9).abs() < 1e-9;
            if invalid {
                assert!(
                    (s - (em - 0.1)).abs() < 1e-9,
                    "{} step {k}: {s}",
                    e.trajectory.id
                );
                seen.0 = true;
            } else {
                assert!((s - em).abs() < 1e-9, "{} step {k}: {s}", e.trajectory.id);
                seen.1 = true;
            }
        }
        assert_eq!(penalised, steps.iter().filter(|&&s| s < em - 0.05).count());
        mixed += usize::from(seen.0 && seen.1);
        // Step returns: from the EM rewards (the penalty added back), minus the own penalty.
        let invalid: Vec<bool> = tr
            .iter()
            .map(|&x| x < -0.05 || (x - 0.9).abs() < 1e-9)
            .collect();
        let clean: Vec<f64> = tr
            .iter()
            .zip(&invalid)
            .map(|(&x, &bad)| if bad { x + 0.1 } else { x })
            .collect();
        let own: Vec<f64> = invalid
            .iter()
            .map(|&bad| if bad { 0.1 } else { 0.0 })
            .collect();
        let want = returns(&clean, &own);
        let got = returns(&r.step_rewards, &r.step_penalties);
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() < 1e-9,
                "{} step {k}: return {g}, want {w} (rewards {:?}, penalties {:?})",
                e.trajectory.id,
                r.step_rewards,
                r.step_penalties
            );
            earlier_checked += usize::from(!invalid[k] && invalid[k + 1..].iter().any(|&b| b));
        }
    }
    // The tiny model writes trajectories with both valid and invalid steps: the check bites.
    assert!(mixed > 0, "no trajectory mixes valid and invalid steps");
    assert!(
        earlier_checked > 0,
        "no valid step before an invalid one: the return check does not bite"
    );
}

#[test]
fn rollout_control_config() {
    let t2po = TrainConfig::resolve(Some("t2po"), None, &[]).unwrap();
    let r = &t2po.rollout;
    assert!(r.tti.enabled && r.tds.enabled);
    assert_eq!(r.memory_window, Some(4));
    assert_eq!((r.tti.alpha, r.tti.window, r.tti.epsilon), (0.4, 2, 0.05));
    assert_eq!(
        (r.tds.rule, r.tds.eta, r.tds.budget),
        (TdsRule::Paper, 0.1, 2)
    );
    assert!(!r.train_on_forced);
    // Other presets keep everything off (GiGPO's window of 4 never truncates 4 turns).
    for name in ["grpo", "gigpo", "a2tgpo", "at2po"] {
        let c = TrainConfig::resolve(Some(name), None, &[]).unwrap();
        assert!(!c.rollout.tti.enabled && !c.rollout.tds.enabled, "{name}");
    }
    let grpo = TrainConfig::resolve(Some("grpo"), None, &[]).unwrap();
    assert_eq!(grpo.rollout.memory_window, None);
    assert_eq!(
        grpo.rollout.tds.rule,
        TdsRule::Paper,
        "paper rule by default"
    );
    // Overrides, the code rule, and the round trip through the stored TOML.
    let c = TrainConfig::resolve(
        Some("t2po"),
        None,
        &[
            "rollout.tds.rule=code".into(),
            "rollout.tti.max_tokens=450".into(),
            "rollout.tti.forced_queue=[\"</think>\"]".into(),
        ],
    )
    .unwrap();
    assert_eq!(c.rollout.tds.rule, TdsRule::Code);
    assert_eq!(c.rollout.tti.max_tokens, Some(450));
    for cfg in [&c, &grpo] {
        let back = TrainConfig::from_table(cfg.to_toml().parse().unwrap()).unwrap();
        assert_eq!(&back, cfg);
    }
    // Errors name the field.
    for (set, field) in [
        ("rollout.tti.epsilon=-1", "rollout.tti.epsilon"),
        ("rollout.tti.alpha=1.5", "rollout.tti.alpha"),
        ("rollout.tti.top_j=0", "rollout.tti.top_j"),
        ("rollout.tti.max_tokens=0", "rollout.tti.max_tokens"),
        ("rollout.tti.forced_queue=[]", "rollout.tti.forced_queue"),
        ("rollout.tds.eta=-0.1", "rollout.tds.eta"),
        ("rollout.tds.rule=sometimes", "rollout.tds.rule"),
        ("rollout.tds.budgt=3", "budgt"),
        ("rollout.tti.windw=3", "windw"),
        ("rollout.memory_window=-1", "rollout.memory_window"),
        ("task.world.thoughts=\"medium\"", "task.world.thoughts"),
    ] {
        let e = TrainConfig::resolve(Some("t2po"), None, &[set.into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains(field), "{set}: {e}");
    }
    // Chain rollouts only.
    let e = TrainConfig::resolve(Some("at2po"), None, &["rollout.tti.enabled=true".into()])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rollout.tti.enabled") && e.contains("chain"),
        "{e}"
    );
    let e = TrainConfig::resolve(Some("at2po"), None, &["rollout.memory_window=2".into()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("rollout.memory_window"), "{e}");
}
