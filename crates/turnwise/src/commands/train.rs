//! `turnwise train`.

use std::path::PathBuf;

use anyhow::Result;
use turnwise::pipeline::RunOptions;

use super::common::{print_summary, resolve_train_config};

/// Train with a preset (see `turnwise presets`), a config file and overrides.
#[derive(Debug, clap::Args)]
pub struct Args {
    // Its help lists the preset registry's names (`preset_help`).
    #[arg(long, help = preset_help())]
    preset: Option<String>,
    /// A TOML config file applied over the preset.
    #[arg(long)]
    config: Option<PathBuf>,
    /// `key=value` overrides applied last (dotted keys, TOML values).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Run directory.
    #[arg(long)]
    out: PathBuf,
    /// Replace an existing run directory.
    #[arg(long)]
    overwrite: bool,
}

/// Runs `turnwise train`.
pub fn exec(args: Args, quiet: bool) -> Result<()> {
    let Args {
        preset,
        config,
        sets,
        out,
        overwrite,
    } = args;
    let cfg = resolve_train_config(preset.as_deref(), config.as_deref(), &sets)?;
    let summary = turnwise::pipeline::run(cfg, &RunOptions { dir: out, quiet }, overwrite)?;
    print_summary(&summary, quiet);
    Ok(())
}

/// `--preset`'s help: every name the preset registry accepts, `Preset name: a, b or c`.
fn preset_help() -> String {
    let names = turnwise::config::presets::known_names();
    match names.split_last() {
        Some((last, [])) => format!("Preset name: {last}"),
        Some((last, rest)) => format!("Preset name: {} or {last}", rest.join(", ")),
        None => "Preset name".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// `turnwise train --help` names every preset of the repository's `presets/` folder and the
    /// quickstart: the list comes from the registry, not a hand-kept copy.
    #[test]
    fn train_help_names_every_preset() {
        let mut cmd = super::super::Cli::command();
        let help = cmd
            .find_subcommand_mut("train")
            .unwrap()
            .render_help()
            .to_string();
        let line = help
            .lines()
            .find(|l| l.trim_start().starts_with("--preset"))
            .unwrap();
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../presets");
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "toml"))
            .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
            .collect();
        assert!(names.len() > 10, "{names:?}");
        names.push("quickstart".into());
        for name in &names {
            let listed = line.split([':', ',', ' ']).any(|w| w == name.as_str());
            assert!(listed, "`train --help` does not list preset {name}: {line}");
        }
    }
}
