//! Guards of the house's rules (ARCHITECTURE.md, "Principles"), read from the app crate's
//! source: the trainer names no method, and the app crate's modules import each other without a
//! cycle.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use turnwise_core::advantage::ESTIMATORS;
use turnwise_model::loss::policy::{POLICY_LOSS_NAMES, PolicyLossKind};

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let p = entry.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|e| e == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// The lines of `file` that are compiled into the crate outside its tests: the lines before the
/// file's first `#[cfg(test)]` (test modules sit at the end of a file), without comment lines.
/// Files that are test modules themselves (`tests.rs`, `*_tests.rs`) have none.
fn non_test_lines(file: &Path) -> Vec<(usize, String)> {
    let name = file.file_name().unwrap().to_string_lossy();
    if name == "tests.rs" || name.ends_with("_tests.rs") {
        return Vec::new();
    }
    std::fs::read_to_string(file)
        .unwrap()
        .lines()
        .enumerate()
        .take_while(|(_, l)| l.trim() != "#[cfg(test)]")
        .filter(|(_, l)| !l.trim_start().starts_with("//"))
        .map(|(i, l)| (i + 1, l.to_string()))
        .collect()
}

/// Where a line tests a method's name: a comparison with it, a match arm on it, or an
/// alternative of a `matches!` pattern (`== "gae"`, `"gae" =>`, `"igpo" | "a2tgpo"`).
fn tests_name(line: &str, name: &str) -> bool {
    let lit = format!("\"{name}\"");
    let Some(at) = line.find(&lit) else {
        return false;
    };
    let before = line[..at].trim_end();
    let after = line[at + lit.len()..].trim_start();
    before.ends_with("==")
        || before.ends_with("!=")
        || before.ends_with('|')
        || before.ends_with("matches!(")
        || after.starts_with("=>")
        || after.starts_with('|')
        || after.starts_with("if ")
        || line.matches(&lit).count() > 1 && tests_name(&line[at + lit.len()..], name)
}

/// The trainer names no method (issue 34, ARCHITECTURE.md): no code of the app crate outside
/// its registries tests an estimator's or a policy loss's name, or matches on their registry
/// enums' variants. What a part reads, implies and reports it declares
/// (`turnwise_core::advantage::Estimator`'s contract, `PolicyLossKind`'s table); the trainer,
/// sampling, config validation and the report read those declarations. The registries are the
/// places where names map to parts: `config/presets.rs` (presets by name).
#[test]
fn no_method_name_outside_registries() {
    let registries = [Path::new("config/presets.rs")];
    let mut names: BTreeSet<&str> = ESTIMATORS.iter().map(|(n, _)| *n).collect();
    names.extend(POLICY_LOSS_NAMES.iter().copied());
    names.extend(PolicyLossKind::ALL.iter().map(|k| k.name()));
    let variants = ["AdvantageConfig::", "PolicyLossKind::"];
    let root = src();
    let mut found = Vec::new();
    for file in rust_files(&root) {
        let rel = file.strip_prefix(&root).unwrap();
        if registries.contains(&rel) {
            continue;
        }
        for (n, line) in non_test_lines(&file) {
            for name in &names {
                if tests_name(&line, name) {
                    found.push(format!(
                        "{}:{n}: tests the name {name:?}: {}",
                        rel.display(),
                        line.trim()
                    ));
                }
            }
            for v in variants {
                // A variant (`AdvantageConfig::Gae`), not an associated function
                // (`AdvantageConfig::default_for`).
                if let Some(at) = line.find(v)
                    && line[at + v.len()..].starts_with(|c: char| c.is_ascii_uppercase())
                {
                    found.push(format!(
                        "{}:{n}: names a variant: {}",
                        rel.display(),
                        line.trim()
                    ));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "the app crate tests method names outside its registries (declare what the trainer \
         needs in the part's contract instead):\n{}",
        found.join("\n")
    );
}

/// The guard sees what it guards: a name test of each kind the trainer used to hold is caught,
/// and names inside other strings or in comments are not.
#[test]
fn the_name_guard_catches_name_tests() {
    for line in [
        r#"    if name == "gae" {"#,
        r#"            "mt_grpo" | "mt_grpo_code" => turn_rewards[i].clone(),"#,
        r#"    if matches!(name, "igpo" | "a2tgpo") {"#,
        r#"        let filter = x && !matches!(estimator, "at2po" | "tree_grpo");"#,
        r#"            "gigpo" | "t2po" if t2po_steps => turn_rewards[i].clone(),"#,
        r#"    use_clip_scale: kind.name() == "a2tgpo","#,
    ] {
        assert!(
            ["gae", "mt_grpo", "igpo", "a2tgpo", "at2po", "gigpo"]
                .iter()
                .any(|n| tests_name(line, n)),
            "{line}"
        );
    }
    for line in [
        r#"        m.insert("mt_grpo/turn_credit/abs_mean".into(), x);"#,
        r#"    let p = Path::new("grpo");"#,
    ] {
        assert!(
            !["mt_grpo", "grpo"].iter().any(|n| tests_name(line, n)),
            "{line}"
        );
    }
}

/// The top-level module of the app crate that `path` (relative to `src/`) belongs to.
fn module_of(path: &Path) -> String {
    let first = path
        .components()
        .next()
        .unwrap()
        .as_os_str()
        .to_string_lossy();
    first.trim_end_matches(".rs").to_string()
}

/// The top-level modules of the crate that `line` imports or names (`crate::trainer::…`,
/// `use crate::{run, task}`).
fn referenced_modules(line: &str, modules: &BTreeSet<String>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = line;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for part in group[..end].split(',') {
                let m = part.trim().split("::").next().unwrap_or("").trim();
                if modules.contains(m) {
                    out.insert(m.to_string());
                }
            }
        } else {
            let m: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if modules.contains(&m) {
                out.insert(m);
            }
        }
    }
    out
}

/// The app crate's top-level modules (`src/<m>.rs`, `src/<m>/`) import each other without a
/// cycle (issue 34: the data flow reads one way, task → rollout → trainer → run, and a module
/// can be understood from the ones below it). `lib.rs` and `main.rs` sit above all.
#[test]
fn no_import_cycle_between_app_modules() {
    let root = src();
    let files = rust_files(&root);
    let modules: BTreeSet<String> = files
        .iter()
        .map(|f| module_of(f.strip_prefix(&root).unwrap()))
        .filter(|m| m != "lib" && m != "main")
        .collect();
    let mut edges: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for file in &files {
        let rel = file.strip_prefix(&root).unwrap();
        let from = module_of(rel);
        if !modules.contains(&from) {
            continue;
        }
        for (n, line) in non_test_lines(file) {
            for to in referenced_modules(&line, &modules) {
                if to != from {
                    edges
                        .entry(from.clone())
                        .or_default()
                        .entry(to)
                        .or_insert_with(|| format!("{}:{n}", rel.display()));
                }
            }
        }
    }
    // Every cycle shows as a strongly connected component of more than one module.
    let mut cycles = Vec::new();
    for a in &modules {
        for (b, at_ab) in edges.get(a).into_iter().flatten() {
            if a < b
                && let Some(path) = path_between(&edges, b, a)
            {
                cycles.push(format!("{a} → {b} ({at_ab}) and back: {}", path.join(", ")));
            }
        }
    }
    assert!(
        cycles.is_empty(),
        "import cycles in the app crate:\n{}",
        cycles.join("\n")
    );
}

/// A chain of imports from `from` to `to` (each step with the line that makes it), if any.
fn path_between(
    edges: &BTreeMap<String, BTreeMap<String, String>>,
    from: &str,
    to: &str,
) -> Option<Vec<String>> {
    let mut seen = BTreeSet::new();
    let mut stack = vec![(from.to_string(), Vec::new())];
    while let Some((m, path)) = stack.pop() {
        if m == to {
            return Some(path);
        }
        if !seen.insert(m.clone()) {
            continue;
        }
        for (next, at) in edges.get(&m).into_iter().flatten() {
            let mut p = path.clone();
            p.push(format!("{m} → {next} ({at})"));
            stack.push((next.clone(), p));
        }
    }
    None
}
