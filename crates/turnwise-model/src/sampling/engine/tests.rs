//! Tests of the multi-turn engine on tiny models.

use std::collections::HashMap;

use candle_core::DType;

use super::*;
use crate::model::ModelConfig;
use crate::model::tests::{model_for, tiny_configs};

fn detached(cfg: &ModelConfig, dtype: DType, seed: u64) -> (candle_nn::VarMap, Transformer) {
    let (vm, m) = model_for(cfg, dtype, seed);
    let t = Transformer::detached_from_varmap(m.config(), &vm).unwrap();
    (vm, t)
}

fn free(max_new: usize) -> SequenceParams {
    SequenceParams {
        sampling: SamplingParams {
            temperature: 1.0,
            top_p: 0.95,
            top_k: 50,
            max_new_tokens: max_new,
            top_logprobs: 2,
            ..Default::default()
        },
        confidence_top_j: 5,
        ..Default::default()
    }
}

fn greedy(max_new: usize) -> SequenceParams {
    let mut p = free(max_new);
    p.sampling.temperature = 0.0;
    p
}

/// Records the logits every sequence saw, per step.
#[derive(Default)]
struct Recorder {
    seen: HashMap<SeqId, Vec<Vec<f32>>>,
}

impl TokenHook for Recorder {
    fn process(&mut self, seq: &Sequence, logits: &mut [f32]) -> Option<u32> {
        self.seen.entry(seq.id).or_default().push(logits.to_vec());
        None
    }
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn generated(seq: &Sequence) -> Vec<u32> {
    seq.tokens[seq.prompt_len..].to_vec()
}

fn assert_close(a: &[f32], b: &[f32], what: &str) {
    let d = max_diff(a, b);
    assert!(d < 1e-4, "{what}: max diff {d}");
}

#[test]
fn a_row_alone_equals_the_row_in_a_churning_batch() {
    let cfg = ModelConfig::tiny_qwen2(96);
    let (_vm, model) = detached(&cfg, DType::F32, 31);
    let target = vec![5u32, 17, 3, 8];

    let mut alone = SamplingEngine::new(&model, None, EngineConfig::default());
    let a = alone.add_sequence(target.clone(), free(14), 77).unwrap();
    let ends = alone.run_until_stop(None).unwrap();
    assert_eq!(ends.len(), 1);
    assert_eq!(ends[0].reason, StopReason::TurnLimit);
    let solo = alone.sequence(a).unwrap().clone();
    assert_eq!(generated(&solo).len(), 14);

    let mut eng = SamplingEngine::new(&model, None, EngineConfig::with_max_batch_size(8));
    let other = |eng: &mut SamplingEngine<'_>, len: usize, max_new: usize, seed: u64| {
        let prompt: Vec<u32> = (0..len as u32)
            .map(|i| (i * 7 + seed as u32) % 90)
            .collect();
        let mut p = free(max_new);
        p.sampling.stop_token_ids = vec![(seed % 90) as u32];
        eng.add_sequence(prompt, p, seed).unwrap()
    };
    other(&mut eng, 2, 3, 1);
    other(&mut eng, 9, 5, 2);
    let long_lived = other(&mut eng, 6, 30, 3);
    eng.step(None).unwrap();
    eng.step(None).unwrap();
    let t = eng.add_sequence(target.clone(), free(14), 77).unwrap();
    eng.step(None).unwrap();
    for (len, max_new, seed) in [(15, 4, 4), (1, 9, 5), (3, 2, 6), (11, 40, 7)] {
        other(&mut eng, len, max_new, seed);
    }
    let mut steps = 0;
    let mut peak = 0;
    while !eng.is_idle() {
        eng.step(None).unwrap();
        steps += 1;
        peak = peak.max(eng.running().len());
        assert!(eng.running().len() <= 8);
        if steps == 1 {
            // Rows keep joining mid-generation, one more than there is room for.
            for (len, max_new, seed) in [(4, 6, 8), (7, 3, 9), (2, 8, 10)] {
                other(&mut eng, len, max_new, seed);
            }
            assert!(eng.num_waiting() > 0);
        }
        if steps == 5 && eng.running().contains(&long_lived) {
            eng.remove(long_lived).unwrap();
        }
    }
    assert_eq!(peak, 8);
    let batched = eng.sequence(t).unwrap();
    assert_eq!(generated(batched), generated(&solo));
    assert_close(&batched.logprobs, &solo.logprobs, "logprobs");
    assert_close(&batched.entropies, &solo.entropies, "entropies");
    assert_close(&batched.confidences, &solo.confidences, "confidences");
    assert_eq!(batched.status, SeqStatus::Paused(StopReason::TurnLimit));
    // Every stopped row left the batch and took a compact cache of all but its last token.
    for id in eng.ids() {
        let s = eng.sequence(id).unwrap();
        assert_eq!(eng.cached_len(id).unwrap() + 1, s.len(), "{id}");
    }
    assert_eq!(eng.batch_width(), 0);
}

#[test]
fn appending_env_tokens_continues_like_a_fresh_prefill() {
    for cfg in tiny_configs() {
        let (_vm, model) = detached(&cfg, DType::F32, 32);
        let mut eng = SamplingEngine::new(&model, None, EngineConfig::default());
        // A neighbour keeps the batch busy (and padded) across both turns.
        eng.add_sequence(vec![1, 2, 3, 4, 5, 6, 7, 8, 9], free(40), 5)
            .unwrap();
        let a = eng.add_sequence(vec![11, 12, 13], free(6), 9).unwrap();
        let mut rec = Recorder::default();
        while eng.sequence(a).unwrap().status != SeqStatus::Paused(StopReason::TurnLimit) {
            eng.step(Some(&mut rec)).unwrap();
        }
        let turn1 = eng.sequence(a).unwrap().len();
        assert_eq!(eng.cached_len(a), Some(turn1 - 1));
        let obs = [40u32, 41, 42, 43];
        eng.append_tokens(a, &obs).unwrap();
        let seq = eng.sequence(a).unwrap();
        assert_eq!(&seq.origins[turn1..], &[TokenOrigin::Appended; 4]);
        // A fresh sequence over the same prefix, with the same generator state.
        let b = eng
            .add_sequence_with_rng(seq.tokens.clone(), free(6), eng.rng(a).unwrap().clone())
            .unwrap();
        eng.resume(a).unwrap();
        let before = eng.stats().prefill_tokens;
        rec.seen.clear();
        eng.step(Some(&mut rec)).unwrap();
        // Only the uncached tail (last sampled token + observation) and b's prompt ran.
        assert_eq!(
            eng.stats().prefill_tokens - before,
            (1 + obs.len() + turn1 + obs.len()) as u64
        );
        while [a, b]
            .iter()
            .any(|&s| eng.sequence(s).unwrap().status == SeqStatus::Running)
        {
            eng.step(Some(&mut rec)).unwrap();
        }
        let (sa, sb) = (eng.sequence(a).unwrap(), eng.sequence(b).unwrap());
        assert_eq!(sa.turn_tokens(), sb.turn_tokens(), "{:?}", cfg.architecture);
        assert_eq!(sa.turns, 2);
        assert_eq!(sa.turn_start, turn1 + obs.len());
        assert_close(
            &sa.logprobs[sa.turn_start..],
            &sb.logprobs[sb.turn_start..],
            "logprobs",
        );
        for (la, lb) in rec.seen[&a].iter().zip(&rec.seen[&b]) {
            assert_close(la, lb, "logits");
        }
        assert_eq!(rec.seen[&a].len(), 6);
    }
}

#[test]
fn forks_share_the_prefix_and_follow_their_own_seeds() {
    let cfg = ModelConfig::tiny_qwen2(96);
    let (_vm, model) = detached(&cfg, DType::F32, 33);
    let mut eng = SamplingEngine::new(&model, None, EngineConfig::default());
    let root = eng.add_sequence(vec![3, 1, 4, 1, 5], free(5), 1).unwrap();
    eng.run_until_stop(None).unwrap();
    eng.append_tokens(root, &[60, 61]).unwrap();
    let turn2 = eng.sequence(root).unwrap().len();
    let kids = eng.fork(root, &[100, 101, 102]).unwrap();
    // Re-sample the first turn from the prompt (a sibling, AT2PO-style).
    let sib = eng.fork_prefix(root, 5, &[103]).unwrap()[0];
    assert_eq!(eng.sequence(sib).unwrap().tokens, vec![3, 1, 4, 1, 5]);
    assert_eq!(eng.cached_len(sib), Some(4));
    for &k in &kids {
        assert_eq!(eng.cached_len(k), eng.cached_len(root));
        assert_eq!(eng.sequence(k).unwrap().len(), turn2);
        eng.resume(k).unwrap();
    }
    eng.resume(sib).unwrap();
    eng.run_until_stop(None).unwrap();
    let mut turns = Vec::new();
    for (&k, seed) in kids.iter().chain([&sib]).zip([100u64, 101, 102, 103]) {
        let s = eng.sequence(k).unwrap();
        turns.push(s.turn_tokens().to_vec());
        let mut fresh = SamplingEngine::new(&model, None, EngineConfig::default());
        let prefix = s.tokens[..s.turn_start].to_vec();
        let f = fresh.add_sequence(prefix, free(5), seed).unwrap();
        fresh.run_until_stop(None).unwrap();
        let fs = fresh.sequence(f).unwrap();
        assert_eq!(s.turn_tokens(), fs.turn_tokens(), "fork {k}");
        assert_close(
            &s.logprobs[s.turn_start..],
            &fs.logprobs[fs.turn_start..],
            "fork logprobs",
        );
    }
    turns.dedup();
    assert!(turns.len() > 1, "different seeds gave identical turns");
    // The parent is untouched.
    assert_eq!(eng.sequence(root).unwrap().len(), turn2);
    assert!(eng.fork_prefix(root, 0, &[1]).is_err());
    assert!(eng.fork_prefix(root, turn2 + 1, &[1]).is_err());
}

#[test]
fn hooks_force_tokens_and_stop_strings_end_turns() {
    let cfg = ModelConfig::tiny_qwen2(96);
    let (_vm, model) = detached(&cfg, DType::F64, 34);
    let words: Vec<String> = (0..80).map(|i| format!("w{i}")).collect();
    let tok = crate::tokenizer::TextTokenizer::train_word_level(
        &[words.join(" ")],
        96,
        crate::tokenizer::DEFAULT_SPECIAL_TOKENS,
    )
    .unwrap();
    let close_search = tok.special_id("</search>").unwrap();
    let think_end = tok.special_id("</think>").unwrap();
    let mut eng = SamplingEngine::new(&model, Some(&tok), EngineConfig::default());
    let mut p = free(12);
    p.sampling.temperature = 0.8;
    p.sampling.stop_strings = vec!["</answer>".into(), "</search>".into()];
    let a = eng.add_sequence(vec![20, 21, 22], p.clone(), 3).unwrap();
    let b = eng.add_sequence(vec![30, 31], p.clone(), 4).unwrap();
    // Force `</think>` at a's 3rd token and `</search>` at its 5th; b is left alone.
    let mut seen: Vec<(usize, Vec<f32>)> = Vec::new();
    let mut hook = |seq: &Sequence, logits: &mut [f32]| -> Option<u32> {
        if seq.id != a {
            return None;
        }
        let n = seq.turn_tokens().len();
        seen.push((n, logits.to_vec()));
        match n {
            2 => Some(think_end),
            4 => Some(close_search),
            _ => {
                // Keep the stop strings from being sampled by chance.
                logits[close_search as usize] = f32::NEG_INFINITY;
                logits[close_search as usize + 4] = f32::NEG_INFINITY; // </answer>
                None
            }
        }
    };
    let ends = eng.run_until_stop(Some(&mut hook)).unwrap();
    let sa = eng.sequence(a).unwrap();
    assert_eq!(sa.turn_tokens().len(), 5);
    assert_eq!(sa.tokens[5], think_end);
    assert_eq!(sa.tokens[7], close_search);
    assert_eq!(
        &sa.origins[3..],
        &[
            TokenOrigin::Sampled,
            TokenOrigin::Sampled,
            TokenOrigin::Forced,
            TokenOrigin::Sampled,
            TokenOrigin::Forced
        ]
    );
    assert_eq!(sa.num_forced(), 2);
    assert_eq!(sa.num_generated(), 5);
    let end_a = ends.iter().find(|e| e.id == a).unwrap();
    assert_eq!(end_a.reason, StopReason::StopString(1));
    assert_eq!((end_a.start, end_a.end), (3, 8));
    // The forced token's statistics are those of the distribution it replaced.
    let (_, logits) = &seen[2];
    let scaled: Vec<f64> = logits.iter().map(|&x| x as f64 / 0.8).collect();
    let m = scaled.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = m + scaled.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
    let lp: Vec<f64> = scaled.iter().map(|x| x - lse).collect();
    assert!((sa.logprobs[5] as f64 - lp[think_end as usize]).abs() < 1e-5);
    let ent = -lp.iter().map(|l| l.exp() * l).sum::<f64>();
    assert!((sa.entropies[5] as f64 - ent).abs() < 1e-5);
    let mut sorted = lp.clone();
    sorted.sort_by(|x, y| y.total_cmp(x));
    let conf = -sorted[..5].iter().sum::<f64>() / 5.0;
    assert!((sa.confidences[5] as f64 - conf).abs() < 1e-5);
    assert_eq!(sa.top_logprobs[5].len(), 2);
    let sb = eng.sequence(b).unwrap();
    assert_eq!(sb.num_forced(), 0);

    // A forced token stays in the context: greedy continuation equals a fresh prefill.
    let mut eng = SamplingEngine::new(&model, None, EngineConfig::default());
    let g = eng.add_sequence(vec![20, 21, 22], greedy(6), 0).unwrap();
    let mut force = |seq: &Sequence, _: &mut [f32]| -> Option<u32> {
        (seq.turn_tokens().len() == 1).then_some(think_end)
    };
    eng.run_until_stop(Some(&mut force)).unwrap();
    let sg = eng.sequence(g).unwrap().clone();
    assert_eq!(sg.tokens[4], think_end);
    let f = eng
        .add_sequence(sg.tokens[..5].to_vec(), greedy(4), 0)
        .unwrap();
    eng.run_until_stop(None).unwrap();
    assert_eq!(eng.sequence(f).unwrap().turn_tokens(), &sg.tokens[5..]);

    // A hook that forbids everything or forces an unknown token is an error.
    let mut eng = SamplingEngine::new(&model, None, EngineConfig::default());
    eng.add_sequence(vec![1], greedy(3), 0).unwrap();
    let mut bad = |_: &Sequence, _: &mut [f32]| -> Option<u32> { Some(1000) };
    let err = eng.step(Some(&mut bad)).unwrap_err();
    assert!(err.to_string().contains("vocab_size"), "{err}");
    let err = eng.step(None).unwrap_err();
    assert!(err.to_string().contains("previous step failed"), "{err}");
}

#[test]
fn turn_trajectory_and_length_limits() {
    let cfg = ModelConfig::tiny_qwen2(96);
    let (_vm, model) = detached(&cfg, DType::F32, 35);
    let mut eng = SamplingEngine::new(&model, None, EngineConfig::default());
    let mut p = free(5);
    p.max_generated_tokens = Some(7);
    let a = eng.add_sequence(vec![1, 2, 3], p, 1).unwrap();
    let mut q = free(50);
    q.max_len = Some(10);
    let b = eng.add_sequence(vec![4, 5, 6, 7], q, 2).unwrap();
    let ends = eng.run_until_stop(None).unwrap();
    assert_eq!(ends.len(), 2);
    assert_eq!(ends[0].reason, StopReason::TurnLimit);
    assert_eq!((ends[0].start, ends[0].end), (3, 8));
    assert_eq!(ends[1].reason, StopReason::SequenceLimit);
    assert_eq!(eng.sequence(b).unwrap().len(), 10);
    assert!(StopReason::SequenceLimit.is_terminal());

    eng.append_tokens(a, &[9, 9]).unwrap();
    eng.resume(a).unwrap();
    let ends = eng.run_until_stop(None).unwrap();
    assert_eq!(ends[0].reason, StopReason::TrajectoryLimit);
    assert_eq!((ends[0].start, ends[0].end), (10, 12));
    assert_eq!(eng.sequence(a).unwrap().num_generated(), 7);
    // Resuming at the limit ends the turn at once, with nothing generated.
    eng.resume(a).unwrap();
    let ends = eng.step(None).unwrap();
    assert_eq!(ends[0].reason, StopReason::TrajectoryLimit);
    assert_eq!(ends[0].start, ends[0].end);

    // The model's context.
    let mut small = cfg.clone();
    small.max_position_embeddings = 6;
    let (_vm2, m2) = detached(&small, DType::F32, 36);
    let mut eng = SamplingEngine::new(&m2, None, EngineConfig::default());
    let c = eng.add_sequence(vec![1, 2, 3, 4], free(50), 1).unwrap();
    let ends = eng.run_until_stop(None).unwrap();
    assert_eq!(ends[0].reason, StopReason::ContextFull);
    assert_eq!(eng.sequence(c).unwrap().len(), 6);
    assert_eq!(
        StopReason::ContextFull.finish_reason(),
        FinishReason::ContextFull
    );

    // Misuse is reported.
    let mut eng = SamplingEngine::new(&model, None, EngineConfig::default());
    assert!(eng.add_sequence(vec![], free(3), 0).is_err());
    assert!(eng.add_sequence(vec![500], free(3), 0).is_err());
    let mut s = free(3);
    s.sampling.stop_strings = vec!["x".into()];
    let err = eng.add_sequence(vec![1], s, 0).unwrap_err();
    assert!(err.to_string().contains("tokenizer"), "{err}");
    let d = eng.add_sequence(vec![1, 2], free(30), 0).unwrap();
    eng.step(None).unwrap();
    assert!(eng.append_tokens(d, &[1]).is_err());
    assert!(eng.resume(d).is_err());
    assert!(eng.fork(d, &[1]).is_err());
    assert!(eng.set_params(d, free(3)).is_err());
    let removed = eng.remove(d).unwrap();
    assert_eq!(removed.id, d);
    assert!(eng.is_idle());
    assert!(eng.sequence(d).is_none());
}

#[test]
fn confidence_matches_the_spec_vectors() {
    let top = |ps: &[f64]| -> Vec<(u32, f32)> {
        ps.iter()
            .enumerate()
            .map(|(i, p)| (i as u32, p.ln() as f32))
            .collect()
    };
    assert!((top_j_confidence(&top(&[0.7, 0.2, 0.05]), 3) - 1.653948).abs() < 1e-5);
    assert!((top_j_confidence(&top(&[0.97, 0.01, 0.005]), 3) - 3.311316).abs() < 1e-5);
    assert_eq!(top_j_confidence(&top(&[0.5, 0.5]), 0), 0.0);
    // Only finite entries count.
    let mut t = top(&[0.5, 0.5]);
    t.push((2, f32::NEG_INFINITY));
    assert!((top_j_confidence(&t, 3) - 0.5f32.ln().abs()).abs() < 1e-6);
}

#[test]
fn the_engine_sees_optimizer_updates_without_copies() {
    let cfg = ModelConfig::tiny_qwen2(96);
    let (vm, model) = detached(&cfg, DType::F32, 37);
    let run = |model: &Transformer| {
        let mut eng = SamplingEngine::new(model, None, EngineConfig::default());
        let mut rec = Recorder::default();
        let id = eng.add_sequence(vec![1, 2, 3], greedy(1), 0).unwrap();
        eng.run_until_stop(Some(&mut rec)).unwrap();
        rec.seen[&id][0].clone()
    };
    let before = run(&model);
    {
        let data = vm.data().lock().unwrap();
        let w = &data["model.norm.weight"];
        w.set(&(w.as_tensor() * 3.0).unwrap()).unwrap();
    }
    let after = run(&model);
    assert!(max_diff(&before, &after) > 1e-3);
}

fn long_prompt(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7 + 3) % 90 + 2).collect()
}

#[test]
fn chunked_prefill_equals_one_shot_and_interleaves_with_decoding() {
    let cfg = ModelConfig::tiny_qwen2(96);
    let (_vm, model) = detached(&cfg, DType::F32, 5);
    let prompt = long_prompt(150);
    let run = |chunk: usize| {
        let config = EngineConfig {
            prefill_chunk: chunk,
            ..EngineConfig::default()
        };
        let mut eng = SamplingEngine::new(&model, None, config);
        // A short sequence decodes while the long one is prefilled chunk by chunk.
        let short = eng.add_sequence(vec![4, 5, 6], greedy(8), 1).unwrap();
        let long = eng.add_sequence(prompt.clone(), greedy(6), 2).unwrap();
        let mut rec = Recorder::default();
        let mut first_token_step = None;
        let mut short_tokens_meanwhile = 0;
        while !eng.is_idle() {
            eng.step(Some(&mut rec)).unwrap();
            if first_token_step.is_none() && eng.sequence(long).unwrap().len() > prompt.len() {
                first_token_step = Some(eng.stats().steps);
                short_tokens_meanwhile = eng.sequence(short).unwrap().num_generated();
            }
        }
        let out = (
            generated(eng.sequence(long).unwrap()),
            rec.seen.remove(&long).unwrap(),
        );
        (
            out,
            eng.stats(),
            first_token_step.unwrap(),
            short_tokens_meanwhile,
        )
    };
    let ((toks_one, logits_one), stats_one, first_one, _) = run(0);
    let ((toks_chunked, logits_chunked), stats_chunked, first_chunked, meanwhile) = run(32);
    assert_eq!(toks_one, toks_chunked, "greedy tokens");
    for (a, b) in logits_one.iter().zip(&logits_chunked) {
        assert_close(a, b, "logits after a chunked prefill");
    }
    assert_eq!(stats_one.prefill_tokens, stats_chunked.prefill_tokens);
    // Unchunked, both join at step 1. Chunked, the short one joins alone at step 1 (a long
    // prefill never shares a step), then four chunks of 32 run on their own (steps 2-5) and the
    // last 22 tokens join the batch at step 6.
    assert_eq!(first_one, 1);
    assert_eq!(
        first_chunked, 6,
        "steps before the long sequence's first token"
    );
    assert!(
        meanwhile >= 4,
        "the short sequence decodes while the long one prefills ({meanwhile} tokens)"
    );
}

/// An engine that prefills in chunks of 16 tokens, holding one 100-token prompt that
/// generates 4 greedy tokens.
fn chunked_100_token_prompt(model: &Transformer) -> (SamplingEngine<'_>, SeqId) {
    let config = EngineConfig {
        prefill_chunk: 16,
        ..EngineConfig::default()
    };
    let mut eng = SamplingEngine::new(model, None, config);
    let id = eng.add_sequence(long_prompt(100), greedy(4), 3).unwrap();
    (eng, id)
}

/// Address of the first value of a CPU tensor's storage (the same buffer has the same one).
fn buffer_addr(t: &Tensor) -> usize {
    let (storage, _) = t.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cpu(cpu) => cpu.as_slice::<f32>().unwrap().as_ptr() as usize,
        _ => unreachable!("CPU tests"),
    }
}

#[test]
fn a_chunked_prefill_writes_into_one_buffer_with_room_for_the_prompt_and_decoding() {
    // Each chunk, the last part and the first decoding steps write into the buffers the first
    // chunk allocated: a long prompt's cache is never held twice (issue 30 item 5).
    let cfg = ModelConfig::tiny_qwen2(96);
    let (_vm, model) = detached(&cfg, DType::F32, 7);
    let (mut eng, id) = chunked_100_token_prompt(&model);
    eng.step(None).unwrap();
    let room = eng.seqs[&id]
        .room
        .as_ref()
        .expect("the first chunk allocates room");
    let (k, v) = room[0].buffers();
    assert_eq!(
        k.dims()[2],
        100 + KV_RESERVE,
        "room for the prompt and decoding"
    );
    let addrs = (buffer_addr(k), buffer_addr(v));
    let mut chunks = 1;
    while eng.seqs[&id].seq.status == SeqStatus::Waiting {
        eng.step(None).unwrap();
        chunks += 1;
    }
    // 6 chunks of 16, then the last 4 tokens join the batch (and the first token is drawn).
    assert_eq!(chunks, 7);
    for _ in 0..2 {
        let layers = eng.batch.layers.as_ref().expect("running");
        let (k, v) = layers[0].buffers();
        assert_eq!(
            (buffer_addr(k), buffer_addr(v)),
            addrs,
            "the batch runs on the chunks' buffers, not a copy"
        );
        eng.step(None).unwrap();
    }
    assert!(eng.seqs[&id].room.is_none());
    // Paused alone, the sequence keeps views of the same buffers, not a copy.
    eng.run_until_stop(None).unwrap();
    let cache = eng.seqs[&id]
        .cache
        .as_ref()
        .expect("a paused sequence keeps its cache");
    assert_eq!(
        (buffer_addr(&cache[0].0), buffer_addr(&cache[0].1)),
        addrs,
        "the paused sequence's cache is a view of the buffers"
    );
    assert_eq!(
        cache[0].0.dims()[2],
        103,
        "the prompt and the first 3 tokens"
    );
}

#[test]
fn a_sequence_removed_mid_prefill_stops_at_its_chunk() {
    let cfg = ModelConfig::tiny_qwen2(96);
    let (_vm, model) = detached(&cfg, DType::F32, 6);
    let (mut eng, id) = chunked_100_token_prompt(&model);
    eng.step(None).unwrap();
    eng.step(None).unwrap();
    assert_eq!(eng.stats().prefill_tokens, 32);
    assert_eq!(eng.cached_len(id), Some(32));
    assert_eq!(eng.sequence(id).unwrap().status, SeqStatus::Waiting);
    eng.remove(id).unwrap();
    assert!(eng.is_idle());
    eng.step(None).unwrap();
    assert_eq!(
        eng.stats().prefill_tokens,
        32,
        "no prefill after the removal"
    );
}

#[test]
fn the_memory_budget_queues_what_does_not_fit_and_refuses_what_never_can() {
    let cfg = ModelConfig::tiny_qwen2(96);
    let (_vm, model) = detached(&cfg, DType::F32, 7);
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| long_prompt(40 + i)).collect();
    let run = |budget: Option<u64>| {
        let config = EngineConfig {
            memory_budget: budget,
            ..EngineConfig::default()
        };
        let mut eng = SamplingEngine::new(&model, None, config);
        let ids: Vec<SeqId> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| eng.add_sequence(p.clone(), free(10), i as u64).unwrap())
            .collect();
        let mut peak = 0;
        while !eng.is_idle() {
            eng.step(None).unwrap();
            peak = peak.max(eng.running().len());
        }
        let out: Vec<Vec<u32>> = ids
            .iter()
            .map(|&id| generated(eng.sequence(id).unwrap()))
            .collect();
        (out, peak)
    };
    let (free_out, free_peak) = run(None);
    assert_eq!(free_peak, 6, "unbudgeted, all six decode together");
    // Room for two rows of this size decoding while a third is prefilled.
    let probe = SamplingEngine::new(&model, None, EngineConfig::default());
    let budget = probe.memory_need(2, 45 + 10, 1, 45, 45);
    let (out, peak) = run(Some(budget));
    assert!((1..=2).contains(&peak), "budgeted peak batch {peak}");
    assert_eq!(out, free_out, "queueing changes no sequence's tokens");

    // A sequence that alone needs more than the budget is refused, naming the budget.
    let one = probe.memory_estimate(40, &free(10));
    let mut eng = SamplingEngine::new(
        &model,
        None,
        EngineConfig {
            memory_budget: Some(one - 1),
            ..EngineConfig::default()
        },
    );
    let err = eng
        .add_sequence(long_prompt(40), free(10), 0)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("memory_budget") && err.contains("MiB"),
        "{err}"
    );
    assert!(eng.add_sequence(long_prompt(30), free(10), 0).is_ok());
}

/// `share_prompts` (review cli-as-a-user-3, M4): the samples of one prompt prefill it once (all
/// but its last token, in chunks when it is long), draw the tokens each would draw from its own
/// prefill, and while they wait the memory budget counts the shared columns once.
#[test]
fn a_prompt_shared_by_waiting_sequences_is_prefilled_once_and_counted_once() {
    let cfg = ModelConfig::tiny_qwen2(96);
    let (_vm, model) = detached(&cfg, DType::F32, 9);
    let prompt = long_prompt(70);
    let run = |share: bool, chunk: usize| {
        let config = EngineConfig {
            share_prompts: share,
            prefill_chunk: chunk,
            memory_budget: Some(1 << 30),
            ..EngineConfig::default()
        };
        let mut eng = SamplingEngine::new(&model, None, config);
        let ids: Vec<SeqId> = (0..5)
            .map(|s| eng.add_sequence(prompt.clone(), free(6), s).unwrap())
            .collect();
        // A different prompt queued behind them is served as before.
        let other = eng.add_sequence(long_prompt(20), greedy(4), 9).unwrap();
        let mut parked_when_shared = None;
        while !eng.is_idle() {
            eng.step(None).unwrap();
            if parked_when_shared.is_none() && ids.iter().all(|&id| eng.cached_len(id) == Some(69))
            {
                parked_when_shared = Some(eng.parked_columns());
            }
        }
        let out: Vec<Vec<u32>> = ids
            .iter()
            .chain([&other])
            .map(|&id| generated(eng.sequence(id).unwrap()))
            .collect();
        (out, eng.stats().prefill_tokens, parked_when_shared)
    };
    let (alone, prefilled_alone, parked) = run(false, 0);
    assert_eq!(prefilled_alone, 5 * 70 + 20);
    assert_eq!(parked, None);
    for chunk in [0, 16] {
        let (shared, prefilled, parked) = run(true, chunk);
        assert_eq!(prefilled, 69 + 5 + 20, "chunk {chunk}: the prompt once");
        assert_eq!(shared, alone, "chunk {chunk}: sharing changes no token");
        assert_eq!(
            parked,
            Some(69),
            "chunk {chunk}: five waiting sequences hold one 69-column prefix"
        );
    }
}

/// `shared_prefix_attention` (issue 51): the samples of two prompts that join a batch (beside a
/// sequence already running, and leaving it at different steps) keep each prompt's keys and
/// values once instead of a copy per row, a sample arriving later joins its group, and all see
/// at every step, in both turns, the logits the copied layout gives, with the same tokens.
/// Three architectures.
#[test]
fn a_shared_prompt_is_held_once_and_attended_like_a_copy_per_row() {
    for cfg in tiny_configs() {
        let (_vm, model) = detached(&cfg, DType::F32, 5);
        let prompt = long_prompt(70);
        let run = |cascade: bool| {
            let config = EngineConfig {
                share_prompts: true,
                shared_prefix_attention: cascade,
                prefill_chunk: 32,
                ..EngineConfig::default()
            };
            let mut eng = SamplingEngine::new(&model, None, config);
            let other = eng.add_sequence(long_prompt(20), greedy(30), 9).unwrap();
            eng.step(None).unwrap();
            let ids: Vec<SeqId> = (0..4)
                .map(|s| {
                    eng.add_sequence(prompt.clone(), greedy(3 + 2 * s as usize), s)
                        .unwrap()
                })
                .collect();
            let prompt2: Vec<u32> = (0..45u32).map(|i| (i * 11 + 5) % 90 + 2).collect();
            let ids2: Vec<SeqId> = (0..3)
                .map(|s| {
                    eng.add_sequence(prompt2.clone(), greedy(5), 20 + s)
                        .unwrap()
                })
                .collect();
            let mut rec = Recorder::default();
            let (mut held, mut groups, mut widest, mut steps) = (0, 0, 0, 0);
            let mut late = None;
            let mut drive = |eng: &mut SamplingEngine<'_>, rec: &mut Recorder| -> usize {
                while !eng.is_idle() {
                    eng.step(Some(rec)).unwrap();
                    steps += 1;
                    // A sample of the prompt that arrives while the others decode joins them.
                    if steps == 6 {
                        late = Some(eng.add_sequence(prompt.clone(), greedy(4), 7).unwrap());
                    }
                    held += usize::from(!eng.batch.shared.is_empty());
                    groups = groups.max(eng.batch.shared.len());
                    for s in &eng.batch.shared {
                        assert_eq!(s.rows.len(), eng.batch.rows.len());
                    }
                    widest = widest.max(eng.batch_width());
                }
                widest
            };
            let first_turn_widest = drive(&mut eng, &mut rec);
            let prefilled = eng.stats().prefill_tokens;
            // A second turn: each sample continues from its whole cache (shared and own).
            for (k, &id) in ids.iter().enumerate() {
                eng.append_tokens(id, &long_prompt(5 + k)).unwrap();
                eng.resume(id).unwrap();
            }
            drive(&mut eng, &mut rec);
            let tokens: Vec<Vec<u32>> = ids
                .iter()
                .chain(&ids2)
                .chain([&other, &late.expect("added")])
                .map(|&id| generated(eng.sequence(id).unwrap()))
                .collect();
            (rec, tokens, (held, groups), first_turn_widest, prefilled)
        };
        let (plain, plain_tokens, (plain_held, _), plain_widest, plain_prefilled) = run(false);
        let (cascade, cascade_tokens, (held, groups), widest, prefilled) = run(true);
        assert_eq!(
            groups, 2,
            "{:?}: both prompts held at once",
            cfg.architecture
        );
        assert_eq!(
            prefilled,
            plain_prefilled - 69,
            "{:?}: the late sample prefilled only its last token",
            cfg.architecture
        );
        // (`widest`: the batch's columns in the first turn.)
        assert_eq!(plain_held, 0);
        assert!(
            held > 0,
            "{:?}: the batch held the shared prompt",
            cfg.architecture
        );
        assert!(
            plain_widest >= 70 && widest < plain_widest,
            "{:?}: the batch's own columns were {widest}, copied {plain_widest}",
            cfg.architecture
        );
        assert_eq!(cascade_tokens, plain_tokens, "{:?}", cfg.architecture);
        let mut worst = 0f32;
        for (id, steps) in &plain.seen {
            let other = &cascade.seen[id];
            assert_eq!(steps.len(), other.len());
            for (a, b) in steps.iter().zip(other) {
                worst = worst.max(max_diff(a, b));
            }
        }
        assert!(
            worst < 1e-5,
            "{:?}: logits differ by {worst}",
            cfg.architecture
        );
    }
}

/// `single_turn` (issue 51): samples of a shared prompt that end with their turn keep no copy
/// of their keys and values, yet the prefix cache gets every block (the shared prompt's and
/// the answers'), and a resumed one starts from the prefix cache again and continues as a kept
/// one.
#[test]
fn a_single_turn_sequence_keeps_no_cache_but_feeds_the_prefix_cache() {
    let cfg = ModelConfig::tiny_qwen2(96);
    let (_vm, model) = detached(&cfg, DType::F32, 3);
    let run = |single: bool| {
        let config = EngineConfig {
            share_prompts: true,
            shared_prefix_attention: true,
            prefix_cache: Some(PrefixCacheConfig::with_max_bytes(1 << 30)),
            ..EngineConfig::default()
        };
        let mut eng = SamplingEngine::new(&model, None, config);
        let mut p = greedy(6);
        p.single_turn = single;
        let ids: Vec<SeqId> = (0..3)
            .map(|s| eng.add_sequence(long_prompt(40), p.clone(), s).unwrap())
            .collect();
        eng.run_until_stop(None).unwrap();
        let cached: Vec<Option<usize>> = ids.iter().map(|&id| eng.cached_len(id)).collect();
        let blocks = eng.prefix_cache_stats().unwrap().blocks;
        for (k, &id) in ids.iter().enumerate() {
            eng.append_tokens(id, &[7 + k as u32, 8, 9]).unwrap();
            eng.resume(id).unwrap();
        }
        let before = eng.stats().prefill_tokens;
        eng.run_until_stop(None).unwrap();
        let tokens: Vec<Vec<u32>> = ids
            .iter()
            .map(|&id| generated(eng.sequence(id).unwrap()))
            .collect();
        (cached, blocks, tokens, eng.stats().prefill_tokens - before)
    };
    let (kept, kept_blocks, kept_tokens, kept_prefill) = run(false);
    let (single, single_blocks, single_tokens, single_prefill) = run(true);
    assert_eq!(kept, vec![Some(45); 3]);
    assert_eq!(
        single,
        vec![Some(0); 3],
        "no cache kept after a single turn"
    );
    assert_eq!(
        kept_blocks, 2,
        "45 tokens: two whole blocks, one path for all three"
    );
    assert_eq!(
        single_blocks, kept_blocks,
        "the prefix cache got the same blocks"
    );
    assert_eq!(single_tokens, kept_tokens);
    assert_eq!(
        kept_prefill,
        3 * 4,
        "kept: the last token and the 3 appended"
    );
    assert_eq!(
        single_prefill,
        3 * (49 - 32),
        "resumed: all but the prefix cache's two blocks"
    );
}

/// Batch-invariant ([`EngineConfig::batch_invariant`]), a sequence records the same bits
/// (tokens, log-probs, entropies, confidences, top log-probs) however the engine runs it:
/// alone with its prompt prefilled whole; in chunks of 5 tokens; beside rows of other lengths
/// that join and leave (padding on both sides); as the first of 4 samples of its prompt held
/// once under the cascade; with its tokens drafted and verified several at a time; and from
/// the prefix cache after an earlier run of the prompt. With the fastest kernels some of these
/// differ in the last bits, which the test checks too (so it cannot pass for want of any
/// difference to find).
#[test]
fn batch_invariant_sequences_record_the_same_bits_however_the_batch_runs() {
    let unit: Vec<u32> = (0..9).map(|i| (i * 11 + 4) % 90 + 1).collect();
    // Longer than `LINEAR_MAX_ROWS`: prefilled whole, its linear layers run `gemm` unless
    // batch-invariant.
    let prompt: Vec<u32> = unit.iter().cycle().take(130).copied().collect();
    for cfg in tiny_configs() {
        let (_vm, model) = detached(&cfg, DType::F32, 41);
        let run = |invariant: bool, variant: &str| -> Sequence {
            let mut config = EngineConfig {
                batch_invariant: invariant,
                prefill_chunk: 0,
                ..EngineConfig::with_max_batch_size(0)
            };
            match variant {
                "chunks" => config.prefill_chunk = 5,
                "cascade" => {
                    config.share_prompts = true;
                    config.shared_prefix_attention = true;
                }
                "speculative" => {
                    config.speculative = Some(SpeculativeConfig {
                        max_draft: 4,
                        ngram_max: 3,
                        ngram_min: 1,
                    })
                }
                "cache" => config.prefix_cache = Some(PrefixCacheConfig::with_max_bytes(1 << 30)),
                _ => {}
            }
            let mut eng = SamplingEngine::new(&model, None, config);
            if variant == "cache" {
                eng.add_sequence(prompt.clone(), free(3), 5).unwrap();
                eng.run_until_stop(None).unwrap();
            }
            let other = |eng: &mut SamplingEngine<'_>, len: u32, seed: u64| {
                let p: Vec<u32> = (0..len).map(|i| (i * 7 + seed as u32) % 90).collect();
                eng.add_sequence(p, free(3 + len as usize % 7), seed)
                    .unwrap()
            };
            if variant == "company" {
                other(&mut eng, 60, 1);
                other(&mut eng, 3, 2);
                eng.step(None).unwrap();
            }
            let id = eng.add_sequence(prompt.clone(), free(24), 77).unwrap();
            if variant == "cascade" {
                for s in 0..3 {
                    eng.add_sequence(prompt.clone(), free(24), 100 + s).unwrap();
                }
            }
            if variant == "company" {
                eng.step(None).unwrap();
                other(&mut eng, 17, 3);
                other(&mut eng, 71, 4);
            }
            eng.run_until_stop(None).unwrap();
            if variant == "cache" {
                let stats = eng.prefix_cache_stats().unwrap();
                assert!(stats.hit_tokens >= 32, "{stats:?}");
            }
            eng.sequence(id).unwrap().clone()
        };
        let bits = |s: &Sequence| {
            let f = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let top: Vec<(u32, u32)> = s
                .top_logprobs
                .iter()
                .flatten()
                .map(|&(t, l)| (t, l.to_bits()))
                .collect();
            (
                s.tokens.clone(),
                f(&s.logprobs),
                f(&s.entropies),
                f(&s.confidences),
                top,
            )
        };
        let variants = ["chunks", "company", "cascade", "speculative", "cache"];
        let base = bits(&run(true, "alone"));
        for v in variants {
            assert!(
                bits(&run(true, v)) == base,
                "{:?}: batch-invariant, the sequence run {v} recorded other bits than alone",
                cfg.architecture
            );
        }
        let fast = bits(&run(false, "alone"));
        let differs = variants
            .iter()
            .filter(|v| bits(&run(false, v)) != fast)
            .count();
        assert!(
            differs > 0,
            "{:?}: with the fastest kernels every variant gave the same bits",
            cfg.architecture
        );
    }
}
