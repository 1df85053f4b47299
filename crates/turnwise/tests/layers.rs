//! The app crate's stages import only earlier stages (ARCHITECTURE.md, "Layers point down"):
//! the back arrows that the import-cycle test allows, because they close no cycle, are named
//! here and refused. Issue 53 removed them one by one; each removed arrow is listed in
//! `BACK_ARROWS`.

use std::path::{Path, PathBuf};

/// `(module, module it must not import)`: an earlier stage of task → rollout → reward →
/// advantage → update and a later one; `config` (read by every stage) and `run` (the run
/// directory, written last); or the training loop and the policy server built on it (the
/// trainer starts served policies through `rollout::host::PolicyHost`).
const BACK_ARROWS: &[(&str, &str)] = &[
    ("task", "rollout"),
    ("rollout", "update"),
    ("config", "run"),
    ("trainer", "serve"),
];

/// The files of top-level module `m`: `src/m.rs` and everything under `src/m/`.
fn files_of(m: &str) -> Vec<PathBuf> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out = vec![src.join(format!("{m}.rs"))];
    let mut stack = vec![src.join(m)];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.retain(|p| p.is_file());
    out
}

/// Where `text` (a file's code before its tests, comments left out) names module `to` of the
/// crate: `crate::to::…`, `crate::to;` or `to` inside `use crate::{…}`.
fn imports(text: &str, to: &str) -> bool {
    let mut rest = text;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        let names: Vec<&str> = match rest.strip_prefix('{') {
            Some(group) => group[..group.find('}').unwrap_or(group.len())]
                .split(',')
                .map(|p| p.trim().split("::").next().unwrap_or("").trim())
                .collect(),
            None => vec![
                rest.split(|c: char| !c.is_alphanumeric() && c != '_')
                    .next()
                    .unwrap(),
            ],
        };
        if names.contains(&to) {
            return true;
        }
    }
    false
}

/// A file's code outside its test module, without comment lines.
fn code(file: &Path) -> String {
    std::fs::read_to_string(file)
        .unwrap()
        .lines()
        .take_while(|l| l.trim() != "#[cfg(test)]")
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn no_stage_imports_a_later_stage() {
    let mut found = Vec::new();
    for (from, to) in BACK_ARROWS {
        let files = files_of(from);
        assert!(!files.is_empty(), "no module {from}");
        for f in files {
            if imports(&code(&f), to) {
                found.push(format!("{} imports crate::{to}", f.display()));
            }
        }
    }
    assert!(found.is_empty(), "back arrows:\n{}", found.join("\n"));
}

#[test]
fn the_import_reader_sees_paths_and_groups() {
    assert!(imports("use crate::rollout::Episode;", "rollout"));
    assert!(imports(
        "let t = crate::rollout::reward_turns(ep);",
        "rollout"
    ));
    assert!(imports("use crate::{config, rollout::Episode};", "rollout"));
    assert!(!imports("use crate::rollouts::X;", "rollout"));
    assert!(!imports("use crate::{config, task};", "rollout"));
}
