//! The presets: one TOML file per method in the repository's `presets/` folder, embedded in
//! the binary. Each names its rollout, reward, advantage estimator and loss (spec §10).

use super::ConfigError;

/// Every preset: `(name, TOML text)`.
pub const PRESETS: &[(&str, &str)] = &[
    ("grpo", include_str!("../../../../presets/grpo.toml")),
    ("dr-grpo", include_str!("../../../../presets/dr-grpo.toml")),
    ("rloo", include_str!("../../../../presets/rloo.toml")),
    ("dapo", include_str!("../../../../presets/dapo.toml")),
    ("gspo", include_str!("../../../../presets/gspo.toml")),
    ("ppo", include_str!("../../../../presets/ppo.toml")),
    ("mt-grpo", include_str!("../../../../presets/mt-grpo.toml")),
    ("mt-ppo", include_str!("../../../../presets/mt-ppo.toml")),
    ("igpo", include_str!("../../../../presets/igpo.toml")),
    ("a2tgpo", include_str!("../../../../presets/a2tgpo.toml")),
    ("at2po", include_str!("../../../../presets/at2po.toml")),
    (
        "tree-grpo",
        include_str!("../../../../presets/tree-grpo.toml"),
    ),
    (
        "turn-ppo",
        include_str!("../../../../presets/turn-ppo.toml"),
    ),
    ("s-ppo", include_str!("../../../../presets/s-ppo.toml")),
    ("st-ppo", include_str!("../../../../presets/st-ppo.toml")),
    ("s-grpo", include_str!("../../../../presets/s-grpo.toml")),
    ("gigpo", include_str!("../../../../presets/gigpo.toml")),
    ("t2po", include_str!("../../../../presets/t2po.toml")),
];

/// The TOML text of preset `name`.
pub fn get(name: &str) -> Result<&'static str, ConfigError> {
    PRESETS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, t)| *t)
        .ok_or_else(|| ConfigError::UnknownPreset {
            name: name.to_string(),
            known: names().join(", "),
        })
}

/// Every preset name.
pub fn names() -> Vec<&'static str> {
    PRESETS.iter().map(|(n, _)| *n).collect()
}
