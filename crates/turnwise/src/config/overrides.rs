//! Layering TOML documents: deep merges, `--set key=value` overrides, and the paths a config
//! holds made absolute.

use std::path::Path;

use super::ConfigError;

/// The config keys that hold file paths (stored absolute by [`super::TrainConfig::resolve`]).
pub const PATH_KEYS: &[&str] = &[
    "task.search_r1.train",
    "task.search_r1.validation",
    "task.search_r1.test",
    "task.search_r1.corpus",
    "model.init_from",
    "sft.demonstrations",
    "judge.serve",
    "judge.cache_dir",
];

/// The table at the dotted path `path` in `doc`, if every part of it is a table.
fn subtable<'a>(doc: &'a mut toml::Table, path: &[&str]) -> Option<&'a mut toml::Table> {
    match path.split_first() {
        None => Some(doc),
        Some((first, rest)) => match doc.get_mut(*first) {
            Some(toml::Value::Table(t)) => subtable(t, rest),
            _ => None,
        },
    }
}

/// Makes every relative path of [`PATH_KEYS`] in `doc` absolute, relative to `base` (itself
/// taken relative to the working directory). Values that are not strings are left for the
/// deserializer to report.
pub fn absolutize_paths(doc: &mut toml::Table, base: &Path) -> Result<(), ConfigError> {
    for key in PATH_KEYS {
        let parts: Vec<&str> = key.split('.').collect();
        let (last, head) = parts.split_last().expect("a key has a name");
        let Some(table) = subtable(doc, head) else {
            continue;
        };
        let last = *last;
        let Some(toml::Value::String(s)) = table.get(last) else {
            continue;
        };
        let path = Path::new(s.as_str());
        if path.is_absolute() || s.is_empty() {
            continue;
        }
        // A packaged model's name is not a path (unless a folder of that name is there).
        if matches!(*key, "model.init_from" | "judge.serve")
            && crate::model_source::is_model_name(s)
            && !base.join(path).exists()
        {
            continue;
        }
        let abs = std::path::absolute(base.join(path)).map_err(|cause| ConfigError::Io {
            path: path.to_path_buf(),
            cause,
        })?;
        let abs = abs.to_str().ok_or_else(|| ConfigError::Invalid {
            field: key,
            message: format!("the path {} is not valid UTF-8", abs.display()),
        })?;
        table.insert(last.to_string(), toml::Value::String(abs.to_string()));
    }
    Ok(())
}

/// The last non-empty line of a deserializer's message (the one that says what is wrong).
pub(super) fn first_line(s: &str) -> String {
    s.lines()
        .rfind(|l| !l.trim().is_empty())
        .unwrap_or(s)
        .trim()
        .to_string()
}

/// Parses a TOML document, naming `source_name` on error.
pub(super) fn parse_table(text: &str, source_name: &str) -> Result<toml::Table, ConfigError> {
    text.parse::<toml::Table>().map_err(|e| ConfigError::Parse {
        source_name: source_name.to_string(),
        message: e.to_string(),
    })
}

/// Deep-merges `top` into `base` (tables merge key by key; other values replace).
pub fn merge(base: &mut toml::Table, top: toml::Table) {
    for (k, v) in top {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(t)) => merge(b, t),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

/// Applies one `a.b.c=value` override. The value is parsed as TOML (`3`, `1e-4`, `true`,
/// `"text"`, `[1, 2]`); anything that does not parse is taken as a string.
pub fn apply_override(doc: &mut toml::Table, arg: &str) -> Result<(), ConfigError> {
    let err = |message: &str| ConfigError::Override {
        arg: arg.to_string(),
        message: message.to_string(),
    };
    let (key, raw) = arg
        .split_once('=')
        .ok_or_else(|| err("expected key=value, e.g. optim.lr=1e-4"))?;
    let key = key.trim();
    if key.is_empty() || key.split('.').any(|p| p.trim().is_empty()) {
        return Err(err("the key must be a dotted path like rollout.group_size"));
    }
    let raw = raw.trim();
    let value = match format!("v = {raw}").parse::<toml::Table>() {
        Ok(mut t) => t.remove("v").expect("parsed key"),
        Err(_) => toml::Value::String(raw.to_string()),
    };
    let parts: Vec<&str> = key.split('.').map(str::trim).collect();
    let mut table = doc;
    for p in &parts[..parts.len() - 1] {
        let entry = table
            .entry(p.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        table = match entry {
            toml::Value::Table(t) => t,
            _ => return Err(err(&format!("`{p}` is a value, not a table"))),
        };
    }
    // Switching the estimator or reward drops the previous one's settings.
    let last = parts[parts.len() - 1];
    if (last == "estimator" || last == "name") && table.get(last) != Some(&value) {
        table.clear();
    }
    // An inline table (`optim={lr=1e-4}`) sets those keys and keeps the table's others.
    match (table.get_mut(last), value) {
        (Some(toml::Value::Table(existing)), toml::Value::Table(top)) => merge(existing, top),
        (_, value) => {
            table.insert(last.to_string(), value);
        }
    }
    Ok(())
}
