//! The Hugging Face files of a model folder besides the weights: `config.json` fields the
//! model config does not model (token ids, sliding-window settings, ...), `tokenizer.json`,
//! `tokenizer_config.json` (chat template, special tokens), `generation_config.json` and the
//! other tokenizer files. A folder exported from a model loaded from a Hugging Face checkpoint
//! carries the checkpoint's files; one of a fresh model gets generated ones.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use candle_core::Tensor;
use candle_nn::VarMap;
use serde_json::{Value, json};

use crate::error::{ModelError, Result};
use crate::model::weights::{export_hf, export_hf_tensors, set_mode_644};
use crate::model::{Architecture, ModelConfig};
use crate::tokenizer::{ChatTemplate, END_OF_TEXT, IM_END, TextTokenizer, UNK};

/// Tokenizer files copied verbatim from the source folder when present (`tokenizer.json` is
/// rewritten from the tokenizer itself).
pub const COPIED_TOKENIZER_FILES: &[&str] = &[
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
];

/// The Hugging Face metadata of a source model folder, which exports carry over.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HfMetadata {
    /// The source `config.json`: its fields are kept under the ones the model config writes.
    pub config: Option<Value>,
    /// The source `tokenizer_config.json`.
    pub tokenizer_config: Option<Value>,
    /// The source `generation_config.json`.
    pub generation_config: Option<Value>,
    /// The files of [`COPIED_TOKENIZER_FILES`] that the source has, by name.
    pub files: BTreeMap<String, Vec<u8>>,
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|cause| ModelError::Json {
            what: path.display().to_string(),
            cause,
        })
}

/// A token field of `tokenizer_config.json`: a string or `{"content": ...}`.
fn token_field(v: &Value, key: &str) -> Option<String> {
    match v.get(key)? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(String::from),
        _ => None,
    }
}

impl HfMetadata {
    /// Reads the metadata files `dir` has; missing files are `None`, unreadable ones errors.
    pub fn from_folder(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let mut files = BTreeMap::new();
        for name in COPIED_TOKENIZER_FILES {
            let path = dir.join(name);
            if path.is_file() {
                let bytes = std::fs::read(&path).map_err(|e| ModelError::io(&path, e))?;
                files.insert((*name).to_string(), bytes);
            }
        }
        Ok(Self {
            config: read_json(&dir.join("config.json"))?,
            tokenizer_config: read_json(&dir.join("tokenizer_config.json"))?,
            generation_config: read_json(&dir.join("generation_config.json"))?,
            files,
        })
    }

    /// Fills what `self` lacks from `other` (e.g. a checkpoint written before these files were
    /// exported, completed from the folder its run started from).
    pub fn or(mut self, other: Self) -> Self {
        if self.tokenizer_config.is_none() {
            self.tokenizer_config = other.tokenizer_config;
        }
        if self.generation_config.is_none() {
            self.generation_config = other.generation_config;
        }
        if self.config.is_none() {
            self.config = other.config;
        } else if let (Some(Value::Object(mine)), Some(Value::Object(theirs))) =
            (self.config.as_mut(), other.config)
        {
            for (k, v) in theirs {
                mine.entry(k).or_insert(v);
            }
        }
        for (k, v) in other.files {
            self.files.entry(k).or_insert(v);
        }
        self
    }

    /// The chat template of the folder: `chat_template` in `tokenizer_config.json`, else
    /// `chat_template.jinja`; `None` when it has neither.
    pub fn chat_template(&self) -> Result<Option<ChatTemplate>> {
        let tc = self.tokenizer_config.as_ref();
        if let Some(tc) = tc.filter(|tc| tc.get("chat_template").is_some_and(|t| !t.is_null())) {
            return ChatTemplate::from_tokenizer_config_json(&tc.to_string()).map(Some);
        }
        match self.files.get("chat_template.jinja") {
            Some(bytes) => {
                let source = String::from_utf8(bytes.clone()).map_err(|_| {
                    ModelError::Tokenizer("chat_template.jinja is not UTF-8".into())
                })?;
                let token = |k: &str| tc.and_then(|tc| token_field(tc, k));
                ChatTemplate::new(source, token("bos_token"), token("eos_token")).map(Some)
            }
            None => Ok(None),
        }
    }

    /// The end-of-sequence token: the source's `eos_token`, else `<|endoftext|>` when the
    /// tokenizer has it.
    pub fn eos_token(&self, tokenizer: &TextTokenizer) -> Option<String> {
        self.tokenizer_config
            .as_ref()
            .and_then(|tc| token_field(tc, "eos_token"))
            .or_else(|| {
                tokenizer
                    .token_to_id(END_OF_TEXT)
                    .map(|_| END_OF_TEXT.to_string())
            })
    }

    /// A `tokenizer_config.json` for a tokenizer with no source one: the fast tokenizer of
    /// `tokenizer.json` with its end-of-text token as EOS and padding.
    fn generated_tokenizer_config(&self, tokenizer: &TextTokenizer, max_len: usize) -> Value {
        let mut v = json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": max_len,
            "clean_up_tokenization_spaces": false,
            "bos_token": null,
        });
        if let Some(eos) = self.eos_token(tokenizer) {
            v["eos_token"] = json!(eos);
            v["pad_token"] = json!(eos);
        }
        if tokenizer.token_to_id(UNK).is_some() {
            v["unk_token"] = json!(UNK);
        }
        v
    }

    /// The ids of the BOS, EOS and padding tokens as the tokenizer config names them (EOS and
    /// padding default to `<|endoftext|>`).
    fn token_ids(&self, tokenizer: &TextTokenizer) -> [(&'static str, Option<u32>); 3] {
        let tc = self.tokenizer_config.as_ref();
        let id = |t: Option<String>| t.and_then(|t| tokenizer.token_to_id(&t));
        let eos = id(self.eos_token(tokenizer));
        let pad = id(tc.and_then(|tc| token_field(tc, "pad_token"))).or(eos);
        let bos = id(tc.and_then(|tc| token_field(tc, "bos_token")));
        [
            ("bos_token_id", bos),
            ("eos_token_id", eos),
            ("pad_token_id", pad),
        ]
    }

    /// A `generation_config.json` for a model with no source one: stop at the end of text or
    /// at the end of a chat message.
    fn generated_generation_config(&self, tokenizer: &TextTokenizer) -> Value {
        let [bos, eos, pad] = self.token_ids(tokenizer);
        let mut stops: Vec<u32> = eos.1.into_iter().collect();
        if let Some(im_end) = tokenizer.token_to_id(IM_END)
            && !stops.contains(&im_end)
        {
            stops.push(im_end);
        }
        let mut v = json!({});
        if let Some(b) = bos.1 {
            v["bos_token_id"] = json!(b);
        }
        match stops.as_slice() {
            [] => {}
            [one] => v["eos_token_id"] = json!(one),
            many => v["eos_token_id"] = json!(many),
        }
        if let Some(p) = pad.1 {
            v["pad_token_id"] = json!(p);
        }
        v
    }
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).map_err(|e| ModelError::io(path, e))?;
    set_mode_644(path)
}

fn write_json(path: &Path, v: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(v).map_err(|cause| ModelError::Json {
        what: path.display().to_string(),
        cause,
    })?;
    write_file(path, format!("{text}\n").as_bytes())
}

/// Replaces a `tokenizer_class` of `Qwen2Tokenizer` (or `Qwen2TokenizerFast`) in `json` by
/// `PreTrainedTokenizerFast`, which reads `tokenizer.json` as it is: `Qwen2Tokenizer` keeps only
/// its vocabulary and merges, and is right only for Qwen2's own tokenizer.
fn fast_tokenizer_class(json: &mut serde_json::Map<String, Value>) {
    if let Some(Value::String(class)) = json.get("tokenizer_class")
        && class.trim_end_matches("Fast") == "Qwen2Tokenizer"
    {
        json.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
    }
}

/// Completes the Hugging Face folder `dir`, whose `config.json` and weights
/// [`export_hf`] wrote: merges the source `config.json` under the written one (so the token
/// ids, sliding-window fields and anything else the source had are kept, and the BOS, EOS and
/// padding ids are filled from the tokenizer when the source has none), and writes
/// `tokenizer.json`, `tokenizer_config.json` and `generation_config.json` (the source's, or
/// generated ones) and the source's other tokenizer files. A `tokenizer_class` of
/// `Qwen2Tokenizer` (in either file) becomes `PreTrainedTokenizerFast` unless `tokenizer` is
/// Qwen2's. Every file is mode 0644.
pub fn write_hf_metadata(dir: &Path, tokenizer: &TextTokenizer, meta: &HfMetadata) -> Result<()> {
    let cfg_path = dir.join("config.json");
    let Some(Value::Object(written)) = read_json(&cfg_path)? else {
        return Err(ModelError::Checkpoint {
            path: cfg_path,
            reason: "config.json is missing or not an object".into(),
        });
    };
    let mut merged = match &meta.config {
        Some(Value::Object(base)) => base.clone(),
        _ => Default::default(),
    };
    // transformers ≥ 4.56 writes the weights' dtype as `dtype`; ours are `torch_dtype`.
    if merged.contains_key("dtype")
        && let Some(d) = written.get("torch_dtype")
    {
        merged.insert("dtype".into(), d.clone());
    }
    for (k, v) in written {
        merged.insert(k, v);
    }
    for (key, id) in meta.token_ids(tokenizer) {
        if let Some(id) = id {
            merged.entry(key.to_string()).or_insert(json!(id));
        }
    }
    let qwen2_tokenizer = tokenizer.is_qwen2_byte_level_bpe();
    if !qwen2_tokenizer {
        fast_tokenizer_class(&mut merged);
    }
    let max_len = merged
        .get("max_position_embeddings")
        .and_then(Value::as_u64)
        .unwrap_or(32_768) as usize;
    write_json(&cfg_path, &Value::Object(merged))?;

    let tok_path = dir.join("tokenizer.json");
    tokenizer.save(&tok_path)?;
    set_mode_644(&tok_path)?;
    let mut tc = match &meta.tokenizer_config {
        Some(tc) => tc.clone(),
        None => meta.generated_tokenizer_config(tokenizer, max_len),
    };
    if !qwen2_tokenizer && let Value::Object(tc) = &mut tc {
        fast_tokenizer_class(tc);
    }
    write_json(&dir.join("tokenizer_config.json"), &tc)?;
    let gc = match &meta.generation_config {
        Some(gc) => gc.clone(),
        None => meta.generated_generation_config(tokenizer),
    };
    write_json(&dir.join("generation_config.json"), &gc)?;
    for (name, bytes) in &meta.files {
        write_file(&dir.join(name), bytes)?;
    }
    Ok(())
}

/// The configuration an export of a model of `config` with `tokenizer` is written with, so that
/// `transformers`' `AutoTokenizer` reads the tokenizer as written: transformers ≥ 5 builds every
/// `model_type = "qwen2"` folder's tokenizer as `Qwen2Tokenizer` whatever
/// `tokenizer_config.json` says (`qwen2` is in its `MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`),
/// keeping only the vocabulary and merges, which garbles every other tokenizer (the word-level
/// one of a fresh model, a GPT-2-style byte-level BPE). So a Qwen2 model whose tokenizer is not
/// Qwen2's ([`TextTokenizer::is_qwen2_byte_level_bpe`]) is written as the Llama that computes the
/// same (`attention_bias = true`, zero o_proj biases), whose `PreTrainedTokenizerFast` loads
/// `tokenizer.json` as it is; [`ModelConfig::from_hf_json`] reads it back as Qwen2. Any other
/// model is written as it is.
pub fn export_model_config(config: &ModelConfig, tokenizer: &TextTokenizer) -> ModelConfig {
    let mut out = config.clone();
    if config.architecture == Architecture::Qwen2 && !tokenizer.is_qwen2_byte_level_bpe() {
        out.architecture = Architecture::Llama;
    }
    out
}

/// Writes a complete Hugging Face model folder: `config.json` and `model.safetensors`
/// ([`export_hf`], with the configuration of [`export_model_config`]) completed by
/// [`write_hf_metadata`]. Loadable by `transformers`' `AutoModelForCausalLM`, `AutoTokenizer`
/// (the ids of our tokenizer) and `GenerationConfig`.
pub fn export_hf_folder(
    dir: impl AsRef<Path>,
    config: &ModelConfig,
    varmap: &VarMap,
    tokenizer: &TextTokenizer,
    meta: &HfMetadata,
) -> Result<()> {
    let dir = dir.as_ref();
    export_hf(dir, &export_model_config(config, tokenizer), varmap)?;
    write_hf_metadata(dir, tokenizer, meta)
}

/// [`export_hf_folder`] from named tensors (e.g. base weights with LoRA adapters merged in by
/// [`crate::model::lora::merge_adapters`]).
pub fn export_hf_folder_tensors(
    dir: impl AsRef<Path>,
    config: &ModelConfig,
    tensors: &HashMap<String, Tensor>,
    tokenizer: &TextTokenizer,
    meta: &HfMetadata,
) -> Result<()> {
    let dir = dir.as_ref();
    export_hf_tensors(dir, &export_model_config(config, tokenizer), tensors)?;
    write_hf_metadata(dir, tokenizer, meta)
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};

    use super::*;
    use crate::model::weights::{export_hf, init_varmap, load_hf, load_safetensors};
    use crate::tokenizer::DEFAULT_SPECIAL_TOKENS;

    fn tokenizer() -> TextTokenizer {
        let corpus = ["who founded the company ?", "the answer is Paris ."];
        TextTokenizer::train_word_level(&corpus, 200, DEFAULT_SPECIAL_TOKENS).unwrap()
    }

    /// The safetensors header's `__metadata__` object.
    fn header_metadata(path: &Path) -> Value {
        let bytes = std::fs::read(path).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        header["__metadata__"].clone()
    }

    #[cfg(unix)]
    fn mode(path: &Path) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn fresh_export_is_complete_and_readable() {
        let cfg = ModelConfig::tiny_qwen2(tokenizer().vocab_size());
        let vm = init_varmap(&cfg, DType::F32, &Device::Cpu, 1).unwrap();
        let tok = tokenizer();
        let dir = tempfile::tempdir().unwrap();
        export_hf_folder(dir.path(), &cfg, &vm, &tok, &HfMetadata::default()).unwrap();
        let st = dir.path().join("model.safetensors");
        assert_eq!(header_metadata(&st), json!({"format": "pt"}));
        let eot = tok.token_to_id(END_OF_TEXT).unwrap();
        let im_end = tok.token_to_id(IM_END).unwrap();
        let config = read_json(&dir.path().join("config.json")).unwrap().unwrap();
        assert_eq!(config["eos_token_id"], json!(eot));
        assert_eq!(config["pad_token_id"], json!(eot));
        // A word-level tokenizer: the Llama form (see `export_model_config`).
        assert_eq!(config["model_type"], json!("llama"));
        assert_eq!(config["architectures"], json!(["LlamaForCausalLM"]));
        assert_eq!(config["attention_bias"], json!(true));
        let tc = read_json(&dir.path().join("tokenizer_config.json"))
            .unwrap()
            .unwrap();
        assert_eq!(tc["eos_token"], json!(END_OF_TEXT));
        assert_eq!(tc["tokenizer_class"], json!("PreTrainedTokenizerFast"));
        assert!(tc.get("chat_template").is_none());
        let gc = read_json(&dir.path().join("generation_config.json"))
            .unwrap()
            .unwrap();
        assert_eq!(gc["eos_token_id"], json!([eot, im_end]));
        #[cfg(unix)]
        for entry in std::fs::read_dir(dir.path()).unwrap() {
            let path = entry.unwrap().path();
            assert_eq!(mode(&path), 0o644, "{}", path.display());
        }
        // It loads back, with the same config.
        let (cfg2, _) = load_hf(dir.path(), DType::F32, &Device::Cpu).unwrap();
        assert_eq!(cfg2, cfg);
        assert!(
            HfMetadata::from_folder(dir.path())
                .unwrap()
                .chat_template()
                .unwrap()
                .is_none()
        );
    }

    /// The Llama form of a Qwen2 export (zero o_proj biases, which transformers' Llama with
    /// `attention_bias` has) and the `qwen2` form that exports had before it (and checkpoints
    /// still have) both load back as the same Qwen2 model with the same logits.
    #[test]
    fn llama_form_and_old_qwen2_exports_load_back_with_the_same_logits() {
        use crate::model::Transformer;
        let tok = tokenizer();
        let mut cfg = ModelConfig::tiny_qwen2(tok.vocab_size());
        cfg.initializer_range = 0.3;
        let vm = init_varmap(&cfg, DType::F32, &Device::Cpu, 5).unwrap();
        // Non-zero q/k/v biases, so that dropping or misplacing them would show.
        for (name, var) in crate::model::weights::sorted_vars(&vm) {
            if name.ends_with(".bias") {
                let t = (var.as_tensor().ones_like().unwrap() * 0.5).unwrap();
                var.set(&t).unwrap();
            }
        }
        let ids = tok.encode("who founded the company ?").unwrap();
        let want = Transformer::detached_from_varmap(&cfg, &vm)
            .unwrap()
            .forward_sequence(&ids)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let llama = tmp.path().join("llama");
        export_hf_folder(&llama, &cfg, &vm, &tok, &HfMetadata::default()).unwrap();
        let old = tmp.path().join("old");
        export_hf(&old, &cfg, &vm).unwrap();
        write_hf_metadata(&old, &tok, &HfMetadata::default()).unwrap();
        let weights =
            load_safetensors(llama.join("model.safetensors"), DType::F32, &Device::Cpu).unwrap();
        for i in 0..cfg.num_hidden_layers {
            let b = &weights[&format!("model.layers.{i}.self_attn.o_proj.bias")];
            assert_eq!(b.dims(), [cfg.hidden_size]);
            assert!(b.to_vec1::<f32>().unwrap().iter().all(|x| *x == 0.0));
        }
        for (dir, model_type) in [(&llama, "llama"), (&old, "qwen2")] {
            let config = read_json(&dir.join("config.json")).unwrap().unwrap();
            assert_eq!(config["model_type"], json!(model_type));
            let (cfg2, tensors) = load_hf(dir, DType::F32, &Device::Cpu).unwrap();
            assert_eq!(cfg2, cfg, "{model_type}");
            assert!(!tensors.keys().any(|k| k.contains("o_proj.bias")));
            let got = Transformer::from_tensors(&cfg2, &tensors, model_type)
                .unwrap()
                .forward_sequence(&ids)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            assert_eq!(got, want, "{model_type}");
        }
        // The Llama form re-exported (e.g. a run started from it) is the same folder again.
        let (cfg2, tensors) = load_hf(&llama, DType::F32, &Device::Cpu).unwrap();
        let again = tmp.path().join("again");
        export_hf_folder_tensors(&again, &cfg2, &tensors, &tok, &HfMetadata::default()).unwrap();
        for file in ["config.json", "model.safetensors"] {
            assert_eq!(
                std::fs::read(again.join(file)).unwrap(),
                std::fs::read(llama.join(file)).unwrap(),
                "{file}"
            );
        }

        // A non-zero attention output bias cannot be run here: refused, naming the tensor.
        let mut weights = weights;
        let name = "model.layers.1.self_attn.o_proj.bias";
        weights.insert(name.into(), weights[name].ones_like().unwrap());
        crate::model::weights::save_safetensors(&weights, llama.join("model.safetensors")).unwrap();
        let e = load_hf(&llama, DType::F32, &Device::Cpu)
            .unwrap_err()
            .to_string();
        assert!(e.contains(name) && e.contains("32 non-zero values"), "{e}");
    }

    #[test]
    fn export_keeps_the_source_checkpoints_files() {
        let tok = tokenizer();
        let cfg = ModelConfig::tiny_qwen2(tok.vocab_size());
        let vm = init_varmap(&cfg, DType::F32, &Device::Cpu, 1).unwrap();
        // A source folder as transformers writes it.
        let src = tempfile::tempdir().unwrap();
        let mut source_config = cfg.to_hf_json();
        source_config["bos_token_id"] = json!(7);
        source_config["eos_token_id"] = json!(2);
        source_config["pad_token_id"] = json!(0);
        source_config["use_sliding_window"] = json!(false);
        source_config["sliding_window"] = json!(4096);
        source_config["max_window_layers"] = json!(21);
        source_config["torch_dtype"] = json!("bfloat16");
        std::fs::write(src.path().join("config.json"), source_config.to_string()).unwrap();
        let template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        let tc = json!({"chat_template": template, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "tokenizer_class": "Qwen2Tokenizer"});
        std::fs::write(src.path().join("tokenizer_config.json"), tc.to_string()).unwrap();
        let gc = json!({"eos_token_id": [2, 0], "temperature": 0.7, "top_p": 0.8});
        std::fs::write(src.path().join("generation_config.json"), gc.to_string()).unwrap();
        std::fs::write(src.path().join("merges.txt"), "#version: 0.2\n").unwrap();
        let meta = HfMetadata::from_folder(src.path()).unwrap();
        assert!(meta.chat_template().unwrap().is_some());

        let dir = tempfile::tempdir().unwrap();
        export_hf_folder(dir.path(), &cfg, &vm, &tok, &meta).unwrap();
        let config = read_json(&dir.path().join("config.json")).unwrap().unwrap();
        for key in [
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
            "sliding_window",
        ] {
            assert_eq!(config[key], source_config[key], "{key}");
        }
        assert_eq!(config["max_window_layers"], json!(21));
        assert_eq!(config["use_sliding_window"], json!(false));
        // The weights written are f32, whatever the source's were.
        assert_eq!(config["torch_dtype"], json!("float32"));
        // ... except a `Qwen2Tokenizer` class, which would garble this word-level tokenizer.
        let mut fast = tc.clone();
        fast["tokenizer_class"] = json!("PreTrainedTokenizerFast");
        assert_eq!(
            read_json(&dir.path().join("tokenizer_config.json")).unwrap(),
            Some(fast)
        );
        assert_eq!(
            read_json(&dir.path().join("generation_config.json")).unwrap(),
            Some(gc)
        );
        assert_eq!(
            std::fs::read_to_string(dir.path().join("merges.txt")).unwrap(),
            "#version: 0.2\n"
        );
        // The export's chat template renders like the source's.
        let rendered = HfMetadata::from_folder(dir.path())
            .unwrap()
            .chat_template()
            .unwrap()
            .unwrap()
            .render(&[crate::tokenizer::ChatMessage::new("user", "hi")], true)
            .unwrap();
        assert_eq!(
            rendered,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
        // The source folder loads with its extra fields.
        assert!(load_hf(dir.path(), DType::F32, &Device::Cpu).is_ok());
    }

    #[test]
    fn non_finite_weights_are_named_with_their_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let good = candle_core::Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap();
        let bad = candle_core::Tensor::new(&[1f32, f32::NAN, f32::INFINITY], &Device::Cpu).unwrap();
        let tensors = std::collections::HashMap::from([
            ("a.weight".to_string(), good.clone()),
            ("b.weight".to_string(), bad),
        ]);
        crate::model::weights::save_safetensors(&tensors, &path).unwrap();
        let err = load_safetensors(&path, DType::F32, &Device::Cpu).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("model.safetensors"), "{msg}");
        assert!(
            msg.contains("`b.weight` holds 2 NaN or infinite values (of 3)"),
            "{msg}"
        );
        // Finite bf16 weights load.
        let tensors = std::collections::HashMap::from([(
            "a".to_string(),
            good.to_dtype(DType::BF16).unwrap(),
        )]);
        crate::model::weights::save_safetensors(&tensors, &path).unwrap();
        assert!(load_safetensors(&path, DType::F32, &Device::Cpu).is_ok());
    }

    /// The script [`transformers_reads_exports_as_turnwise_does`] runs: for each requested
    /// folder, loads it with `AutoModelForCausalLM`, `AutoTokenizer` and `GenerationConfig` and
    /// reports the tokenizer's class, its ids of each text (without and with special tokens), the
    /// logits of the given ids, `steps` greedy tokens after the tokenizer's ids of the first text,
    /// the generation config's EOS ids, the EOS token and (when asked) a chat-template rendering.
    const TRANSFORMERS_SCRIPT: &str = r#"
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
out = []
for r in json.load(open(sys.argv[1])):
    m = AutoModelForCausalLM.from_pretrained(r["dir"]).float().eval()
    tok = AutoTokenizer.from_pretrained(r["dir"])
    gc = GenerationConfig.from_pretrained(r["dir"])
    with torch.no_grad():
        logits = m(torch.tensor([r["ids"]])).logits[0].tolist()
        seq = tok.encode(r["texts"][0], add_special_tokens=False)
        greedy = []
        for _ in range(r["steps"]):
            greedy.append(int(m(torch.tensor([seq])).logits[0, -1].argmax()))
            seq.append(greedy[-1])
    res = {"class": type(tok).__name__, "logits": logits, "greedy": greedy,
           "encoded": [tok.encode(t, add_special_tokens=False) for t in r["texts"]],
           "encoded_special": [tok(t)["input_ids"] for t in r["texts"]],
           "eos_token_id": gc.eos_token_id, "eos_token": tok.eos_token}
    if r["chat"]:
        res["chat"] = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                              add_generation_prompt=True, tokenize=False)
    out.append(res)
json.dump(out, open(sys.argv[2], "w"))
"#;

    /// The texts every export's tokenizer must encode as ours does: a prompt, a chat turn, and
    /// what tells tokenizers apart (digit runs, a decomposed accent that NFC composes, non-Latin
    /// scripts, tags, contractions, whitespace runs).
    const TEXTS: &[&str] = &[
        "who founded the company ?",
        "<|im_start|>user\nwho founded the company ?<|im_end|>\n<|im_start|>assistant\n",
        "Numbers: 1889, 300 and 3.14159",
        "cafe\u{301} Zürich 東京 🙂 naïve",
        "<think>reasoning</think> they're here; I'M SURE",
        "  double  spaces\n\n\tindent",
    ];

    /// A ChatML chat template, as Qwen's `tokenizer_config.json` has one.
    const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    /// A model the transformers test exports: what it is, and the `model_type` its export must
    /// have.
    struct Case {
        name: &'static str,
        config: ModelConfig,
        tensors: HashMap<String, Tensor>,
        tokenizer: TextTokenizer,
        meta: HfMetadata,
        model_type: &'static str,
        chat: bool,
    }

    /// A fresh model of `tok` (large weights, so that logits differ clearly between tokens).
    fn fresh_case(
        name: &'static str,
        tok: &TextTokenizer,
        meta: HfMetadata,
        model_type: &'static str,
        seed: u64,
    ) -> Case {
        let mut config = ModelConfig::tiny_qwen2(tok.vocab_size());
        config.initializer_range = 0.3;
        config.tie_word_embeddings = meta.tokenizer_config.is_none();
        let vm = init_varmap(&config, DType::F32, &Device::Cpu, seed).unwrap();
        Case {
            name,
            tensors: crate::model::transformer::varmap_tensors(&vm, true),
            config,
            tokenizer: tok.clone(),
            chat: meta.chat_template().unwrap().is_some(),
            meta,
            model_type,
        }
    }

    /// A model read from one of the GGUF fixtures (a byte-level BPE of a real checkpoint's
    /// kind, with the checkpoint's metadata).
    fn gguf_case(name: &'static str, arch: &str) -> Case {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join(format!("src/checkpoint/fixtures/gguf/tiny-{arch}.gguf"));
        let ck = crate::checkpoint::gguf::GgufCheckpoint::open(path).unwrap();
        let config = ck.config().unwrap();
        let meta = ck.hf_metadata().unwrap();
        Case {
            name,
            tensors: ck.tensors(&config, DType::F32, &Device::Cpu).unwrap(),
            config,
            tokenizer: ck.tokenizer().unwrap(),
            chat: meta.chat_template().unwrap().is_some(),
            meta,
            // llama.cpp's Qwen2 tokenizer does not normalize: not Qwen2Tokenizer's.
            model_type: "llama",
        }
    }

    /// The greedy continuation of `ids` by `model`, `steps` tokens.
    fn greedy(model: &crate::model::Transformer, ids: &[u32], steps: usize) -> Vec<u32> {
        let mut seq = ids.to_vec();
        for _ in 0..steps {
            let logits = model
                .forward_sequence(&seq)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            let last = logits.last().unwrap();
            let best = (0..last.len())
                .max_by(|&a, &b| last[a].total_cmp(&last[b]))
                .unwrap();
            seq.push(best as u32);
        }
        seq[ids.len()..].to_vec()
    }

    /// Every kind of tokenizer turnwise writes, exported and loaded with `transformers`: a fresh
    /// model's word-level tokenizer (with generated files, and with a source's chat template),
    /// a fresh byte-level BPE (GPT-2's splitting; also under a source that declares
    /// `Qwen2Tokenizer`), Qwen2's own byte-level BPE (generated files, and Qwen's), and the
    /// byte-level BPEs of the qwen2 and llama GGUF fixtures. For each, `AutoTokenizer` gives
    /// our ids of every text of [`TEXTS`] (with and without special tokens), and
    /// `AutoModelForCausalLM` our logits (within 1e-4, f32 on CPU) and greedy tokens; the
    /// generation config's EOS ids and the chat template's rendering match too, and turnwise
    /// reads the export back as the same model with the same logits. Exports of Qwen2 models
    /// whose tokenizer is not Qwen2's are Llama folders (transformers ≥ 5 would load them with
    /// `Qwen2Tokenizer`, which garbles every prompt); only Qwen2's own tokenizer stays `qwen2`.
    /// Skipped, with the reason printed, when `python3` (or `$TURNWISE_PYTHON`) cannot import
    /// transformers and torch.
    #[test]
    fn transformers_reads_exports_as_turnwise_does() {
        use crate::model::Transformer;
        use std::process::Command;

        let Some(python) = crate::python_check::python_with("transformers, torch") else {
            return;
        };
        const STEPS: usize = 6;
        let word = tokenizer();
        let corpus: Vec<String> = TEXTS.iter().map(|t| t.repeat(3)).collect();
        let bpe =
            TextTokenizer::train_byte_level_bpe(&corpus, 400, DEFAULT_SPECIAL_TOKENS).unwrap();
        let qwen = crate::tokenizer::qwen2_style(&bpe);
        let chat_source = HfMetadata {
            tokenizer_config: Some(json!({
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": CHATML,
                "eos_token": IM_END,
                "pad_token": END_OF_TEXT,
            })),
            ..Default::default()
        };
        let declares_qwen2 = |tok: &TextTokenizer| {
            let added: serde_json::Map<String, Value> = DEFAULT_SPECIAL_TOKENS
                .iter()
                .map(|t| {
                    let special = t.starts_with("<|");
                    let entry = json!({"content": t, "lstrip": false, "normalized": false,
                        "rstrip": false, "single_word": false, "special": special});
                    (tok.token_to_id(t).unwrap().to_string(), entry)
                })
                .collect();
            HfMetadata {
                tokenizer_config: Some(json!({
                    "tokenizer_class": "Qwen2Tokenizer",
                    "added_tokens_decoder": added,
                    "chat_template": CHATML,
                    "bos_token": null,
                    "eos_token": IM_END,
                    "pad_token": END_OF_TEXT,
                    "unk_token": null,
                    "errors": "replace",
                    "split_special_tokens": false,
                    "clean_up_tokenization_spaces": false,
                    "model_max_length": 512,
                })),
                ..Default::default()
            }
        };
        let default = HfMetadata::default;
        let cases = [
            fresh_case("word-level", &word, default(), "llama", 11),
            fresh_case("word-level, chat", &word, chat_source, "llama", 12),
            fresh_case("byte-level BPE", &bpe, default(), "llama", 13),
            fresh_case(
                "BPE, Qwen2Tokenizer declared",
                &bpe,
                declares_qwen2(&bpe),
                "llama",
                14,
            ),
            fresh_case("Qwen2's BPE", &qwen, default(), "qwen2", 15),
            fresh_case(
                "Qwen2's BPE, Qwen's files",
                &qwen,
                declares_qwen2(&qwen),
                "qwen2",
                16,
            ),
            gguf_case("qwen2 GGUF", "qwen2"),
            gguf_case("llama GGUF", "llama"),
        ];

        let tmp = tempfile::tempdir().unwrap();
        let mut requests = Vec::new();
        for (k, c) in cases.iter().enumerate() {
            let dir = tmp.path().join(format!("m{k}"));
            export_hf_folder_tensors(&dir, &c.config, &c.tensors, &c.tokenizer, &c.meta).unwrap();
            let config = read_json(&dir.join("config.json")).unwrap().unwrap();
            assert_eq!(config["model_type"], json!(c.model_type), "{}", c.name);
            let ids = c.tokenizer.encode(TEXTS[0]).unwrap();
            requests.push(
                json!({"dir": dir, "ids": ids, "texts": TEXTS, "steps": STEPS,
                "chat": c.chat}),
            );
        }
        let req = tmp.path().join("requests.json");
        let res = tmp.path().join("results.json");
        let script = tmp.path().join("load.py");
        std::fs::write(&req, serde_json::to_string(&requests).unwrap()).unwrap();
        std::fs::write(&script, TRANSFORMERS_SCRIPT).unwrap();
        let o = Command::new(&python)
            .arg(&script)
            .arg(&req)
            .arg(&res)
            .env("HF_HUB_OFFLINE", "1")
            .env("TRANSFORMERS_OFFLINE", "1")
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "transformers failed to load the exports:\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
        let results: Vec<Value> =
            serde_json::from_str(&std::fs::read_to_string(&res).unwrap()).unwrap();
        assert_eq!(results.len(), cases.len());
        for (k, (c, r)) in cases.iter().zip(&results).enumerate() {
            let name = format!("{} ({}, loaded as {})", c.name, c.model_type, r["class"]);
            let tok = &c.tokenizer;
            let encoded: Vec<Vec<u32>> = TEXTS.iter().map(|t| tok.encode(t).unwrap()).collect();
            let with_special: Vec<Vec<u32>> = TEXTS
                .iter()
                .map(|t| tok.inner().encode(*t, true).unwrap().get_ids().to_vec())
                .collect();
            for (i, text) in TEXTS.iter().enumerate() {
                assert_eq!(
                    r["encoded"][i],
                    json!(encoded[i]),
                    "{name}: ids of {text:?}"
                );
                assert_eq!(
                    r["encoded_special"][i],
                    json!(with_special[i]),
                    "{name}: ids of {text:?} with special tokens"
                );
            }
            // The model, as we run it and as turnwise reads the export back.
            let model = Transformer::from_tensors(&c.config, &c.tensors, c.name).unwrap();
            let dir = tmp.path().join(format!("m{k}"));
            let (config2, tensors2) = load_hf(&dir, DType::F32, &Device::Cpu).unwrap();
            assert_eq!(config2, c.config, "{name}: read back");
            let back = Transformer::from_tensors(&config2, &tensors2, "export").unwrap();
            let ids = &encoded[0];
            let mine = model
                .forward_sequence(ids)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            let again = back
                .forward_sequence(ids)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            assert_eq!(again, mine, "{name}: logits after reading the export back");
            let theirs: Vec<Vec<f32>> = serde_json::from_value(r["logits"].clone()).unwrap();
            assert_eq!(theirs.len(), mine.len());
            let mut max_diff = 0f32;
            for (a, b) in theirs.iter().zip(&mine) {
                assert_eq!(a.len(), b.len());
                for (x, y) in a.iter().zip(b) {
                    max_diff = max_diff.max((x - y).abs());
                }
            }
            let spread = mine[0].iter().fold(0f32, |m, x| m.max(x.abs()));
            assert!(spread > 0.1, "{name}: logits too flat to compare: {spread}");
            assert!(max_diff <= 1e-4, "{name}: logits differ by {max_diff}");
            eprintln!("{name}: same ids, greedy tokens; logits within {max_diff:.1e}");
            assert_eq!(
                r["greedy"],
                json!(greedy(&model, ids, STEPS)),
                "{name}: greedy"
            );
            if c.chat {
                let rendered = c.meta.chat_template().unwrap().unwrap();
                let rendered = rendered
                    .render(&[crate::tokenizer::ChatMessage::new("user", "hi")], true)
                    .unwrap();
                assert_eq!(r["chat"], json!(rendered), "{name}: chat template");
            }
            if c.meta.tokenizer_config.is_some() {
                assert_eq!(r["eos_token"], json!(c.meta.eos_token(tok)), "{name}");
            }
        }
        // A fresh model's generated files: EOS at the end of text or of a chat message.
        let eot = word.token_to_id(END_OF_TEXT).unwrap();
        let im_end = word.token_to_id(IM_END).unwrap();
        assert_eq!(results[0]["eos_token_id"], json!([eot, im_end]));
        assert_eq!(results[0]["eos_token"], json!(END_OF_TEXT));
    }
}
