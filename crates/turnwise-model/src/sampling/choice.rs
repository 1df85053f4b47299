//! Constrained decoding by choice (vLLM's `guided_choice`): the output must be exactly one of a
//! list of strings.
//!
//! A sequence with [`SequenceParams::guided_choice`](super::SequenceParams::guided_choice) set
//! is masked at every step before its token is drawn (before temperature, top-k, top-p or the
//! greedy arg-max see the logits): a token may be drawn only if the text generated so far
//! followed by the token's text is still a prefix of some choice that can be completed with the
//! vocabulary; a stop token of the sequence (its EOS) only when the text generated so far equals
//! a choice. The turn ends ([`StopReason::ChoiceComplete`](super::StopReason::ChoiceComplete))
//! as soon as the text equals a choice that no longer choice extends, or at a stop token.
//!
//! The "text" of a token is the bytes it adds to the decoded output ([`TokenPieces`]): for a
//! byte-level BPE tokenizer (GPT-2 style, every GGUF model and SmolLM2, Qwen, Llama 3) the
//! bytes its vocabulary entry stands for, so the decoded output is exactly the concatenation;
//! for other tokenizers the token decoded alone. Special tokens have no text and are never
//! allowed (except stop tokens, as above).
//!
//! Greedy decoding is greedy token by token among the allowed tokens, as in vLLM: with choices
//! whose first tokens differ it picks the choice whose first token is most likely.

use std::sync::Arc;

use tokenizers::decoders::DecoderWrapper;

use crate::error::{ModelError, Result};
use crate::tokenizer::TextTokenizer;

/// The bytes each token id adds to the decoded text (`None`: a special token, an id the
/// tokenizer does not know, or one that adds nothing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenPieces {
    pieces: Vec<Option<Vec<u8>>>,
}

/// GPT-2's byte-to-character table, inverted: the byte each printable character of a byte-level
/// vocabulary entry stands for.
fn byte_level_inverse() -> std::collections::HashMap<char, u8> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut chars: Vec<u32> = printable.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            printable.push(b);
            chars.push(256 + n);
            n += 1;
        }
    }
    printable
        .into_iter()
        .zip(chars)
        .filter_map(|(b, c)| char::from_u32(c).map(|c| (c, b as u8)))
        .collect()
}

impl TokenPieces {
    /// The pieces of every id below `vocab_size` (the model's vocabulary, which may be larger
    /// than the tokenizer's).
    pub fn from_tokenizer(tokenizer: &TextTokenizer, vocab_size: usize) -> Self {
        let inner = tokenizer.inner();
        let byte_level = matches!(inner.get_decoder(), Some(DecoderWrapper::ByteLevel(_)));
        let inverse = byte_level.then(byte_level_inverse);
        let added = inner.get_added_tokens_decoder();
        let pieces = (0..vocab_size as u32)
            .map(|id| {
                if let Some(a) = added.get(&id) {
                    return (!a.special && !a.content.is_empty())
                        .then(|| a.content.as_bytes().to_vec());
                }
                let token = tokenizer.id_to_token(id)?;
                let mapped = inverse.as_ref().and_then(|inv| {
                    token
                        .chars()
                        .map(|c| inv.get(&c).copied())
                        .collect::<Option<Vec<u8>>>()
                });
                let bytes = match mapped {
                    Some(b) => b,
                    None => tokenizer.decode(&[id], false).ok()?.into_bytes(),
                };
                (!bytes.is_empty()).then_some(bytes)
            })
            .collect();
        Self { pieces }
    }

    /// The bytes token `id` adds, if any.
    pub fn piece(&self, id: u32) -> Option<&[u8]> {
        self.pieces.get(id as usize)?.as_deref()
    }

    /// Number of ids covered.
    pub fn len(&self) -> usize {
        self.pieces.len()
    }

    /// Whether no id is covered.
    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }

    /// The text of `tokens` as the concatenation of their pieces (ids without one add nothing).
    pub fn text_of(&self, tokens: &[u32]) -> Vec<u8> {
        tokens
            .iter()
            .filter_map(|&t| self.piece(t))
            .flatten()
            .copied()
            .collect()
    }
}

/// A compiled choice constraint: the choices and, for each, where a tokenization of it can
/// still be completed.
#[derive(Debug, Clone)]
pub struct ChoiceConstraint {
    choices: Vec<Vec<u8>>,
    /// `completable[c][i]`: bytes `i..` of choice `c` are a concatenation of pieces.
    completable: Vec<Vec<bool>>,
    pieces: Arc<TokenPieces>,
}

impl ChoiceConstraint {
    /// Compiles `choices`. Errors (naming `guided_choice`) when the list is empty, a choice is
    /// empty or repeated, or no sequence of tokens spells a choice.
    pub fn new(choices: &[String], pieces: Arc<TokenPieces>) -> Result<Self> {
        let bad = |m: String| ModelError::invalid_input("guided_choice", m);
        if choices.is_empty() {
            return Err(bad("must list at least one choice".into()));
        }
        for (i, c) in choices.iter().enumerate() {
            if c.is_empty() {
                return Err(bad(format!("choice {i} is empty")));
            }
            if choices[..i].contains(c) {
                return Err(bad(format!("choice {c:?} is listed twice")));
            }
        }
        let bytes: Vec<Vec<u8>> = choices.iter().map(|c| c.as_bytes().to_vec()).collect();
        let completable: Vec<Vec<bool>> = bytes
            .iter()
            .map(|c| {
                // Backwards: position i is completable if some piece matches at i and ends at a
                // completable position.
                let mut ok = vec![false; c.len() + 1];
                ok[c.len()] = true;
                for i in (0..c.len()).rev() {
                    ok[i] = (0..pieces.len() as u32).any(|t| {
                        pieces
                            .piece(t)
                            .is_some_and(|p| c[i..].starts_with(p) && ok[i + p.len()])
                    });
                }
                ok
            })
            .collect();
        if let Some(i) = completable.iter().position(|ok| !ok[0]) {
            return Err(bad(format!(
                "the tokenizer cannot produce choice {:?} (no tokens spell it)",
                choices[i]
            )));
        }
        Ok(Self {
            choices: bytes,
            completable,
            pieces,
        })
    }

    /// The text of generated tokens `tokens`.
    pub fn text_of(&self, tokens: &[u32]) -> Vec<u8> {
        self.pieces.text_of(tokens)
    }

    /// Whether `text` is a complete choice.
    pub fn is_choice(&self, text: &[u8]) -> bool {
        self.choices.iter().any(|c| c == text)
    }

    /// Whether `text` is a prefix of a choice that tokens can complete, the choice itself
    /// excluded when `strict`.
    fn extendable(&self, text: &[u8], strict: bool) -> bool {
        self.choices.iter().zip(&self.completable).any(|(c, ok)| {
            c.starts_with(text) && ok[text.len()] && (!strict || c.len() > text.len())
        })
    }

    /// Whether generation must end after `text`: it equals a choice and no longer choice
    /// extends it.
    pub fn is_complete(&self, text: &[u8]) -> bool {
        self.is_choice(text) && !self.extendable(text, true)
    }

    /// Sets to `-inf` every logit of a token that may not follow `text`: tokens whose piece
    /// does not keep the text a completable prefix of a choice, and `stop_ids` unless `text` is
    /// a choice.
    pub fn mask(&self, text: &[u8], stop_ids: &[u32], logits: &mut [f32]) {
        let done = self.is_choice(text);
        let mut buf = text.to_vec();
        for (t, l) in logits.iter_mut().enumerate() {
            let t = t as u32;
            let allowed = if stop_ids.contains(&t) {
                done
            } else {
                match self.pieces.piece(t) {
                    Some(p) => {
                        buf.truncate(text.len());
                        buf.extend_from_slice(p);
                        self.extendable(&buf, false)
                    }
                    None => false,
                }
            };
            if !allowed {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};

    use super::*;
    use crate::model::weights::init_varmap;
    use crate::model::{ModelConfig, Transformer};
    use crate::sampling::{
        EngineConfig, SamplingEngine, SamplingParams, SeqStatus, SequenceParams, StopReason,
    };
    use crate::tokenizer::{DEFAULT_SPECIAL_TOKENS, IM_END};

    fn setup() -> (TextTokenizer, Transformer) {
        let corpus = ["yes no maybe yes", "the answer is no", "maybe yes maybe no"];
        let tok = TextTokenizer::train_word_level(&corpus, 64, DEFAULT_SPECIAL_TOKENS).unwrap();
        let cfg = ModelConfig::tiny_qwen2(tok.vocab_size().max(32));
        let vm = init_varmap(&cfg, DType::F32, &Device::Cpu, 3).unwrap();
        (tok, Transformer::detached_from_varmap(&cfg, &vm).unwrap())
    }

    fn params(choices: Option<&[&str]>, eos: u32, temperature: f64) -> SequenceParams {
        SequenceParams {
            sampling: SamplingParams {
                temperature,
                max_new_tokens: 6,
                stop_token_ids: vec![eos],
                ..Default::default()
            },
            guided_choice: choices.map(|c| c.iter().map(|s| s.to_string()).collect()),
            ..Default::default()
        }
    }

    #[test]
    fn constrained_and_free_rows_share_a_batch() {
        let (tok, model) = setup();
        let eos = tok.token_to_id(IM_END).unwrap();
        let prompt = tok.encode("the answer is").unwrap();
        let free = params(None, eos, 1.0);
        // "no" is a prefix of "nomaybe": after it, EOS or "maybe" may follow.
        let sets: [&[&str]; 2] = [&["yes", "no", "maybeyes"], &["no", "nomaybe"]];
        let mut engine = SamplingEngine::new(&model, Some(&tok), EngineConfig::default());
        let free_id = engine
            .add_sequence(prompt.clone(), free.clone(), 99)
            .unwrap();
        let mut constrained = Vec::new();
        for (i, set) in sets.iter().enumerate() {
            for seed in 0..12u64 {
                let t = [0.0, 0.7, 1.5][seed as usize % 3];
                let id = engine
                    .add_sequence(prompt.clone(), params(Some(set), eos, t), seed)
                    .unwrap();
                constrained.push((i, id));
            }
        }
        engine.run_until_stop(None).unwrap();
        let pieces = TokenPieces::from_tokenizer(&tok, model.config().vocab_size);
        for (i, id) in constrained {
            let seq = engine.sequence(id).unwrap();
            let mut out = seq.turn_tokens().to_vec();
            match &seq.status {
                SeqStatus::Paused(StopReason::ChoiceComplete) => {}
                SeqStatus::Paused(StopReason::StopToken(t)) if *t == eos => {
                    out.pop();
                }
                other => panic!("{other:?}"),
            }
            let text = String::from_utf8(pieces.text_of(&out)).unwrap();
            assert!(
                sets[i].contains(&text.as_str()),
                "{text:?} not in {:?}",
                sets[i]
            );
            assert_eq!(tok.decode(&out, true).unwrap().replace(' ', ""), text);
        }
        // The free row drew what it draws alone.
        let mut alone = SamplingEngine::new(&model, Some(&tok), EngineConfig::default());
        let a = alone.add_sequence(prompt, free, 99).unwrap();
        alone.run_until_stop(None).unwrap();
        assert_eq!(
            engine.sequence(free_id).unwrap().tokens,
            alone.sequence(a).unwrap().tokens
        );
    }

    #[test]
    fn bad_choices_are_refused_naming_guided_choice() {
        let (tok, model) = setup();
        let mut engine = SamplingEngine::new(&model, Some(&tok), EngineConfig::default());
        for bad in [
            &[][..],
            &["yes", "yes"][..],
            &["yes", ""][..],
            &["zebra"][..],
        ] {
            let e = engine
                .add_sequence(vec![1, 2], params(Some(bad), 0, 1.0), 0)
                .unwrap_err()
                .to_string();
            assert!(e.contains("guided_choice"), "{bad:?}: {e}");
        }
        let mut no_tok = SamplingEngine::new(&model, None, EngineConfig::default());
        let e = no_tok
            .add_sequence(vec![1, 2], params(Some(&["yes"]), 0, 1.0), 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("guided_choice"), "{e}");
    }
}
