//! Finds the presets: every `presets/*.toml` of the repository becomes a row of
//! `config::presets::PRESETS` (its file stem, its text), in name order, so a new preset is its
//! file alone.

use std::fmt::Write as _;
use std::path::Path;

fn main() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../presets");
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot read the presets folder {}: {e}", dir.display()))
        .map(|e| e.expect("a presets folder entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort_by_key(|p| p.file_stem().map(|s| s.to_owned()));
    assert!(!files.is_empty(), "no preset in {}", dir.display());
    let mut out = String::from("&[\n");
    for p in &files {
        let name = p
            .file_stem()
            .unwrap()
            .to_str()
            .expect("a UTF-8 preset name");
        assert!(
            name.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
            "preset file {}: names are lowercase letters, digits and '-'",
            p.display()
        );
        println!("cargo:rerun-if-changed={}", p.display());
        let path = p.canonicalize().unwrap();
        writeln!(out, "    ({name:?}, include_str!({:?})),", path.display()).unwrap();
    }
    out.push(']');
    let dest = Path::new(&std::env::var("OUT_DIR").unwrap()).join("presets.rs");
    std::fs::write(dest, out).unwrap();
}
