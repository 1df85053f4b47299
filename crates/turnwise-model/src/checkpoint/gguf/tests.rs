//! GGUF loading against Hugging Face `transformers` on the tiny fixtures written by
//! `checkpoint/fixtures/make_gguf_fixtures.py`, and the loader's errors.

use std::io::Cursor;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{self, Content, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};

use super::*;
use crate::checkpoint::hf::export_hf_folder;
use crate::model::Transformer;
use crate::model::weights::{load_hf, varmap_from_tensors};
use crate::tokenizer::ChatMessage;

const ARCHS: [&str; 3] = ["llama", "qwen2", "qwen3"];

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src/checkpoint/fixtures/gguf")
}

fn fixture(arch: &str) -> PathBuf {
    fixture_dir().join(format!("tiny-{arch}.gguf"))
}

fn expected() -> serde_json::Value {
    let text = std::fs::read_to_string(fixture_dir().join("gguf_expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Standard base64 (the fixture's logits).
fn base64_decode(s: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => panic!("not base64: {c}"),
    };
    let digits: Vec<u8> = s.bytes().filter(|&c| c != b'=').map(value).collect();
    let mut out = Vec::with_capacity(digits.len() * 3 / 4);
    for chunk in digits.chunks(4) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &d)| n | (u32::from(d) << (18 - 6 * i)));
        out.extend_from_slice(&n.to_be_bytes()[1..chunk.len()]);
    }
    out
}

/// The reference logits of `arch`, `[position][vocab]`.
fn reference_logits(exp: &serde_json::Value) -> Vec<Vec<f32>> {
    let shape: Vec<usize> = serde_json::from_value(exp["logits_shape"].clone()).unwrap();
    let bytes = base64_decode(exp["logits_f32_le_base64"].as_str().unwrap());
    let values: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(values.len(), shape[0] * shape[1]);
    values.chunks(shape[1]).map(<[f32]>::to_vec).collect()
}

fn logits(model: &Transformer, ids: &[u32]) -> Vec<Vec<f64>> {
    model
        .forward_sequence(ids)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec2::<f64>()
        .unwrap()
}

fn max_abs_diff(a: &[Vec<f64>], b: &[Vec<f32>]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            x.iter().zip(y).map(|(p, q)| (p - f64::from(*q)).abs())
        })
        .fold(0.0, f64::max)
}

/// Logits of every tiny fixture against transformers' (which dequantizes with gguf-py and
/// undoes the Llama row permutation itself): loaded in f64, within 1e-5 — the reference is f64
/// except for transformers' rotary tables (f32, as in `model::tests`) and its rounding to f32 for
/// storage (≤ 5e-7 here); the logits span several units, so a wrong permutation, a wrong
/// dequantization or a wrong tensor mapping shows as differences of order 1. Loaded in f32 (the
/// training dtype) within 1e-4 (f32 accumulation over a 256-wide FFN and 301 logits).
#[test]
fn gguf_tiny_fixtures_match_transformers_logits() {
    let exp = expected();
    for arch in ARCHS {
        let e = &exp[arch];
        let reference = reference_logits(e);
        let ids: Vec<u32> = serde_json::from_value(e["ids"].clone()).unwrap();
        let spread = reference[0].iter().fold(0f32, |m, x| m.max(x.abs()));
        assert!(spread > 1.0, "{arch}: reference logits too flat ({spread})");
        for (dtype, tol) in [(DType::F64, 1e-5), (DType::F32, 1e-4)] {
            let (cfg, tensors) = load_gguf(fixture(arch), dtype, &Device::Cpu).unwrap();
            let model = Transformer::from_tensors(&cfg, &tensors, arch).unwrap();
            let diff = max_abs_diff(&logits(&model, &ids), &reference);
            eprintln!("{arch} ({dtype:?}): max |logit difference| vs transformers = {diff:e}");
            assert!(diff < tol, "{arch} ({dtype:?}): logits differ by {diff:e}");
        }
    }
}

#[test]
fn gguf_tiny_configs_come_from_the_metadata() {
    let llama = GgufCheckpoint::open(fixture("llama"))
        .unwrap()
        .config()
        .unwrap();
    assert_eq!(llama.architecture, Architecture::Llama);
    assert_eq!(
        (
            llama.hidden_size,
            llama.intermediate_size,
            llama.num_hidden_layers
        ),
        (32, 256, 3)
    );
    assert_eq!(
        (
            llama.num_attention_heads,
            llama.num_key_value_heads,
            llama.head_dim
        ),
        (4, 2, 8)
    );
    assert_eq!(
        (llama.vocab_size, llama.max_position_embeddings),
        (301, 256)
    );
    assert_eq!(llama.rope_theta, 1e5);
    assert!((llama.rms_norm_eps - 1e-5).abs() < 1e-12);
    assert!(llama.tie_word_embeddings && !llama.attention_bias && !llama.qk_norm);

    let qwen2 = GgufCheckpoint::open(fixture("qwen2"))
        .unwrap()
        .config()
        .unwrap();
    assert_eq!(qwen2.architecture, Architecture::Qwen2);
    assert!(!qwen2.tie_word_embeddings && qwen2.attention_bias);

    let qwen3 = GgufCheckpoint::open(fixture("qwen3"))
        .unwrap()
        .config()
        .unwrap();
    assert_eq!(qwen3.architecture, Architecture::Qwen3);
    assert_eq!((qwen3.head_dim, qwen3.num_attention_heads), (128, 2));
    assert!(qwen3.qk_norm && qwen3.tie_word_embeddings && !qwen3.attention_bias);
}

/// Token ids of several strings (spaces, digits, Unicode, emoji, chat and user-defined special
/// tokens, contractions) and the chat template's rendering, against transformers.
#[test]
fn gguf_tiny_tokenizers_match_transformers() {
    let exp = expected();
    for arch in ARCHS {
        let e = &exp[arch];
        let ck = GgufCheckpoint::open(fixture(arch)).unwrap();
        let tok = ck.tokenizer().unwrap();
        assert_eq!(tok.vocab_size(), 301);
        let strings: Vec<String> = serde_json::from_value(e["strings"].clone()).unwrap();
        let encoded: Vec<Vec<u32>> = serde_json::from_value(e["encoded"].clone()).unwrap();
        for (s, ids) in strings.iter().zip(&encoded) {
            assert_eq!(&tok.encode(s).unwrap(), ids, "{arch}: {s:?}");
            assert_eq!(&tok.decode(ids, false).unwrap(), s, "{arch}: {s:?}");
        }
        let template = ck.hf_metadata().unwrap().chat_template().unwrap().unwrap();
        let conversation = [
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "What is the capital of France?"),
            ChatMessage::new("assistant", "Paris."),
            ChatMessage::new("user", "And of Italy?"),
        ];
        let rendered = template.render(&conversation, true).unwrap();
        assert_eq!(rendered, e["chat"].as_str().unwrap(), "{arch}");
        assert_eq!(template.eos_token(), Some("<|im_end|>"));
        assert_eq!(template.bos_token(), Some("<|im_start|>"));
    }
    // The fixtures' pre-tokenizers differ where they should: gpt2 keeps " 1889" whole (a learnt
    // merge), qwen2 splits every digit.
    let numbers = &exp["llama"]["encoded"][3];
    assert_ne!(numbers, &exp["qwen2"]["encoded"][3]);
}

/// A GGUF file's metadata entries.
type Meta = Vec<(String, Value)>;
/// A GGUF file's tensors.
type QTensors = Vec<(String, QTensor)>;

/// A copy of the GGUF `src` with its metadata and tensors edited, written by candle.
fn rewrite(
    src: &Path,
    dst: &Path,
    edit_meta: impl FnOnce(&mut Meta),
    edit_tensors: impl FnOnce(&mut QTensors),
) {
    let bytes = std::fs::read(src).unwrap();
    let mut reader = Cursor::new(&bytes);
    let content = Content::read(&mut reader).unwrap();
    let mut meta: Vec<(String, Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    meta.sort_by(|a, b| a.0.cmp(&b.0));
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let mut tensors: Vec<(String, QTensor)> = names
        .into_iter()
        .map(|n| {
            (
                n.clone(),
                content.tensor(&mut reader, n, &Device::Cpu).unwrap(),
            )
        })
        .collect();
    edit_meta(&mut meta);
    edit_tensors(&mut tensors);
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut out = std::fs::File::create(dst).unwrap();
    gguf_file::write(&mut out, &meta_refs, &tensor_refs).unwrap();
}

fn set(meta: &mut Meta, key: &str, value: Value) {
    meta.retain(|(k, _)| k != key);
    meta.push((key.to_string(), value));
}

/// `smollm` (SmolLM2's pre-tokenizer) splits digits one by one before GPT-2's regex: on these
/// strings that gives the same ids as Qwen2's regex, which transformers implements.
#[test]
fn gguf_smollm_pre_tokenizer_splits_digits() {
    let exp = expected();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("smollm.gguf");
    rewrite(
        &fixture("llama"),
        &path,
        |m| set(m, "tokenizer.ggml.pre", Value::String("smollm".into())),
        |_| {},
    );
    let tok = GgufCheckpoint::open(&path).unwrap().tokenizer().unwrap();
    let strings: Vec<String> = serde_json::from_value(exp["qwen2"]["strings"].clone()).unwrap();
    let qwen2: Vec<Vec<u32>> = serde_json::from_value(exp["qwen2"]["encoded"].clone()).unwrap();
    for i in [0, 2, 3, 5] {
        assert_eq!(
            tok.encode(&strings[i]).unwrap(),
            qwen2[i],
            "{:?}",
            strings[i]
        );
    }
    let digits = tok.encode("2024").unwrap();
    assert_eq!(digits.len(), 4, "{digits:?}");
}

/// A GGUF loads, exports as a Hugging Face folder (weights, tokenizer, chat template) and the
/// folder loads back with the same logits and tokens.
#[test]
fn gguf_exports_as_a_hugging_face_folder() {
    let ck = GgufCheckpoint::open(fixture("llama")).unwrap();
    let cfg = ck.config().unwrap();
    let tensors = ck.tensors(&cfg, DType::F32, &Device::Cpu).unwrap();
    let vm = varmap_from_tensors(&cfg, &tensors, "gguf").unwrap();
    let tok = ck.tokenizer().unwrap();
    let meta = ck.hf_metadata().unwrap();
    let dir = tempfile::tempdir().unwrap();
    export_hf_folder(dir.path(), &cfg, &vm, &tok, &meta).unwrap();
    let (cfg2, tensors2) = load_hf(dir.path(), DType::F32, &Device::Cpu).unwrap();
    assert_eq!(cfg2, cfg);
    let ids = [1u32, 87, 85, 71, 84, 201];
    let a = logits(
        &Transformer::from_tensors(&cfg, &tensors, "gguf").unwrap(),
        &ids,
    );
    let b = logits(
        &Transformer::from_tensors(&cfg2, &tensors2, "hf").unwrap(),
        &ids,
    );
    assert_eq!(a, b);
    let back =
        crate::tokenizer::TextTokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();
    let text = "<|im_start|>user\nNumbers: 1889 café<|im_end|>";
    assert_eq!(back.encode(text).unwrap(), tok.encode(text).unwrap());
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap())
            .unwrap();
    assert_eq!(config["bos_token_id"], 1);
    assert_eq!(config["eos_token_id"], 2);
    let exported = crate::checkpoint::HfMetadata::from_folder(dir.path()).unwrap();
    let chat = [ChatMessage::new("user", "hi")];
    assert_eq!(
        exported
            .chat_template()
            .unwrap()
            .unwrap()
            .render(&chat, true)
            .unwrap(),
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn gguf_unpermute_inverts_llama_cpp_permute() {
    // llama.cpp: reshape(heads, 2, d/2, in).swapaxes(1, 2).reshape(heads·d, in).
    let (heads, d, cols) = (3usize, 8usize, 5usize);
    let hf = Tensor::arange(0f32, (heads * d * cols) as f32, &Device::Cpu)
        .unwrap()
        .reshape((heads * d, cols))
        .unwrap();
    let permuted = hf
        .reshape((heads, 2, d / 2, cols))
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap()
        .reshape((heads * d, cols))
        .unwrap();
    let back = unpermute_rows(&permuted, heads).unwrap();
    assert_eq!(back.to_vec2::<f32>().unwrap(), hf.to_vec2::<f32>().unwrap());
    // Biases (one dimension) too.
    let bias = Tensor::arange(0f32, (heads * d) as f32, &Device::Cpu).unwrap();
    let permuted = bias
        .reshape((heads, 2, d / 2))
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .flatten_all()
        .unwrap();
    assert_eq!(
        unpermute_rows(&permuted, heads)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap(),
        bias.to_vec1::<f32>().unwrap()
    );
    assert!(unpermute_rows(&bias, 5).is_err());
}

fn load_err(path: &Path) -> String {
    let err = GgufCheckpoint::open(path)
        .and_then(|ck| {
            let cfg = ck.config()?;
            ck.tensors(&cfg, DType::F32, &Device::Cpu)?;
            ck.tokenizer()?;
            ck.hf_metadata()
        })
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&path.display().to_string()),
        "no path in: {err}"
    );
    err
}

/// Unsupported architectures, tensor types, tokenizers and features, missing keys and tensors
/// are errors naming the file and what is wrong.
#[test]
fn gguf_errors_name_the_file_and_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixture("llama");
    let case = |name: &str, meta: &dyn Fn(&mut Meta), tensors: &dyn Fn(&mut QTensors)| {
        let path = dir.path().join(format!("{name}.gguf"));
        rewrite(&src, &path, meta, tensors);
        load_err(&path)
    };
    let none = |_: &mut QTensors| {};

    let e = case(
        "arch",
        &|m| set(m, "general.architecture", Value::String("phi3".into())),
        &none,
    );
    assert!(e.contains("architecture `phi3` is not supported"), "{e}");

    let e = case(
        "missing",
        &|m| m.retain(|(k, _)| k != "llama.embedding_length"),
        &none,
    );
    assert!(
        e.contains("metadata key `llama.embedding_length` is missing"),
        "{e}"
    );

    let e = case(
        "rope",
        &|m| set(m, "llama.rope.scaling.type", Value::String("linear".into())),
        &none,
    );
    assert!(
        e.contains("llama.rope.scaling.type") && e.contains("linear"),
        "{e}"
    );

    let e = case(
        "tokenizer",
        &|m| set(m, "tokenizer.ggml.model", Value::String("llama".into())),
        &none,
    );
    assert!(
        e.contains("tokenizer.ggml.model") && e.contains("`llama`"),
        "{e}"
    );

    let e = case(
        "pre",
        &|m| set(m, "tokenizer.ggml.pre", Value::String("chatglm-bpe".into())),
        &none,
    );
    assert!(
        e.contains("tokenizer.ggml.pre") && e.contains("chatglm-bpe"),
        "{e}"
    );

    let e = case(
        "template",
        &|m| {
            set(
                m,
                "tokenizer.chat_template",
                Value::String("{% if %}".into()),
            )
        },
        &none,
    );
    assert!(e.contains("tokenizer.chat_template"), "{e}");

    let e = case("no-tensor", &|_| {}, &|t| {
        t.retain(|(k, _)| k != "blk.1.ffn_up.weight")
    });
    assert!(
        e.contains("`blk.1.ffn_up.weight`") && e.contains("model.layers.1.mlp.up_proj.weight"),
        "{e}"
    );

    let e = case("extra", &|_| {}, &|t| {
        let freqs = Tensor::ones(4, DType::F32, &Device::Cpu).unwrap();
        t.push((
            "rope_freqs.weight".into(),
            QTensor::quantize(&freqs, GgmlDType::F32).unwrap(),
        ));
    });
    assert!(
        e.contains("`rope_freqs.weight` is not part of a supported llama"),
        "{e}"
    );

    let e = case("q8_1", &|_| {}, &|t| {
        let w = Tensor::ones((16, 32), DType::F32, &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q8_1).unwrap();
        for (k, v) in t.iter_mut() {
            if k == "blk.0.attn_v.weight" {
                *v = q;
                break;
            }
        }
    });
    assert!(
        e.contains("tensor `blk.0.attn_v.weight` has type Q8_1, which is not supported"),
        "{e}"
    );

    // A type candle cannot read at all (IQ2_XXS, id 16): patched into the header.
    let mut bytes = std::fs::read(&src).unwrap();
    let name = b"blk.0.attn_v.weight";
    let at = bytes
        .windows(name.len())
        .position(|w| w == name)
        .expect("tensor name in the header");
    let type_at = at + name.len() + 4 + 2 * 8; // n_dims (u32), two u64 dims, then the type
    bytes[type_at..type_at + 4].copy_from_slice(&16u32.to_le_bytes());
    let path = dir.path().join("iq2.gguf");
    std::fs::write(&path, bytes).unwrap();
    let e = load_err(&path);
    assert!(e.contains("type IQ2_XXS, which is not supported"), "{e}");

    let path = dir.path().join("absent.gguf");
    assert!(load_err(&path).contains("absent.gguf"));
    std::fs::write(&path, b"GGUF but truncated").unwrap();
    assert!(load_err(&path).contains("not a readable GGUF file"));
    assert!(is_gguf_file(&path) && !is_gguf_file(dir.path().join("none")));
}
