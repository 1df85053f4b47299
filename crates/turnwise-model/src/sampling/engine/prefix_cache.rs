//! A prefix cache shared across requests: the keys and values of token blocks, kept in a radix
//! tree over token ids, so that a prompt that begins like an earlier one (the next turn of a
//! chat that resends its history, the n samples of a GRPO group sent as n requests, questions
//! that share an instruction template) is prefilled from its first uncached block on.
//!
//! - **Block-granular.** A node holds the keys and values of [`PrefixCacheConfig::block_tokens`]
//!   consecutive tokens (each layer's `[1, kv heads, block, head dim]`, storage of its own); a
//!   node's path from the root spells the tokens before it, so a block is found only after
//!   exactly the tokens it was computed after. A lookup walks whole blocks and stops at the
//!   first that differs.
//! - **Counted once.** The tree holds one copy of each block, however many requests reuse it;
//!   [`PrefixCacheStats::bytes`] is what the tree holds, and the engine counts it in its memory
//!   budget beside the sequences' own caches.
//! - **LRU-evicted.** Every lookup and insertion marks the blocks on its path as used; beyond
//!   [`PrefixCacheConfig::max_bytes`] (or when the engine's budget needs the room) the least
//!   recently used leaf goes first, so a block never outlives the blocks after it and a path
//!   is always a prefix of what was inserted. Node ids are never reused, so an evicted block
//!   can never be reached again.
//! - **One weight version.** Keys and values belong to the weights that computed them. An
//!   engine that builds its own cache borrows one model, so the cache cannot outlive the
//!   weights; a server that keeps one cache across engines calls [`PrefixCache::invalidate`] at
//!   every weight reload.

use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use super::{PrefixKv, SeqKv};
use crate::error::{ModelError, Result};

/// Tokens per cached block by default.
pub const DEFAULT_BLOCK_TOKENS: usize = 16;

fn default_block_tokens() -> usize {
    DEFAULT_BLOCK_TOKENS
}

/// Settings of an engine's prefix cache ([`super::EngineConfig::prefix_cache`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrefixCacheConfig {
    /// Tokens per block: prefixes are cached and reused in whole blocks.
    #[serde(default = "default_block_tokens")]
    pub block_tokens: usize,
    /// Most bytes of keys and values the cache keeps; the least recently used blocks are
    /// evicted beyond it.
    pub max_bytes: u64,
}

impl PrefixCacheConfig {
    /// Blocks of [`DEFAULT_BLOCK_TOKENS`] tokens, at most `max_bytes` in all.
    pub fn with_max_bytes(max_bytes: u64) -> Self {
        Self {
            block_tokens: DEFAULT_BLOCK_TOKENS,
            max_bytes,
        }
    }
}

/// What a prefix cache has done, and what it holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefixCacheStats {
    /// Prompts looked up.
    pub lookups: u64,
    /// Lookups that found at least one block.
    pub hits: u64,
    /// Tokens of the prompts looked up.
    pub lookup_tokens: u64,
    /// Of those, tokens served from the cache.
    pub hit_tokens: u64,
    /// Blocks inserted.
    pub inserted_blocks: u64,
    /// Blocks evicted (for room; not counting invalidations).
    pub evicted_blocks: u64,
    /// Times the cache was emptied because the weights changed.
    pub invalidations: u64,
    /// Blocks held now.
    pub blocks: u64,
    /// Bytes of keys and values held now.
    pub bytes: u64,
}

impl PrefixCacheStats {
    /// Share of looked-up prompt tokens served from the cache (0 before any lookup).
    pub fn hit_rate(&self) -> f64 {
        if self.lookup_tokens == 0 {
            0.0
        } else {
            self.hit_tokens as f64 / self.lookup_tokens as f64
        }
    }
}

struct Node {
    /// The block's tokens (its key among its parent's children).
    tokens: Vec<u32>,
    parent: Option<u64>,
    children: HashMap<Vec<u32>, u64>,
    /// Each layer's keys and values of the block, `[1, kv heads, block, head dim]`.
    kv: Vec<SeqKv>,
    last_used: u64,
}

/// The cache: a radix tree of token blocks and their keys and values (see the module doc).
pub struct PrefixCache {
    config: PrefixCacheConfig,
    nodes: HashMap<u64, Node>,
    roots: HashMap<Vec<u32>, u64>,
    next_id: u64,
    tick: u64,
    /// Bytes of one block (all layers' keys and values), known from the first insertion.
    block_bytes: u64,
    stats: PrefixCacheStats,
}

impl std::fmt::Debug for PrefixCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixCache")
            .field("config", &self.config)
            .field("stats", &self.stats)
            .finish()
    }
}

impl PrefixCache {
    /// An empty cache; a block of no tokens is refused.
    pub fn new(config: PrefixCacheConfig) -> Result<Self> {
        if config.block_tokens == 0 {
            return Err(ModelError::invalid_input(
                "prefix_cache.block_tokens",
                "must be at least 1",
            ));
        }
        Ok(Self {
            config,
            nodes: HashMap::new(),
            roots: HashMap::new(),
            next_id: 0,
            tick: 0,
            block_bytes: 0,
            stats: PrefixCacheStats::default(),
        })
    }

    /// The settings.
    pub fn config(&self) -> &PrefixCacheConfig {
        &self.config
    }

    /// Counters and what the cache holds.
    pub fn stats(&self) -> PrefixCacheStats {
        PrefixCacheStats {
            blocks: self.nodes.len() as u64,
            bytes: self.bytes(),
            ..self.stats
        }
    }

    /// Bytes of keys and values held.
    pub fn bytes(&self) -> u64 {
        self.nodes.len() as u64 * self.block_bytes
    }

    /// Empties the cache because the weights changed (a server's weight reload): its keys and
    /// values were computed by the old ones.
    pub fn invalidate(&mut self) {
        self.stats.invalidations += 1;
        self.clear();
    }

    /// Drops every block.
    pub fn clear(&mut self) {
        self.nodes.clear();
        self.roots.clear();
    }

    fn child(&self, parent: Option<u64>, block: &[u32]) -> Option<u64> {
        match parent {
            None => self.roots.get(block).copied(),
            Some(p) => self.nodes[&p].children.get(block).copied(),
        }
    }

    /// The cached keys and values of the longest run of whole blocks that begins `tokens`,
    /// covering at most `limit` tokens; `None` when not even the first block is cached.
    pub fn lookup(&mut self, tokens: &[u32], limit: usize) -> Result<Option<PrefixKv>> {
        let b = self.config.block_tokens;
        self.stats.lookups += 1;
        self.stats.lookup_tokens += tokens.len() as u64;
        self.tick += 1;
        let mut path = Vec::new();
        let mut parent = None;
        for block in tokens[..limit.min(tokens.len())].chunks_exact(b) {
            let Some(id) = self.child(parent, block) else {
                break;
            };
            path.push(id);
            parent = Some(id);
        }
        if path.is_empty() {
            return Ok(None);
        }
        for id in &path {
            self.nodes.get_mut(id).expect("on the path").last_used = self.tick;
        }
        let n = path.len() * b;
        self.stats.hits += 1;
        self.stats.hit_tokens += n as u64;
        let layers = self.nodes[&path[0]].kv.len();
        let mut out = Vec::with_capacity(layers);
        for layer in 0..layers {
            let ks: Vec<&Tensor> = path.iter().map(|id| &self.nodes[id].kv[layer].0).collect();
            let vs: Vec<&Tensor> = path.iter().map(|id| &self.nodes[id].kv[layer].1).collect();
            out.push((Tensor::cat(&ks, 2)?, Tensor::cat(&vs, 2)?));
        }
        Ok(Some(PrefixKv {
            tokens: tokens[..n].to_vec(),
            layers: out,
            share: Arc::new(()),
        }))
    }

    /// Caches the whole blocks of `tokens[..cols]` not cached yet. `gather(start, len)` gives
    /// each layer's keys and values of `tokens[start..start + len]`, `[1, kv heads, len, head
    /// dim]`, in storage of their own (it is called once per missing block). Evicts the least
    /// recently used blocks beyond the cache's size.
    pub fn insert(
        &mut self,
        tokens: &[u32],
        cols: usize,
        mut gather: impl FnMut(usize, usize) -> Result<Vec<SeqKv>>,
    ) -> Result<()> {
        let b = self.config.block_tokens;
        if self.config.max_bytes == 0 {
            return Ok(());
        }
        self.tick += 1;
        let mut parent = None;
        for (i, block) in tokens[..cols.min(tokens.len())].chunks_exact(b).enumerate() {
            let id = match self.child(parent, block) {
                Some(id) => id,
                None => {
                    let kv = gather(i * b, b)?;
                    let bytes: u64 = kv
                        .iter()
                        .map(|(k, v)| {
                            ((k.elem_count() + v.elem_count()) * k.dtype().size_in_bytes()) as u64
                        })
                        .sum();
                    if self.block_bytes == 0 {
                        self.block_bytes = bytes;
                    } else if bytes != self.block_bytes {
                        return Err(ModelError::invalid_input(
                            "prefix cache",
                            format!(
                                "a block of {bytes} bytes beside blocks of {}: keys and values of \
                                 another model shape",
                                self.block_bytes
                            ),
                        ));
                    }
                    let id = self.next_id;
                    self.next_id += 1;
                    self.nodes.insert(
                        id,
                        Node {
                            tokens: block.to_vec(),
                            parent,
                            children: HashMap::new(),
                            kv,
                            last_used: self.tick,
                        },
                    );
                    match parent {
                        None => self.roots.insert(block.to_vec(), id),
                        Some(p) => self
                            .nodes
                            .get_mut(&p)
                            .expect("parent exists")
                            .children
                            .insert(block.to_vec(), id),
                    };
                    self.stats.inserted_blocks += 1;
                    id
                }
            };
            self.nodes.get_mut(&id).expect("just found").last_used = self.tick;
            parent = Some(id);
        }
        let over = self.bytes().saturating_sub(self.config.max_bytes);
        self.evict(over);
        Ok(())
    }

    /// Evicts least recently used leaves until at least `bytes` are freed or the cache is
    /// empty; returns the bytes freed.
    pub fn evict(&mut self, bytes: u64) -> u64 {
        if bytes == 0 || self.nodes.is_empty() {
            return 0;
        }
        // Leaves, least recently used first (ties: the older node).
        let mut leaves: BinaryHeap<std::cmp::Reverse<(u64, u64)>> = self
            .nodes
            .iter()
            .filter(|(_, n)| n.children.is_empty())
            .map(|(&id, n)| std::cmp::Reverse((n.last_used, id)))
            .collect();
        let mut freed = 0;
        while freed < bytes {
            let Some(std::cmp::Reverse((_, id))) = leaves.pop() else {
                break;
            };
            let node = self.nodes.remove(&id).expect("a leaf of the tree");
            match node.parent {
                None => {
                    self.roots.remove(&node.tokens);
                }
                Some(p) => {
                    let parent = self
                        .nodes
                        .get_mut(&p)
                        .expect("parent outlives its children");
                    parent.children.remove(&node.tokens);
                    if parent.children.is_empty() {
                        leaves.push(std::cmp::Reverse((parent.last_used, p)));
                    }
                }
            }
            freed += self.block_bytes;
            self.stats.evicted_blocks += 1;
        }
        freed
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use candle_core::DType;

    use super::super::*;
    use super::PrefixCacheConfig;
    use crate::model::tests::{model_for, tiny_configs};
    use crate::model::{ModelConfig, Transformer};
    use crate::rng::TurnRng;

    fn detached(cfg: &ModelConfig, seed: u64) -> Transformer {
        let (vm, m) = model_for(cfg, DType::F32, seed);
        Transformer::detached_from_varmap(m.config(), &vm).unwrap()
    }

    fn greedy(max_new: usize) -> SequenceParams {
        SequenceParams {
            sampling: SamplingParams {
                temperature: 0.0,
                max_new_tokens: max_new,
                top_logprobs: 3,
                ..Default::default()
            },
            ..Default::default()
        }
    }

    /// Every step's logits of every sequence.
    #[derive(Default)]
    struct Logits(HashMap<SeqId, Vec<Vec<f32>>>);

    impl TokenHook for Logits {
        fn process(&mut self, seq: &Sequence, logits: &mut [f32]) -> Option<u32> {
            self.0.entry(seq.id).or_default().push(logits.to_vec());
            None
        }
    }

    /// The largest difference between two runs' logits (infinite when their steps differ).
    fn worst(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
        if a.len() != b.len() {
            return f32::INFINITY;
        }
        a.iter()
            .zip(b)
            .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
            .fold(0.0, f32::max)
    }

    /// What a cache hit may differ from a cold prefill by with the fastest kernels: float
    /// rounding (the tiles of a prefill of fewer rows round differently), far below what one
    /// stale or shifted block does to the logits (about 1e-1 on these models). Under
    /// [`EngineConfig::batch_invariant`] it may differ by nothing.
    const ROUNDING: f32 = 1e-5;

    /// Checks a cached run's logits against a cold run's: bit for bit when `invariant`, else to
    /// [`ROUNDING`].
    fn same_logits(cached: &[Vec<f32>], cold: &[Vec<f32>], invariant: bool, what: &str) {
        assert_eq!(cached.len(), cold.len(), "{what}: steps");
        let d = worst(cached, cold);
        if invariant {
            for (step, (a, b)) in cached.iter().zip(cold).enumerate() {
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert!(
                    bits(a) == bits(b),
                    "{what}: step {step}'s logits are not a cold prefill's bits (batch-invariant; {d} away)"
                );
            }
        } else {
            assert!(
                d < ROUNDING,
                "{what}: logits {d} away from a cold prefill's"
            );
        }
    }

    fn engine_config(invariant: bool) -> EngineConfig {
        EngineConfig {
            batch_invariant: invariant,
            ..EngineConfig::default()
        }
    }

    /// Runs `prompt` alone to the end of its turn in `engine`; returns its sequence and the
    /// logits it saw.
    fn run(
        engine: &mut SamplingEngine<'_>,
        prompt: &[u32],
        max_new: usize,
    ) -> (Sequence, Vec<Vec<f32>>) {
        let id = engine
            .add_sequence(prompt.to_vec(), greedy(max_new), 7)
            .unwrap();
        let mut seen = Logits::default();
        engine.run_until_stop(Some(&mut seen)).unwrap();
        let seq = engine.remove(id).unwrap();
        (seq, seen.0.remove(&id).unwrap_or_default())
    }

    fn cached(model: &Transformer, max_bytes: u64, invariant: bool) -> SamplingEngine<'_> {
        SamplingEngine::new(
            model,
            None,
            EngineConfig {
                prefix_cache: Some(PrefixCacheConfig {
                    block_tokens: 16,
                    max_bytes,
                }),
                ..engine_config(invariant)
            },
        )
    }

    fn block_bytes(cfg: &ModelConfig) -> u64 {
        (cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4 * 16) as u64
    }

    /// A prompt that shares a prefix with an earlier one, the next turn of a chat (the earlier
    /// prompt, its completion and a new message) and a prompt that shares nothing: each sees
    /// the logits that an engine with nothing cached computes for it, to float rounding, at
    /// every step, and the same tokens; the cache served the shared whole blocks and only them.
    /// Batch-invariant, the logits are the cold prefill's bits.
    #[test]
    fn cache_hits_see_the_logits_of_a_cold_prefill() {
        for (cfg, invariant) in tiny_configs()
            .into_iter()
            .flat_map(|c| [(c.clone(), false), (c, true)])
        {
            let model = detached(&cfg, 11);
            let shared: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 90 + 1).collect();
            let a: Vec<u32> = shared.iter().copied().chain([5, 9, 11, 2]).collect();
            let b: Vec<u32> = shared.iter().copied().chain([60, 61]).collect();
            let foreign: Vec<u32> = (0..37).map(|i| (i * 13 + 5) % 90 + 1).collect();
            let mut engine = cached(&model, 1 << 30, invariant);
            let (sa, la) = run(&mut engine, &a, 6);
            // The next turn: everything so far and a new message.
            let c: Vec<u32> = sa.tokens.iter().copied().chain([30, 31, 32, 33]).collect();
            let (sb, lb) = run(&mut engine, &b, 6);
            let (sc, lc) = run(&mut engine, &c, 6);
            let (sf, lf) = run(&mut engine, &foreign, 6);
            let stats = engine.prefix_cache_stats().unwrap();
            for (prompt, seq, seen) in [
                (&a, &sa, &la),
                (&b, &sb, &lb),
                (&c, &sc, &lc),
                (&foreign, &sf, &lf),
            ] {
                let mut cold = SamplingEngine::new(&model, None, engine_config(invariant));
                let (s0, l0) = run(&mut cold, prompt, 6);
                assert_eq!(seq.tokens, s0.tokens, "{:?}", cfg.architecture);
                let what = format!(
                    "{:?}, a prompt of {} tokens, batch-invariant {invariant}",
                    cfg.architecture,
                    prompt.len()
                );
                same_logits(seen, &l0, invariant, &what);
            }
            // b reuses the 2 whole blocks of the shared 40 tokens; c the 3 whole blocks of a's
            // 49 tokens (prompt and completion but the last); the foreign prompt nothing.
            assert_eq!(stats.lookups, 4);
            assert_eq!(stats.hits, 2, "{stats:?}");
            assert_eq!(stats.hit_tokens, 32 + 48, "{stats:?}");
            assert_eq!(stats.bytes, stats.blocks * block_bytes(&cfg));
        }
    }

    /// A cache of 5 blocks under a stream of prompts from three shared openings and foreign
    /// ones in random order: blocks are evicted, some hits happen, the cache never holds more
    /// than its size, and every prompt sees the cold engine's logits (to rounding; bit for bit
    /// batch-invariant) (no evicted, stale or foreign block is ever served).
    #[test]
    fn eviction_under_a_small_cache_never_serves_a_stale_or_foreign_block() {
        for invariant in [false, true] {
            eviction_run(invariant);
        }
    }

    fn eviction_run(invariant: bool) {
        let cfg = ModelConfig::tiny_qwen2(96);
        let model = detached(&cfg, 5);
        let mut rng = TurnRng::seed_from_u64(3);
        let mut draw = |n: u32| (rng.next_f64() * n as f64) as u32;
        let openings: Vec<Vec<u32>> = (0..3)
            .map(|o| (0..32).map(|i| (i * 5 + o * 17) % 90 + 1).collect())
            .collect();
        let max = 5 * block_bytes(&cfg);
        let mut engine = cached(&model, max, invariant);
        for _ in 0..24 {
            let prompt: Vec<u32> = match draw(4) {
                3 => (0..20 + draw(30)).map(|_| draw(90) + 1).collect(),
                o => {
                    // An opening, cut short at random, then a suffix of its own.
                    let keep = 8 + draw(25) as usize;
                    let extra = 1 + draw(12);
                    openings[o as usize][..keep]
                        .iter()
                        .copied()
                        .chain((0..extra).map(|_| draw(90) + 1))
                        .collect()
                }
            };
            let (seq, seen) = run(&mut engine, &prompt, 3);
            let mut cold = SamplingEngine::new(&model, None, engine_config(invariant));
            let (s0, l0) = run(&mut cold, &prompt, 3);
            assert_eq!(seq.tokens, s0.tokens);
            same_logits(&seen, &l0, invariant, &format!("prompt {prompt:?}"));
            assert!(engine.prefix_cache_stats().unwrap().bytes <= max);
        }
        let stats = engine.prefix_cache_stats().unwrap();
        assert!(stats.evicted_blocks > 0, "{stats:?}");
        assert!(stats.hits > 0, "{stats:?}");
    }

    #[test]
    fn a_block_of_no_tokens_is_refused_naming_the_key() {
        let model = detached(&ModelConfig::tiny_qwen2(96), 1);
        let mut engine = SamplingEngine::new(
            &model,
            None,
            EngineConfig {
                prefix_cache: Some(PrefixCacheConfig {
                    block_tokens: 0,
                    max_bytes: 1 << 20,
                }),
                ..EngineConfig::default()
            },
        );
        let e = engine
            .add_sequence(vec![1, 2, 3], greedy(2), 0)
            .unwrap_err();
        assert!(e.to_string().contains("prefix_cache.block_tokens"), "{e}");
        assert!(
            super::PrefixCache::new(PrefixCacheConfig {
                block_tokens: 0,
                max_bytes: 1
            })
            .is_err()
        );
    }

    /// Under the engine's memory budget the cache gives its blocks back when a sequence needs
    /// the room, instead of holding the batch back.
    #[test]
    fn the_memory_budget_evicts_cached_blocks_for_a_new_sequence() {
        let cfg = ModelConfig::tiny_qwen2(96);
        let model = detached(&cfg, 5);
        let mut engine = SamplingEngine::new(
            &model,
            None,
            EngineConfig {
                prefix_cache: Some(PrefixCacheConfig {
                    block_tokens: 16,
                    max_bytes: 1 << 30,
                }),
                ..EngineConfig::default()
            },
        );
        let prompts: Vec<Vec<u32>> = (0..6)
            .map(|o| (0..64).map(|i| (i * 3 + o * 29) % 90 + 1).collect())
            .collect();
        for p in &prompts {
            run(&mut engine, p, 2);
        }
        let full = engine.prefix_cache_stats().unwrap();
        assert_eq!(full.evicted_blocks, 0);
        // A budget that holds one sequence's cache and activations but not the cache too.
        let need = engine.memory_estimate(70, &greedy(2));
        engine.config.memory_budget = Some(need + full.bytes / 2);
        let a = engine
            .add_sequence((0..70).map(|i| i % 90 + 1).collect(), greedy(2), 1)
            .unwrap();
        let b = engine
            .add_sequence((0..70).map(|i| (i + 1) % 90 + 1).collect(), greedy(2), 2)
            .unwrap();
        engine.run_until_stop(None).unwrap();
        for id in [a, b] {
            assert_eq!(engine.sequence(id).unwrap().num_generated(), 2);
        }
        let after = engine.prefix_cache_stats().unwrap();
        assert!(after.evicted_blocks > 0, "{after:?}");
    }
}
