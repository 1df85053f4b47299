//! Tokenizers: load a Hugging Face `tokenizer.json`, or train one on a corpus — byte-level BPE
//! with a target vocabulary size, or word-level (one token per word or punctuation mark, so a
//! name word is one token) — always with the chat and tag special tokens as single tokens.

use std::path::Path;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::wordpiece::WordPiece as WordPieceDecoder;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::models::wordlevel::{WordLevel, WordLevelTrainer};
use tokenizers::models::{ModelWrapper, TrainerWrapper};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::punctuation::Punctuation;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::whitespace::WhitespaceSplit;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use crate::error::{ModelError, Result};

pub mod chat;

pub use chat::{ChatMessage, ChatTemplate, check_incremental};

/// End-of-text token.
pub const END_OF_TEXT: &str = "<|endoftext|>";
/// Start of a chat message.
pub const IM_START: &str = "<|im_start|>";
/// End of a chat message.
pub const IM_END: &str = "<|im_end|>";
/// Unknown word (word-level tokenizers only).
pub const UNK: &str = "<unk>";

/// Qwen2's pre-tokenizer regex (transformers' `Qwen2Tokenizer`, Qwen2's `tokenizer.json`).
pub const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The special tokens every trained tokenizer gets, in id order from 0: the chat markers, then
/// the agent tags.
pub const DEFAULT_SPECIAL_TOKENS: &[&str] = &[
    END_OF_TEXT,
    IM_START,
    IM_END,
    "<think>",
    "</think>",
    "<search>",
    "</search>",
    "<information>",
    "</information>",
    "<answer>",
    "</answer>",
    "<result>",
    "</result>",
];

fn tok_err(what: &str, e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(format!("{what}: {e}"))
}

/// A text tokenizer (wraps a Hugging Face `tokenizers::Tokenizer`).
#[derive(Debug, Clone)]
pub struct TextTokenizer {
    inner: Tokenizer,
}

impl TextTokenizer {
    /// Wraps an existing `tokenizers::Tokenizer`.
    pub fn from_inner(inner: Tokenizer) -> Self {
        Self { inner }
    }

    /// The wrapped `tokenizers::Tokenizer`.
    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }

    /// Loads a `tokenizer.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        if !path.exists() {
            return Err(ModelError::io(
                path,
                std::io::Error::new(std::io::ErrorKind::NotFound, "file not found"),
            ));
        }
        let inner = Tokenizer::from_file(path)
            .map_err(|e| tok_err(&format!("cannot load {}", path.display()), e))?;
        Ok(Self { inner })
    }

    /// Writes `tokenizer.json` (pretty-printed).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        self.inner
            .save(path, true)
            .map_err(|e| tok_err(&format!("cannot save {}", path.display()), e))
    }

    /// Checks, without training anything, that a byte-level BPE vocabulary of `vocab_size`
    /// entries holds the byte symbols and `n_special` special tokens, as
    /// [`Self::train_byte_level_bpe`] requires.
    pub fn check_byte_level_bpe_vocab(vocab_size: usize, n_special: usize) -> Result<()> {
        let n_bytes = ByteLevel::alphabet().len();
        if vocab_size < n_bytes + n_special {
            return Err(ModelError::invalid_input(
                "vocab_size",
                format!(
                    "{vocab_size} is below the {n_bytes} byte symbols plus {n_special} special tokens"
                ),
            ));
        }
        Ok(())
    }

    /// Trains a byte-level BPE tokenizer (GPT-2 / Qwen style: every byte is in the base
    /// alphabet, so nothing is unknown; decoding is exact) with `vocab_size` entries in total,
    /// special tokens included (ids `0..special_tokens.len()`).
    pub fn train_byte_level_bpe<S: AsRef<str> + Sync>(
        corpus: &[S],
        vocab_size: usize,
        special_tokens: &[&str],
    ) -> Result<Self> {
        Self::check_byte_level_bpe_vocab(vocab_size, special_tokens.len())?;
        let alphabet = ByteLevel::alphabet();
        let mut tokenizer = Tokenizer::new(BPE::default());
        tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
        tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
        let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
            .vocab_size(vocab_size)
            .min_frequency(0)
            .show_progress(false)
            .special_tokens(specials(special_tokens))
            .initial_alphabet(alphabet.into_iter().collect())
            .build()
            .into();
        tokenizer
            .train(&mut trainer, corpus.iter().map(|s| s.as_ref()))
            .map_err(|e| tok_err("BPE training failed", e))?;
        Ok(Self { inner: tokenizer })
    }

    /// Trains a word-level tokenizer: text is split on whitespace and every punctuation mark is
    /// its own token, so each word (e.g. each part of a name) is one token. The vocabulary holds
    /// the special tokens, [`UNK`] and the most frequent words, at most `max_vocab_size` entries.
    /// Decoding joins tokens with spaces and removes the space before `. , ! ?`.
    pub fn train_word_level<S: AsRef<str> + Sync>(
        corpus: &[S],
        max_vocab_size: usize,
        special_tokens: &[&str],
    ) -> Result<Self> {
        let mut all_specials = specials(special_tokens);
        all_specials.push(AddedToken::from(UNK, true));
        let model = WordLevel::builder()
            .unk_token(UNK.to_string())
            .build()
            .map_err(|e| tok_err("word-level model", e))?;
        let mut tokenizer = Tokenizer::new(model);
        tokenizer.with_pre_tokenizer(Some(Sequence::new(vec![
            WhitespaceSplit.into(),
            Punctuation::new(SplitDelimiterBehavior::Isolated).into(),
        ])));
        tokenizer.with_decoder(Some(WordPieceDecoder::new("##".to_string(), true)));
        let mut trainer: TrainerWrapper = WordLevelTrainer::builder()
            .vocab_size(max_vocab_size)
            .min_frequency(0)
            .show_progress(false)
            .special_tokens(all_specials)
            .build()
            .map_err(|e| tok_err("word-level trainer", e))?
            .into();
        tokenizer
            .train(&mut trainer, corpus.iter().map(|s| s.as_ref()))
            .map_err(|e| tok_err("word-level training failed", e))?;
        Ok(Self { inner: tokenizer })
    }

    /// Token ids of `text`; special tokens written in the text map to their single ids.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| tok_err("encode failed", e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`; special tokens are dropped when `skip_special_tokens`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| tok_err("decode failed", e))
    }

    /// The text each of `ids` adds to the decoded text, in order (special tokens kept): the
    /// pieces concatenate to `decode(ids, false)`, except for a multi-byte character left
    /// incomplete at the end. Decoded as a stream (`tokenizers`' `DecodeStream`), so a word-level
    /// token carries the space before it, and a token that completes a character split over
    /// several byte-level tokens carries the whole character while the tokens before it get
    /// empty pieces. Where the stream cannot continue (a decoder whose output is not
    /// prefix-stable), the token is decoded alone and the stream restarts after it.
    pub fn decode_pieces(&self, ids: &[u32]) -> Result<Vec<String>> {
        let mut out = Vec::with_capacity(ids.len());
        let mut stream = self.inner.decode_stream(false);
        for &id in ids {
            match stream.step(id) {
                Ok(piece) => out.push(piece.unwrap_or_default()),
                Err(_) => {
                    out.push(self.decode(&[id], false)?);
                    stream = self.inner.decode_stream(false);
                }
            }
        }
        Ok(out)
    }

    /// The id of a token (special or not).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of an id.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Number of ids, added tokens included (the model's `vocab_size` must be at least this).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Whether this is Qwen2's tokenizer: a byte-level BPE with Qwen2's NFC normalizer,
    /// pre-tokenizer (its regex, then byte-level without a regex) and byte-level decoder, and no
    /// post-processor that adds tokens. transformers ≥ 5 loads the tokenizer of every
    /// `model_type = "qwen2"` folder as `Qwen2Tokenizer`, which keeps only the vocabulary, the
    /// merges and the added tokens of `tokenizer.json` and rebuilds the rest as Qwen2's: it
    /// tokenizes as this tokenizer does only when this is true.
    pub fn is_qwen2_byte_level_bpe(&self) -> bool {
        use serde_json::Value;
        let model_ok = match self.inner.get_model() {
            ModelWrapper::BPE(bpe) => {
                bpe.dropout.is_none()
                    && bpe.unk_token.is_none()
                    && bpe
                        .continuing_subword_prefix
                        .as_deref()
                        .unwrap_or("")
                        .is_empty()
                    && bpe.end_of_word_suffix.as_deref().unwrap_or("").is_empty()
                    && !bpe.fuse_unk
                    && !bpe.byte_fallback
                    && !bpe.ignore_merges
            }
            _ => false,
        };
        // The other parts as `tokenizer.json` spells them (`null` when absent).
        let json = |part: Option<serde_json::Result<Value>>| match part {
            Some(Ok(v)) => v,
            _ => Value::Null,
        };
        let normalizer = json(self.inner.get_normalizer().map(serde_json::to_value));
        let pre = json(self.inner.get_pre_tokenizer().map(serde_json::to_value));
        let post = json(self.inner.get_post_processor().map(serde_json::to_value));
        let decoder = json(self.inner.get_decoder().map(serde_json::to_value));
        let str_is = |v: &Value, key: &str, want: &str| v[key].as_str() == Some(want);
        let is_false = |v: &Value, key: &str| v[key].as_bool() == Some(false);
        let pre_ok = str_is(&pre, "type", "Sequence")
            && match pre["pretokenizers"].as_array().map(Vec::as_slice) {
                Some([split, byte_level]) => {
                    str_is(split, "type", "Split")
                        && str_is(&split["pattern"], "Regex", QWEN2_SPLIT)
                        && str_is(split, "behavior", "Isolated")
                        && is_false(split, "invert")
                        && str_is(byte_level, "type", "ByteLevel")
                        && is_false(byte_level, "add_prefix_space")
                        && is_false(byte_level, "use_regex")
                }
                _ => false,
            };
        model_ok
            && pre_ok
            && str_is(&normalizer, "type", "NFC")
            && str_is(&decoder, "type", "ByteLevel")
            && (post.is_null() || str_is(&post, "type", "ByteLevel"))
    }

    /// The id of a special token, or an error naming it.
    pub fn special_id(&self, token: &str) -> Result<u32> {
        self.token_to_id(token).ok_or_else(|| {
            ModelError::Tokenizer(format!("special token `{token}` is not in the vocabulary"))
        })
    }
}

fn specials(tokens: &[&str]) -> Vec<AddedToken> {
    tokens.iter().map(|t| AddedToken::from(*t, true)).collect()
}

/// `bpe` (a trained byte-level BPE) with Qwen2's normalizer, pre-tokenizer, post-processor and
/// decoder, laid out as Qwen2's own `tokenizer.json` is: the tokenizer of a real Qwen2 checkpoint,
/// in small.
#[cfg(test)]
pub(crate) fn qwen2_style(bpe: &TextTokenizer) -> TextTokenizer {
    use std::str::FromStr;
    let byte_level = serde_json::json!({
        "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false
    });
    let mut v = serde_json::to_value(bpe.inner()).unwrap();
    v["normalizer"] = serde_json::json!({"type": "NFC"});
    v["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated",
         "invert": false},
        byte_level,
    ]});
    v["post_processor"] = byte_level.clone();
    v["decoder"] = byte_level;
    TextTokenizer::from_inner(Tokenizer::from_str(&v.to_string()).unwrap())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_qwen2_style_tokenizers_count_as_qwen2s() {
        let bpe =
            TextTokenizer::train_byte_level_bpe(&corpus(), 320, DEFAULT_SPECIAL_TOKENS).unwrap();
        let word = TextTokenizer::train_word_level(&corpus(), 200, DEFAULT_SPECIAL_TOKENS).unwrap();
        let qwen = qwen2_style(&bpe);
        assert!(qwen.is_qwen2_byte_level_bpe());
        assert!(!bpe.is_qwen2_byte_level_bpe(), "GPT-2's regex");
        assert!(!word.is_qwen2_byte_level_bpe());
        // Each part that Qwen2Tokenizer rebuilds matters.
        let base = serde_json::to_value(qwen.inner()).unwrap();
        for (path, value) in [
            ("/normalizer", serde_json::Value::Null),
            (
                "/pre_tokenizer/pretokenizers/0/pattern/Regex",
                "\\s+".into(),
            ),
            ("/pre_tokenizer/pretokenizers/1/use_regex", true.into()),
            (
                "/post_processor",
                serde_json::json!({"type": "TemplateProcessing",
                "single": [{"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}], "special_tokens": {}}),
            ),
            ("/model/byte_fallback", true.into()),
        ] {
            let mut v = base.clone();
            *v.pointer_mut(path).unwrap() = value;
            let t = TextTokenizer::from_inner(std::str::FromStr::from_str(&v.to_string()).unwrap());
            assert!(!t.is_qwen2_byte_level_bpe(), "{path}");
        }
        // Qwen2's normalizer composes characters.
        assert_ne!(
            qwen.encode("cafe\u{301}").unwrap(),
            bpe.encode("cafe\u{301}").unwrap()
        );
    }

    fn corpus() -> Vec<String> {
        let people = ["Zorvak Telim", "Quenor Abalu", "Mira Selvan", "Tobin Krael"];
        let cities = ["Quenor", "Velmaris", "Ostrid"];
        let companies = ["Mirabel Corp", "Tessaly Labs", "Orvane Group"];
        let mut out = Vec::new();
        for (i, p) in people.iter().enumerate() {
            let c = cities[i % cities.len()];
            let m = companies[i % companies.len()];
            out.push(format!(
                "{p} is a person. {p} was born in {c}. {p} works for {m}."
            ));
            out.push(format!(
                "<|im_start|>user\nWhere was {p} born?<|im_end|>\n<|im_start|>assistant\n<think>I need to search.</think><search>{p}</search><information>{p} was born in {c}.</information><answer>{c}</answer><|im_end|><|endoftext|>"
            ));
        }
        out
    }

    #[test]
    fn byte_level_bpe_trains_round_trips_and_keeps_specials_whole() {
        let tok =
            TextTokenizer::train_byte_level_bpe(&corpus(), 320, DEFAULT_SPECIAL_TOKENS).unwrap();
        assert!(tok.vocab_size() <= 320 && tok.vocab_size() > 256 + DEFAULT_SPECIAL_TOKENS.len());
        for (i, s) in DEFAULT_SPECIAL_TOKENS.iter().enumerate() {
            assert_eq!(tok.token_to_id(s), Some(i as u32), "{s}");
        }
        let text = "<|im_start|>assistant\n<think>ok</think><search>Zorvak Telim</search> Unseen wörd! 42<|im_end|>";
        let ids = tok.encode(text).unwrap();
        assert_eq!(ids[0], tok.special_id(IM_START).unwrap());
        assert_eq!(*ids.last().unwrap(), tok.special_id(IM_END).unwrap());
        for tag in ["<think>", "</think>", "<search>", "</search>"] {
            assert!(ids.contains(&tok.special_id(tag).unwrap()), "{tag}");
        }
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
        let plain = tok.decode(&ids, true).unwrap();
        assert!(
            !plain.contains("<search>") && plain.contains("Zorvak Telim"),
            "{plain}"
        );
        // Merges were learnt: a frequent name takes fewer tokens than its bytes.
        assert!(tok.encode(" Zorvak").unwrap().len() < " Zorvak".len());

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        tok.save(&path).unwrap();
        let back = TextTokenizer::from_file(&path).unwrap();
        assert_eq!(back.encode(text).unwrap(), ids);
        assert_eq!(back.vocab_size(), tok.vocab_size());
    }

    #[test]
    fn word_level_gives_one_token_per_word() {
        let tok = TextTokenizer::train_word_level(&corpus(), 1000, DEFAULT_SPECIAL_TOKENS).unwrap();
        for (i, s) in DEFAULT_SPECIAL_TOKENS.iter().enumerate() {
            assert_eq!(tok.token_to_id(s), Some(i as u32), "{s}");
        }
        let text = "Zorvak Telim works for Mirabel Corp.";
        let ids = tok.encode(text).unwrap();
        assert_eq!(ids.len(), 7, "{ids:?}");
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
        let tagged = "<search>Zorvak Telim</search><answer>Quenor</answer>";
        let ids = tok.encode(tagged).unwrap();
        assert_eq!(ids.len(), 7, "{ids:?}");
        assert_eq!(ids[0], tok.special_id("<search>").unwrap());
        assert_eq!(ids[3], tok.special_id("</search>").unwrap());
        assert_eq!(ids[4], tok.special_id("<answer>").unwrap());
        assert_eq!(ids[5], tok.token_to_id("Quenor").unwrap());
        let unk = tok.encode("Zorvak Blorptangle").unwrap();
        assert_eq!(unk[1], tok.special_id(UNK).unwrap());
        // Vocabulary cap is respected.
        let small = TextTokenizer::train_word_level(&corpus(), 20, DEFAULT_SPECIAL_TOKENS).unwrap();
        assert!(small.vocab_size() <= 20, "{}", small.vocab_size());

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        tok.save(&path).unwrap();
        let back = TextTokenizer::from_file(&path).unwrap();
        assert_eq!(back.encode(text).unwrap(), tok.encode(text).unwrap());
        assert_eq!(
            back.decode(&tok.encode(text).unwrap(), false).unwrap(),
            text
        );
    }

    /// The pieces of every token concatenate to the decoded text, for both tokenizer kinds: a
    /// character split over byte-level tokens lands whole on the token that completes it, and a
    /// word-level token carries its leading space.
    #[test]
    fn decode_pieces_concatenate_to_the_text() {
        let bpe =
            TextTokenizer::train_byte_level_bpe(&corpus(), 320, DEFAULT_SPECIAL_TOKENS).unwrap();
        let text = "<think>ok</think><search>Zorvak Telim</search> wörd ✓ 42<|im_end|>";
        let ids = bpe.encode(text).unwrap();
        let pieces = bpe.decode_pieces(&ids).unwrap();
        assert_eq!(pieces.len(), ids.len());
        assert_eq!(pieces.concat(), text);
        assert!(pieces.iter().any(|p| p.contains('✓')), "{pieces:?}");
        // "✓" is three bytes, not in the training corpus: three byte tokens, the first two
        // with empty pieces.
        assert!(
            pieces.iter().filter(|p| p.is_empty()).count() >= 2,
            "{pieces:?}"
        );
        assert_eq!(pieces[0], "<think>");

        let words =
            TextTokenizer::train_word_level(&corpus(), 1000, DEFAULT_SPECIAL_TOKENS).unwrap();
        let text = "Zorvak Telim works for Mirabel Corp.";
        let ids = words.encode(text).unwrap();
        let pieces = words.decode_pieces(&ids).unwrap();
        assert_eq!(pieces.concat(), text);
        assert_eq!(pieces[1], " Telim");
        assert!(words.decode_pieces(&[]).unwrap().is_empty());
    }

    #[test]
    fn errors_are_clear() {
        let err = TextTokenizer::train_byte_level_bpe(&corpus(), 100, DEFAULT_SPECIAL_TOKENS)
            .unwrap_err();
        assert!(err.to_string().contains("vocab_size"), "{err}");
        let err = TextTokenizer::from_file("/nonexistent/tokenizer.json").unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/tokenizer.json"),
            "{err}"
        );
        let tok = TextTokenizer::train_word_level(&corpus(), 100, &[]).unwrap();
        let err = tok.special_id("<answer>").unwrap_err();
        assert!(err.to_string().contains("<answer>"), "{err}");
    }
}
