//! docs/config.md, the config reference, is generated from the config structs themselves: their
//! doc comments (read from the crates' sources with `syn`), their serde shapes (renames,
//! flattened and tagged parts), and the values of `TrainConfig::default()`. This test fails when
//! the committed file differs from what the code says; `TURNWISE_BLESS=1 cargo test -p turnwise
//! --test config_reference` rewrites it.
//!
//! A range a doc comment states ("in [0, 1]", "in [0, 1)", "Range 1..=1024", "at least N") is
//! shown in the reference and checked against the validation: a value just outside is refused
//! naming the key, the bounds inside are accepted.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use quote::ToTokens;
use turnwise::config::TrainConfig;

/// One field of a struct, as serde sees it.
#[derive(Debug, Clone)]
struct Field {
    name: String,
    doc: String,
    ty: syn::Type,
    flatten: bool,
}

/// One variant of an enum.
#[derive(Debug, Clone)]
struct Variant {
    name: String,
    doc: String,
    inner: Option<syn::Type>,
}

#[derive(Debug, Clone)]
enum Item {
    /// A type serde reads from a string (`#[serde(try_from = "String")]`).
    Text,
    Struct {
        doc: String,
        fields: Vec<Field>,
    },
    Enum {
        /// `#[serde(tag = …)]` (or the remote-tagged reward).
        tag: Option<String>,
        variants: Vec<Variant>,
    },
}

fn doc_of(attrs: &[syn::Attribute]) -> String {
    let mut lines = Vec::new();
    for a in attrs {
        if !a.path().is_ident("doc") {
            continue;
        }
        if let syn::Meta::NameValue(nv) = &a.meta
            && let syn::Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Str(s),
                ..
            }) = &nv.value
        {
            lines.push(s.value().trim().to_owned());
        }
    }
    // The first paragraph; later ones are implementation notes.
    let text = lines.join("\n");
    let para = text.split("\n\n").next().unwrap_or("").replace('\n', " ");
    // Intra-doc links read as plain code in markdown.
    let mut out = String::new();
    let mut rest = para.as_str();
    while let Some(i) = rest.find("[`") {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        let Some(close) = after.find("`]") else {
            out.push_str(&rest[i..]);
            rest = "";
            break;
        };
        out.push_str(&after[..close + 1]);
        rest = &after[close + 2..];
        // Drop a reference target `(...)` right after.
        if rest.starts_with('(')
            && let Some(end) = rest.find(')')
        {
            rest = &rest[end + 1..];
        }
    }
    out.push_str(rest);
    out.replace('|', "\\|")
}

/// `#[serde(...)]` name = value pairs and bare words of `attrs`.
fn serde_args(attrs: &[syn::Attribute]) -> (BTreeMap<String, String>, BTreeSet<String>) {
    let mut kv = BTreeMap::new();
    let mut words = BTreeSet::new();
    for a in attrs {
        if !a.path().is_ident("serde") {
            continue;
        }
        let _ = a.parse_nested_meta(|m| {
            let key = m.path.to_token_stream().to_string();
            if m.input.peek(syn::Token![=]) {
                let v: syn::Expr = m.value()?.parse()?;
                if let syn::Expr::Lit(syn::ExprLit {
                    lit: syn::Lit::Str(s),
                    ..
                }) = v
                {
                    kv.insert(key, s.value());
                }
            } else {
                words.insert(key);
            }
            Ok(())
        });
    }
    (kv, words)
}

fn rename(name: &str, rule: Option<&String>) -> String {
    match rule.map(String::as_str) {
        Some("snake_case") => {
            let mut out = String::new();
            for (i, c) in name.chars().enumerate() {
                if c.is_uppercase() {
                    if i > 0 {
                        out.push('_');
                    }
                    out.extend(c.to_lowercase());
                } else {
                    out.push(c);
                }
            }
            out
        }
        Some("lowercase") => name.to_lowercase(),
        _ => name.to_owned(),
    }
}

/// Every struct and enum of the workspace's crates, by name (the first definition of a name
/// deriving `Deserialize` wins).
fn items() -> BTreeMap<String, Item> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut files = Vec::new();
    for krate in [
        "turnwise",
        "turnwise-core",
        "turnwise-env",
        "turnwise-model",
    ] {
        collect_rs(&root.join("crates").join(krate).join("src"), &mut files);
    }
    let mut out = BTreeMap::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let Ok(file) = syn::parse_file(&text) else {
            continue;
        };
        walk_items(&file.items, &mut out);
    }
    out
}

fn collect_rs(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            collect_rs(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

fn derives_deserialize(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("derive") && a.to_token_stream().to_string().contains("Deserialize")
    })
}

fn walk_items(items: &[syn::Item], out: &mut BTreeMap<String, Item>) {
    for item in items {
        match item {
            syn::Item::Mod(m) => {
                if let Some((_, inner)) = &m.content {
                    walk_items(inner, out);
                }
            }
            syn::Item::Struct(s) if derives_deserialize(&s.attrs) => {
                let (kv, _) = serde_args(&s.attrs);
                if kv
                    .get("try_from")
                    .or(kv.get("from"))
                    .is_some_and(|t| t == "String")
                {
                    out.entry(s.ident.to_string()).or_insert(Item::Text);
                    continue;
                }
                let syn::Fields::Named(named) = &s.fields else {
                    continue;
                };
                let fields = named
                    .named
                    .iter()
                    .filter_map(|f| {
                        let (fkv, words) = serde_args(&f.attrs);
                        if words.contains("skip") || words.contains("skip_deserializing") {
                            return None;
                        }
                        let ident = f.ident.as_ref().unwrap().to_string();
                        Some(Field {
                            name: fkv
                                .get("rename")
                                .cloned()
                                .unwrap_or_else(|| rename(&ident, kv.get("rename_all"))),
                            doc: doc_of(&f.attrs),
                            ty: f.ty.clone(),
                            flatten: words.contains("flatten"),
                        })
                    })
                    .collect();
                out.entry(s.ident.to_string()).or_insert(Item::Struct {
                    doc: doc_of(&s.attrs),
                    fields,
                });
            }
            syn::Item::Enum(e) if derives_deserialize(&e.attrs) => {
                let (kv, _) = serde_args(&e.attrs);
                let variants = e
                    .variants
                    .iter()
                    .filter(|v| {
                        let (_, words) = serde_args(&v.attrs);
                        !words.contains("skip")
                    })
                    .map(|v| {
                        let (vkv, _) = serde_args(&v.attrs);
                        let inner = match &v.fields {
                            syn::Fields::Unnamed(u) if u.unnamed.len() == 1 => {
                                Some(u.unnamed[0].ty.clone())
                            }
                            _ => None,
                        };
                        Variant {
                            name: vkv.get("rename").cloned().unwrap_or_else(|| {
                                rename(&v.ident.to_string(), kv.get("rename_all"))
                            }),
                            doc: doc_of(&v.attrs),
                            inner,
                        }
                    })
                    .collect();
                out.entry(e.ident.to_string()).or_insert(Item::Enum {
                    tag: kv.get("tag").cloned(),
                    variants,
                });
            }
            _ => {}
        }
    }
}

/// The last path segment of a type and its generic arguments.
fn head(ty: &syn::Type) -> Option<(String, Vec<syn::Type>)> {
    let syn::Type::Path(p) = ty else {
        return None;
    };
    let seg = p.path.segments.last()?;
    let args = match &seg.arguments {
        syn::PathArguments::AngleBracketed(a) => a
            .args
            .iter()
            .filter_map(|g| match g {
                syn::GenericArgument::Type(t) => Some(t.clone()),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    Some((seg.ident.to_string(), args))
}

/// One key of the reference.
#[derive(Debug, Clone)]
struct Row {
    key: String,
    ty: String,
    default: String,
    range: String,
    doc: String,
    /// `advantage.estimator = "gae"`: the key exists only then.
    when: Option<String>,
}

/// A table of the reference: its dotted name, doc and keys.
#[derive(Debug, Default)]
struct Section {
    doc: String,
    rows: Vec<Row>,
}

struct Walker<'a> {
    items: &'a BTreeMap<String, Item>,
    sections: BTreeMap<String, Section>,
    order: Vec<String>,
}

fn show_value(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => format!("`\"{s}\"`"),
        toml::Value::Table(t) if t.is_empty() => "`{}`".into(),
        toml::Value::Array(a) if a.is_empty() => "`[]`".into(),
        other => {
            let s = other.to_string();
            if s.len() > 40 {
                "(see the preset)".into()
            } else {
                format!("`{s}`")
            }
        }
    }
}

/// A range the doc comment states, in the reference's notation: an interval ("in [0, 1)"),
/// an integer range ("1..=1024"), or a one-sided bound ("Range: > 0.", "Range: ≥ 1.").
fn doc_range(doc: &str) -> Option<String> {
    if let Some(i) = doc.find("Range: ") {
        let rest = &doc[i + "Range: ".len()..];
        let end = rest.find(". ").unwrap_or(rest.len());
        let r = rest[..end].trim_end_matches('.').trim();
        if r.starts_with("> ") || r.starts_with("≥ ") {
            return Some(r.to_owned());
        }
    }
    if let Some(i) = doc.find("..=") {
        let start = doc[..i]
            .rfind(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-'))
            .map_or(0, |j| j + 1);
        let end = doc[i + 3..]
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .map_or(doc.len(), |j| i + 3 + j);
        let r = doc[start..end].trim_end_matches('.');
        if start < i && end > i + 3 {
            return Some(r.to_owned());
        }
    }
    for pat in [" in [", " in ("] {
        if let Some(i) = doc.find(pat) {
            let rest = &doc[i + pat.len() - 1..];
            let close = rest.find([']', ')'])?;
            let r = &rest[..=close];
            if r.contains(',') && r.len() < 24 {
                return Some(r.to_owned());
            }
        }
    }
    None
}

/// The verl (`ppo_trainer.yaml`, `actor_rollout_ref.` left out) and TRL (`GRPOConfig`) names of
/// keys whose doc comments do not give them; the test fails when a key here leaves the config.
const FOREIGN: &[(&str, &str)] = &[
    ("seed", "TRL `seed`"),
    (
        "rollout.group_size",
        "verl `rollout.n`, TRL `num_generations`",
    ),
    ("rollout.prompts_per_step", "verl `data.train_batch_size`"),
    (
        "rollout.temperature",
        "verl `rollout.temperature`, TRL `temperature`",
    ),
    ("rollout.top_p", "verl `rollout.top_p`, TRL `top_p`"),
    ("rollout.top_k", "verl `rollout.top_k`, TRL `top_k`"),
    (
        "rollout.max_response_tokens",
        "verl `data.max_response_length`, TRL `max_completion_length`",
    ),
    (
        "rollout.filter_zero_variance_groups",
        "verl `algorithm.filter_groups.enable`",
    ),
    (
        "rollout.max_num_gen_batches",
        "verl `algorithm.filter_groups.max_num_gen_batches`",
    ),
    (
        "rollout.filter_metric",
        "verl `algorithm.filter_groups.metric`",
    ),
    (
        "task.max_turns",
        "verl `rollout.multi_turn.max_assistant_turns`",
    ),
    ("optim.lr", "verl `actor.optim.lr`, TRL `learning_rate`"),
    ("optim.warmup_steps", "TRL `warmup_steps`"),
    ("optim.lr_schedule", "TRL `lr_scheduler_type`"),
    (
        "optim.weight_decay",
        "verl `actor.optim.weight_decay`, TRL `weight_decay`",
    ),
    (
        "optim.beta1",
        "verl `actor.optim.betas[0]`, TRL `adam_beta1`",
    ),
    (
        "optim.beta2",
        "verl `actor.optim.betas[1]`, TRL `adam_beta2`",
    ),
    (
        "optim.grad_clip",
        "verl `actor.grad_clip`, TRL `max_grad_norm`",
    ),
    (
        "optim.ppo_epochs",
        "verl `actor.ppo_epochs`, TRL `num_iterations`",
    ),
    (
        "optim.mini_batch_size",
        "verl `actor.ppo_mini_batch_size` (in prompts there)",
    ),
    (
        "optim.micro_batch_size",
        "verl `actor.ppo_micro_batch_size_per_gpu`",
    ),
    (
        "actor.policy.clip_ratio",
        "verl `actor.clip_ratio`, TRL `epsilon`",
    ),
    (
        "actor.policy.clip_ratio_low",
        "verl `actor.clip_ratio_low`, TRL `epsilon`",
    ),
    (
        "actor.policy.clip_ratio_high",
        "verl `actor.clip_ratio_high`, TRL `epsilon_high`",
    ),
    ("actor.policy.clip_ratio_c", "verl `actor.clip_ratio_c`"),
    (
        "actor.policy.loss_agg_mode",
        "verl `actor.loss_agg_mode`, TRL `loss_type`",
    ),
    (
        "actor.policy.policy_loss",
        "verl `actor.policy_loss.loss_mode`",
    ),
    ("actor.use_kl_loss", "verl `actor.use_kl_loss`"),
    (
        "actor.kl_loss_coef",
        "verl `actor.kl_loss_coef`, TRL `beta`",
    ),
    ("actor.kl_loss_type", "verl `actor.kl_loss_type`"),
    ("actor.entropy_coeff", "verl `actor.entropy_coeff`"),
    (
        "algorithm.use_kl_in_reward",
        "verl `algorithm.use_kl_in_reward`",
    ),
    ("advantage.estimator", "verl `algorithm.adv_estimator`"),
    ("critic.lr", "verl `critic.optim.lr`"),
    ("critic.cliprange_value", "verl `critic.cliprange_value`"),
    (
        "overlong_buffer.enable",
        "verl `reward_model.overlong_buffer.enable`",
    ),
    (
        "overlong_buffer.len",
        "verl `reward_model.overlong_buffer.len`",
    ),
    (
        "overlong_buffer.penalty_factor",
        "verl `reward_model.overlong_buffer.penalty_factor`",
    ),
    ("model.lora.rank", "verl `model.lora_rank`, PEFT `r`"),
    (
        "model.lora.alpha",
        "verl `model.lora_alpha`, PEFT `lora_alpha`",
    ),
    (
        "run.steps",
        "verl `trainer.total_training_steps`, TRL `max_steps`",
    ),
    (
        "run.save_every",
        "verl `trainer.save_freq`, TRL `save_steps`",
    ),
    ("eval.every", "verl `trainer.test_freq`, TRL `eval_steps`"),
];

/// verl's or TRL's name of a key: [`FOREIGN`]'s, else as the doc comment gives it.
fn foreign_names_of(key: &str, doc: &str) -> String {
    if let Some((_, names)) = FOREIGN.iter().find(|(k, _)| *k == key) {
        return (*names).to_owned();
    }
    foreign_names(doc)
}

/// verl's or TRL's name of a key, as the doc comment gives it.
fn foreign_names(doc: &str) -> String {
    let mut out = Vec::new();
    for who in ["verl", "verl's", "TRL", "TRL's", "PEFT's", "Search-R1's"] {
        let pat = format!("{who} `");
        let mut rest = doc;
        while let Some(i) = rest.find(&pat) {
            let after = &rest[i + pat.len()..];
            let Some(end) = after.find('`') else { break };
            let name = who.trim_end_matches("'s");
            out.push(format!("{name} `{}`", &after[..end]));
            rest = &after[end..];
        }
    }
    out.dedup();
    out.join(", ")
}

impl Walker<'_> {
    fn section(&mut self, name: &str, doc: &str) {
        if !self.sections.contains_key(name) {
            self.order.push(name.to_owned());
        }
        let s = self.sections.entry(name.to_owned()).or_default();
        if s.doc.is_empty() {
            s.doc = doc.to_owned();
        }
    }

    fn row(&mut self, table: &str, row: Row) {
        self.section(table, "");
        self.sections.get_mut(table).unwrap().rows.push(row);
    }

    /// Walks the fields of struct `name` whose keys live in table `table` (dotted, "" at the
    /// top) with defaults under `defaults_at` in `defaults`.
    fn walk_struct(&mut self, name: &str, table: &str, defaults: &toml::Value, when: Option<&str>) {
        let Some(Item::Struct { fields, .. }) = self.items.get(name).cloned() else {
            panic!("no struct {name} in the sources")
        };
        for f in fields {
            if f.flatten {
                if let Some((inner, _)) = head(&f.ty)
                    && matches!(self.items.get(&inner), Some(Item::Struct { .. }))
                {
                    self.walk_struct(&inner, table, defaults, when);
                }
                continue;
            }
            let key = if table.is_empty() {
                f.name.clone()
            } else {
                format!("{table}.{}", f.name)
            };
            let d = defaults.get(&f.name).cloned();
            self.walk_type(&f.ty, &key, table, &f.doc, d, when, false);
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn walk_type(
        &mut self,
        ty: &syn::Type,
        key: &str,
        table: &str,
        doc: &str,
        default: Option<toml::Value>,
        when: Option<&str>,
        optional: bool,
    ) {
        let (h, args) = head(ty).unwrap_or_else(|| (ty.to_token_stream().to_string(), vec![]));
        let leaf = |ty: String, this: &mut Self| {
            let row = Row {
                key: key.to_owned(),
                ty,
                default: default
                    .as_ref()
                    .map_or_else(|| "unset".to_owned(), show_value),
                range: doc_range(doc).unwrap_or_default(),
                doc: doc.to_owned(),
                when: when.map(str::to_owned),
            };
            this.row(table, row);
        };
        match h.as_str() {
            "Option" | "Box" => {
                self.walk_type(&args[0], key, table, doc, default, when, true);
            }
            "f64" | "f32" => leaf("float".into(), self),
            "u64" | "u32" | "usize" | "u8" | "u16" => leaf("integer ≥ 0".into(), self),
            "i64" | "i32" | "isize" => leaf("integer".into(), self),
            "bool" => leaf("bool".into(), self),
            "String" => leaf("string".into(), self),
            "PathBuf" => leaf("path".into(), self),
            "Vec" => {
                let inner = head(&args[0]).map(|(h, _)| h).unwrap_or_default();
                let t = match inner.as_str() {
                    "String" => "list of strings".to_owned(),
                    "usize" | "u64" | "u32" => "list of integers".to_owned(),
                    "f64" | "f32" => "list of floats".to_owned(),
                    other => format!("list of {}", self.describe(other)),
                };
                leaf(t, self)
            }
            "BTreeMap" | "HashMap" => {
                let inner = head(&args[1]).map(|(h, _)| h).unwrap_or_default();
                leaf(format!("table of {}", self.describe(&inner)), self)
            }
            other => match self.items.get(other).cloned() {
                Some(Item::Text) => leaf("string".into(), self),
                Some(Item::Struct { doc: sdoc, .. }) => {
                    let d = if doc.is_empty() { sdoc } else { doc.to_owned() };
                    let d = if optional {
                        format!("{d} (optional table: absent unless set)")
                    } else {
                        d
                    };
                    self.section(key, &d);
                    let defaults = default.unwrap_or(toml::Value::Table(Default::default()));
                    self.walk_struct(other, key, &defaults, when);
                }
                Some(Item::Enum { tag, variants, .. }) => {
                    let tagged = tag.clone().or_else(|| {
                        // The reward's remote-tagged enum (`name`), written with a custom
                        // Deserialize that also takes a bare string.
                        (other == "RewardConfig").then(|| "name".to_owned())
                    });
                    match tagged {
                        Some(tag) if variants.iter().any(|v| v.inner.is_some()) => {
                            self.section(key, doc);
                            let names: Vec<String> =
                                variants.iter().map(|v| format!("`{}`", v.name)).collect();
                            let tag_key = format!("{key}.{tag}");
                            let tag_default = default.as_ref().and_then(|d| d.get(&tag)).cloned();
                            self.row(
                                key,
                                Row {
                                    key: tag_key.clone(),
                                    ty: format!("one of {}", names.join(", ")),
                                    default: tag_default
                                        .as_ref()
                                        .map_or_else(|| "unset".into(), show_value),
                                    range: String::new(),
                                    doc: variants
                                        .iter()
                                        .map(|v| format!("`{}`: {}", v.name, v.doc))
                                        .collect::<Vec<_>>()
                                        .join(" "),
                                    when: when.map(str::to_owned),
                                },
                            );
                            for v in &variants {
                                let Some(inner) = &v.inner else { continue };
                                let Some((iname, _)) = head(inner) else {
                                    continue;
                                };
                                let cond = format!("{tag_key} = \"{}\"", v.name);
                                let d = variant_defaults(other, &v.name)
                                    .unwrap_or(toml::Value::Table(Default::default()));
                                if matches!(self.items.get(&iname), Some(Item::Struct { .. })) {
                                    self.walk_struct(&iname, key, &d, Some(&cond));
                                }
                            }
                        }
                        _ => {
                            let names: Vec<String> =
                                variants.iter().map(|v| format!("`{}`", v.name)).collect();
                            let vdoc: Vec<String> = variants
                                .iter()
                                .filter(|v| !v.doc.is_empty())
                                .map(|v| format!("`{}`: {}", v.name, v.doc))
                                .collect();
                            let doc = if vdoc.is_empty() {
                                doc.to_owned()
                            } else {
                                format!("{doc} {}", vdoc.join(" "))
                            };
                            let row = Row {
                                key: key.to_owned(),
                                ty: format!("one of {}", names.join(", ")),
                                default: default
                                    .as_ref()
                                    .map_or_else(|| "unset".to_owned(), show_value),
                                range: String::new(),
                                doc,
                                when: when.map(str::to_owned),
                            };
                            self.row(table, row);
                        }
                    }
                }
                None => leaf(format!("`{other}`"), self),
            },
        }
    }

    fn describe(&self, name: &str) -> String {
        match self.items.get(name) {
            Some(Item::Enum { variants, .. }) => {
                let names: Vec<String> = variants.iter().map(|v| format!("`{}`", v.name)).collect();
                format!("one of {}", names.join(", "))
            }
            Some(Item::Struct { fields, .. }) => {
                let names: Vec<String> = fields.iter().map(|f| format!("`{}`", f.name)).collect();
                format!("tables with {}", names.join(", "))
            }
            Some(Item::Text) | None => format!("`{name}`"),
        }
    }
}

/// The defaults of one variant of a tagged config enum (its settings when the user names only
/// the tag).
fn variant_defaults(enum_name: &str, variant: &str) -> Option<toml::Value> {
    let doc = match enum_name {
        "AdvantageConfig" => {
            let c: turnwise_core::advantage::AdvantageConfig =
                toml::from_str(&format!("estimator = \"{variant}\"")).ok()?;
            toml::Value::try_from(c).ok()?
        }
        "RewardConfig" => {
            let c: turnwise_core::reward::RewardConfig =
                toml::from_str(&format!("name = \"{variant}\"")).ok()?;
            toml::Value::try_from(c).ok()?
        }
        _ => return None,
    };
    Some(doc)
}

/// The reference's tables in the order they were met, walking `TrainConfig` from its defaults.
fn sections() -> (Vec<String>, BTreeMap<String, Section>) {
    let items = items();
    let defaults = toml::Value::try_from(TrainConfig::default()).unwrap();
    let mut w = Walker {
        items: &items,
        sections: BTreeMap::new(),
        order: Vec::new(),
    };
    w.section("", "");
    w.walk_struct("TrainConfig", "", &defaults, None);
    (w.order, w.sections)
}

fn generate() -> String {
    let (order, sections) = sections();
    let mut out = String::from(
        "# Configuration reference\n\n\
         <!-- Generated by crates/turnwise/tests/config_reference.rs from the config structs' doc \
         comments and TrainConfig::default(); do not edit by hand. Regenerate with \
         `TURNWISE_BLESS=1 cargo test -p turnwise --test config_reference`. -->\n\n\
         Every key of a training config (`turnwise train --config FILE`, `--set key=value`), by \
         table. Defaults are those of a config that names no preset; a preset \
         (`presets/*.toml`, `turnwise config --preset NAME` prints its resolved settings) \
         overrides some of them. Keys marked *when …* exist only for that choice of a tagged \
         table (an estimator's or a reward's own settings). The range column gives the range \
         the key's documentation states, which the validation enforces (checked by the test \
         that generates this file). The last column is the key's name in verl or TRL where \
         its documentation gives one.\n\n\
         Counting conventions that differ from verl: `optim.mini_batch_size` and \
         `optim.micro_batch_size` count rollouts (trajectories, or environment steps with \
         `optim.samples = \"step\"`), where verl's `ppo_mini_batch_size` counts prompts; \
         `rollout.group_size` is verl's `rollout.n`.\n",
    );
    for name in &order {
        let s = &sections[name];
        if s.rows.is_empty() {
            continue;
        }
        let title = if name.is_empty() {
            "Top level".to_owned()
        } else {
            format!("`[{name}]`")
        };
        let _ = writeln!(out, "\n## {title}\n");
        if !s.doc.is_empty() {
            let _ = writeln!(out, "{}\n", s.doc.replace("\\|", "|"));
        }
        out.push_str("| key | type | default | range | meaning | verl / TRL |\n");
        out.push_str("|---|---|---|---|---|---|\n");
        for r in &s.rows {
            let doc = match &r.when {
                Some(c) => format!("*when `{c}`*: {}", r.doc),
                None => r.doc.clone(),
            };
            let _ = writeln!(
                out,
                "| `{}` | {} | {} | {} | {} | {} |",
                r.key,
                r.ty,
                r.default,
                if r.range.is_empty() {
                    String::new()
                } else {
                    format!("`{}`", r.range)
                },
                doc,
                foreign_names_of(&r.key, &r.doc)
            );
        }
    }
    out
}

fn reference_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/config.md")
}

#[test]
fn docs_config_md_is_up_to_date() {
    let text = generate();
    let path = reference_path();
    if std::env::var_os("TURNWISE_BLESS").is_some() {
        std::fs::write(&path, &text).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed != text {
        let first = committed
            .lines()
            .zip(text.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(committed.lines().count().min(text.lines().count()));
        panic!(
            "docs/config.md is out of date with the config structs (first difference at line {}: \
             committed {:?}, generated {:?}); regenerate it with \
             `TURNWISE_BLESS=1 cargo test -p turnwise --test config_reference`",
            first + 1,
            committed.lines().nth(first),
            text.lines().nth(first)
        );
    }
}

/// Every key of `TrainConfig::default()` is in the reference, so nothing a user can set is
/// undocumented, and every key of the verl/TRL name table is a key of the config.
#[test]
fn every_default_key_is_documented() {
    let text = generate();
    for (key, _) in FOREIGN {
        assert!(
            text.contains(&format!("| `{key}` |")),
            "FOREIGN names {key}, which the config no longer has"
        );
    }
    fn leaves(prefix: &str, v: &toml::Value, out: &mut Vec<String>) {
        match v {
            toml::Value::Table(t) if !t.is_empty() => {
                for (k, v) in t {
                    let key = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    leaves(&key, v, out);
                }
            }
            _ => out.push(prefix.to_owned()),
        }
    }
    let mut keys = Vec::new();
    leaves(
        "",
        &toml::Value::try_from(TrainConfig::default()).unwrap(),
        &mut keys,
    );
    let missing: Vec<&String> = keys
        .iter()
        .filter(|k| !text.contains(&format!("| `{k}` |")))
        .collect();
    assert!(
        missing.is_empty(),
        "keys missing from the reference: {missing:?}"
    );
}

/// A bound of a stated range: its value and whether it is included.
fn bounds(range: &str) -> Option<((f64, bool), (f64, bool))> {
    if let Some(lo) = range.strip_prefix("> ") {
        return Some(((lo.parse().ok()?, false), (f64::INFINITY, false)));
    }
    if let Some(lo) = range.strip_prefix("≥ ") {
        return Some(((lo.parse().ok()?, true), (f64::INFINITY, false)));
    }
    if let Some((lo, hi)) = range.split_once("..=") {
        return Some(((lo.parse().ok()?, true), (hi.parse().ok()?, true)));
    }
    let lo_incl = range.starts_with('[');
    let hi_incl = range.ends_with(']');
    let inner = &range[1..range.len() - 1];
    let (lo, hi) = inner.split_once(',')?;
    Some((
        (lo.trim().parse().ok()?, lo_incl),
        (hi.trim().parse().ok()?, hi_incl),
    ))
}

/// Each stated range is the validation's: just outside either end is refused naming the key,
/// the included ends are accepted.
#[test]
fn stated_ranges_are_enforced() {
    let rows: Vec<Row> = sections()
        .1
        .into_values()
        .flat_map(|s| s.rows)
        .filter(|r| r.when.is_none() && !r.range.is_empty())
        .collect();
    assert!(rows.len() >= 5, "too few stated ranges: {rows:?}");
    let mut checked = 0;
    for r in &rows {
        let Some(((lo, lo_in), (hi, hi_in))) = bounds(&r.range) else {
            panic!("{}: cannot read the range {:?}", r.key, r.range)
        };
        let integer = r.ty.starts_with("integer");
        let fmt = |x: f64| {
            if integer {
                format!("{}", x as i64)
            } else {
                format!("{x:?}")
            }
        };
        let step = if integer {
            1.0
        } else {
            1e-9_f64.max(hi.abs() * 1e-9)
        };
        // Settings checked only where they apply: a game's under its environment.
        let context: &[&str] = match r.key.as_str() {
            "task.game.room_size" | "task.game.num_boxes" => &["task.env=\"sokoban\""],
            k if k.starts_with("task.game.") => &["task.env=\"frozen_lake\""],
            _ => &[],
        };
        let resolve = |x: f64| {
            let mut sets: Vec<String> = context.iter().map(|s| s.to_string()).collect();
            sets.push(format!("{}={}", r.key, fmt(x)));
            TrainConfig::resolve(None, None, &sets)
        };
        let outside = [
            if lo_in { lo - step } else { lo },
            if hi_in { hi + step } else { hi },
        ];
        for x in outside {
            if (integer && x < 0.0 && r.ty == "integer ≥ 0") || x.is_infinite() {
                continue;
            }
            let e =
                resolve(x).expect_err(&format!("{} = {} is outside {}", r.key, fmt(x), r.range));
            assert!(
                e.to_string().contains(&r.key),
                "{} = {}: the error does not name the key: {e}",
                r.key,
                fmt(x)
            );
        }
        // An open lower end of a one-sided range: just above it is accepted.
        let above = if integer { lo + 1.0 } else { lo + 1e-3 };
        for (x, inside) in [
            (lo, lo_in),
            (hi, hi_in),
            (above, hi.is_infinite() && !lo_in),
        ] {
            if inside {
                resolve(x).unwrap_or_else(|e| {
                    panic!("{} = {} is inside {}: {e}", r.key, fmt(x), r.range)
                });
            }
        }
        checked += 1;
    }
    assert!(checked >= 5);
}
