//! The tokenizer of a GGUF file, from its `tokenizer.ggml.*` metadata, as a Hugging Face
//! `tokenizers` tokenizer.
//!
//! Only byte-level BPE vocabularies (`tokenizer.ggml.model = gpt2`: GPT-2, SmolLM2, Llama 3,
//! Qwen) are supported. The tokenizer is built as `transformers` builds it from a GGUF
//! (`GPT2Tokenizer` over `tokenizer.ggml.tokens` and `tokenizer.ggml.merges`; tokens typed
//! control (3) become special added tokens, user-defined ones (4) plain added tokens), and the
//! text is split as llama.cpp splits it for the file's `tokenizer.ggml.pre`:
//! - `gpt2`, `default` or none: GPT-2's byte-level regex;
//! - `smollm`, `starcoder`, `refact`, `codeshell`: every digit alone, then GPT-2's regex (as
//!   llama.cpp and SmolLM2's own `tokenizer.json` do; transformers 5 ignores this one and keeps
//!   digit runs together);
//! - `llama-bpe`, `llama3`, `llama-v3`, `falcon3`, `smaug-bpe`, `dbrx`: Llama 3's regex;
//! - `qwen2`, `deepseek-r1-qwen`: Qwen2's regex.
//!
//! Other pre-tokenizers are refused, naming the value.

use serde_json::{Value as Json, json};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

use super::{GgufCheckpoint, GgufError};
use crate::checkpoint::hf::HfMetadata;
use crate::error::Result;
use crate::tokenizer::{QWEN2_SPLIT, TextTokenizer};
use candle_core::quantized::gguf_file::Value;

/// Llama 3's pre-tokenizer regex (transformers' `_LLAMA3_SPLIT`).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// llama.cpp's token type of control tokens (`<|im_end|>`, ...).
const CONTROL: i64 = 3;
/// llama.cpp's token type of user-defined added tokens (`<think>`, ...).
const USER_DEFINED: i64 = 4;

fn tok_err(ck: &GgufCheckpoint, reason: impl Into<String>) -> GgufError {
    GgufError::Tokenizer {
        path: ck.path.clone(),
        reason: reason.into(),
    }
}

/// A metadata array of strings.
fn strings<'a>(ck: &'a GgufCheckpoint, key: &str) -> std::result::Result<Vec<&'a str>, GgufError> {
    match ck.metadata(key) {
        None => Err(ck.missing_key(key)),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.as_str()),
                other => Err(ck.invalid_key(key, format!("expected strings, found {other:?}"))),
            })
            .collect(),
        Some(other) => Err(ck.invalid_key(key, format!("expected an array, found {other:?}"))),
    }
}

/// A metadata array of integers (the token types).
fn ints(ck: &GgufCheckpoint, key: &str) -> std::result::Result<Option<Vec<i64>>, GgufError> {
    match ck.metadata(key) {
        None => Ok(None),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| match *v {
                Value::I32(x) => Ok(i64::from(x)),
                Value::U32(x) => Ok(i64::from(x)),
                Value::I8(x) => Ok(i64::from(x)),
                Value::U8(x) => Ok(i64::from(x)),
                Value::I16(x) => Ok(i64::from(x)),
                Value::U16(x) => Ok(i64::from(x)),
                Value::I64(x) => Ok(x),
                ref other => {
                    Err(ck.invalid_key(key, format!("expected integers, found {other:?}")))
                }
            })
            .collect::<std::result::Result<Vec<_>, _>>()
            .map(Some),
        Some(other) => Err(ck.invalid_key(key, format!("expected an array, found {other:?}"))),
    }
}

/// GPT-2's byte → printable character table (`bytes_to_unicode`).
fn byte_alphabet() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[b as usize] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(256 + n).expect("valid code point");
            n += 1;
            c
        };
    }
    table
}

/// The pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre = pre`.
fn pre_tokenizer(
    ck: &GgufCheckpoint,
    pre: Option<&str>,
) -> std::result::Result<PreTokenizerWrapper, GgufError> {
    let byte_level = |use_regex: bool| ByteLevel::new(false, true, use_regex);
    let split = |regex: &str| -> std::result::Result<PreTokenizerWrapper, GgufError> {
        let s = Split::new(
            SplitPattern::Regex(regex.into()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| tok_err(ck, format!("pre-tokenizer regex: {e}")))?;
        Ok(Sequence::new(vec![s.into(), byte_level(false).into()]).into())
    };
    match pre {
        None | Some("gpt2" | "default") => Ok(byte_level(true).into()),
        Some("smollm" | "starcoder" | "refact" | "codeshell") => {
            Ok(Sequence::new(vec![Digits::new(true).into(), byte_level(true).into()]).into())
        }
        Some("llama-bpe" | "llama3" | "llama-v3" | "falcon3" | "smaug-bpe" | "dbrx") => {
            split(LLAMA3_SPLIT)
        }
        Some("qwen2" | "deepseek-r1-qwen") => split(QWEN2_SPLIT),
        Some(other) => Err(ck.invalid_key(
            "tokenizer.ggml.pre",
            format!(
                "pre-tokenizer `{other}` is not supported (gpt2, default, smollm, starcoder, \
                 refact, codeshell, llama-bpe, llama3, llama-v3, falcon3, smaug-bpe, dbrx, qwen2, \
                 deepseek-r1-qwen)"
            ),
        )),
    }
}

/// The id of a special token named by `tokenizer.ggml.{key}`, if given and in range.
fn special_id(
    ck: &GgufCheckpoint,
    key: &str,
    n_tokens: usize,
) -> std::result::Result<Option<u32>, GgufError> {
    let full = format!("tokenizer.ggml.{key}");
    match ck.opt_uint(&full)? {
        None => Ok(None),
        Some(id) if (id as usize) < n_tokens => Ok(Some(id as u32)),
        Some(id) => Err(ck.invalid_key(&full, format!("id {id} is beyond the {n_tokens} tokens"))),
    }
}

/// Whether `tokenizer.ggml.{key}` (a boolean) is set.
fn flag(ck: &GgufCheckpoint, key: &str) -> std::result::Result<bool, GgufError> {
    let full = format!("tokenizer.ggml.{key}");
    match ck.metadata(&full) {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(ck.invalid_key(&full, format!("expected a boolean, found {other:?}"))),
    }
}

/// Builds the tokenizer of `ck` (see the module documentation). A post-processor adds the BOS
/// (EOS) token when `tokenizer.ggml.add_bos_token` (`add_eos_token`) is set, for callers that
/// encode with special tokens; [`TextTokenizer::encode`] adds none.
pub fn build(ck: &GgufCheckpoint) -> Result<TextTokenizer> {
    let model_key = "tokenizer.ggml.model";
    match ck.opt_str(model_key)? {
        Some("gpt2") => {}
        Some(other) => {
            return Err(ck
                .invalid_key(
                    model_key,
                    format!(
                        "tokenizer model `{other}` is not supported (only gpt2, byte-level BPE)"
                    ),
                )
                .into());
        }
        None => return Err(ck.missing_key(model_key).into()),
    }
    let tokens = strings(ck, "tokenizer.ggml.tokens")?;
    let merges = strings(ck, "tokenizer.ggml.merges")?;
    let types = ints(ck, "tokenizer.ggml.token_type")?;
    if let Some(t) = &types
        && t.len() != tokens.len()
    {
        return Err(ck
            .invalid_key(
                "tokenizer.ggml.token_type",
                format!("{} types for {} tokens", t.len(), tokens.len()),
            )
            .into());
    }
    let alphabet = byte_alphabet();
    let in_alphabet = |t: &str| t.chars().all(|c| alphabet.contains(&c));
    // Tokens are spelled in GPT-2's byte alphabet; one that is not (a mislabelled added token)
    // is respelled from its UTF-8 bytes, as transformers does.
    let vocab: serde_json::Map<String, Json> = tokens
        .iter()
        .enumerate()
        .map(|(id, t)| {
            let spelled = if in_alphabet(t) {
                (*t).to_string()
            } else {
                t.bytes().map(|b| alphabet[b as usize]).collect()
            };
            (spelled, json!(id))
        })
        .collect();
    let merge_pairs: Vec<Json> = merges
        .iter()
        .enumerate()
        .map(|(i, m)| {
            m.split_once(' ')
                .map(|(a, b)| json!([a, b]))
                .ok_or_else(|| {
                    ck.invalid_key(
                        "tokenizer.ggml.merges",
                        format!("merge {i} `{m}` has no space"),
                    )
                })
        })
        .collect::<std::result::Result<_, _>>()?;
    // The model deserializes from text only (it borrows its `type` tag).
    let bpe_json = json!({
        "type": "BPE",
        "dropout": null,
        "unk_token": null,
        "continuing_subword_prefix": "",
        "end_of_word_suffix": "",
        "fuse_unk": false,
        "byte_fallback": false,
        "ignore_merges": false,
        "vocab": vocab,
        "merges": merge_pairs,
    });
    let bpe: BPE = serde_json::from_str(&bpe_json.to_string())
        .map_err(|e| tok_err(ck, format!("cannot build the BPE model: {e}")))?;
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(pre_tokenizer(ck, ck.opt_str("tokenizer.ggml.pre")?)?));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    if let Some(types) = &types {
        let special: Vec<AddedToken> = tokens
            .iter()
            .zip(types)
            .filter(|&(t, &ty)| ty == CONTROL && in_alphabet(t))
            .map(|(t, _)| AddedToken::from(*t, true).normalized(false))
            .collect();
        tokenizer
            .add_special_tokens(special)
            .map_err(|e| tok_err(ck, format!("control tokens: {e}")))?;
        let user: Vec<AddedToken> = tokens
            .iter()
            .zip(types)
            .filter(|&(t, &ty)| ty == USER_DEFINED && in_alphabet(t))
            .map(|(t, _)| AddedToken::from(*t, false).normalized(false))
            .collect();
        tokenizer
            .add_tokens(user)
            .map_err(|e| tok_err(ck, format!("user-defined tokens: {e}")))?;
    }
    let n = tokens.len();
    let bos = special_id(ck, "bos_token_id", n)?;
    let eos = special_id(ck, "eos_token_id", n)?;
    let add_bos = flag(ck, "add_bos_token")? && bos.is_some();
    let add_eos = flag(ck, "add_eos_token")? && eos.is_some();
    if add_bos || add_eos {
        let mut single = Vec::new();
        let mut specials = Vec::new();
        for (on, id) in [(add_bos, bos), (add_eos, eos)] {
            if let (true, Some(id)) = (on, id) {
                specials.push((tokens[id as usize].to_string(), id));
            }
        }
        if add_bos {
            single.push(specials[0].0.clone());
        }
        single.push("$A".to_string());
        if add_eos {
            single.push(specials[specials.len() - 1].0.clone());
        }
        let processor = TemplateProcessing::builder()
            .try_single(single.join(" "))
            .map_err(|e| tok_err(ck, format!("post-processor: {e}")))?
            .special_tokens(specials)
            .build()
            .map_err(|e| tok_err(ck, format!("post-processor: {e}")))?;
        tokenizer.with_post_processor(Some(processor));
    }
    Ok(TextTokenizer::from_inner(tokenizer))
}

/// The `tokenizer_config.json` (and `config.json` token ids) of `ck`; see
/// [`GgufCheckpoint::hf_metadata`].
pub fn hf_metadata(ck: &GgufCheckpoint) -> Result<HfMetadata> {
    let tokens = strings(ck, "tokenizer.ggml.tokens")?;
    let n = tokens.len();
    let mut tc = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": false,
        "add_bos_token": flag(ck, "add_bos_token")?,
        "add_eos_token": flag(ck, "add_eos_token")?,
    });
    let mut config = serde_json::Map::new();
    for (name, key) in [
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("unk", "unknown_token_id"),
        ("pad", "padding_token_id"),
    ] {
        let id = special_id(ck, key, n)?;
        tc[format!("{name}_token")] = id.map_or(Json::Null, |id| json!(tokens[id as usize]));
        if name != "unk"
            && let Some(id) = id
        {
            config.insert(format!("{name}_token_id"), json!(id));
        }
    }
    if let Some(ctx) = ck.opt_uint(&format!("{}.context_length", ck.architecture_name))? {
        tc["model_max_length"] = json!(ctx);
    }
    if let Some(template) = ck.opt_str("tokenizer.chat_template")? {
        tc["chat_template"] = json!(template);
    }
    let meta = HfMetadata {
        config: Some(Json::Object(config)),
        tokenizer_config: Some(tc),
        generation_config: None,
        files: Default::default(),
    };
    // The template must compile now, not at the first prompt.
    meta.chat_template()
        .map_err(|e| tok_err(ck, format!("tokenizer.chat_template: {e}")))?;
    Ok(meta)
}
