//! Settings from a TOML file, below the environment and the command line.
//!
//! Precedence, highest first: a flag typed on the command line, the option's environment
//! variable (its clap `env`), the configuration file, the built-in default.
//!
//! The file is named by a global `--config PATH` (or `--config=PATH`) anywhere before `--`,
//! else by `FALCON_CONFIG`. Each subcommand reads the section named after it (`[train]`,
//! `[local]`, `[sim]`, `[experiment]`, …); the keys are its long flag names (kebab-case;
//! snake_case is accepted). A subcommand with subcommands of its own (`experiment dssp`)
//! reads its section, whose keys may be those of any of them (each applies to the ones that
//! have it), then its subsection (`[experiment.dssp]`), whose keys win.
//!
//! [`expand`] turns the settings into flags inserted right after the subcommand's name, so
//! that clap parses them like typed flags: every check, value parser and default of the
//! command applies to them unchanged.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};

use clap::{Arg, ArgAction, Command};
use toml::Spanned;
use toml::de::{DeString, DeTable, DeValue};

/// The environment variable naming the configuration file when `--config` is not given.
pub const ENV_VAR: &str = "FALCON_CONFIG";

/// What can go wrong with the configuration file. Each message names the file; those about
/// one entry also name its line.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// `--config` without a path after it.
    #[error("--config needs the path of a TOML file (--config PATH or --config=PATH)")]
    MissingValue,
    /// The file could not be read (missing, unreadable, not UTF-8).
    #[error("cannot read the configuration file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid TOML (a key given twice included); the toml crate's message
    /// gives the line and column.
    #[error("syntax error in the configuration file {}:\n{source}", path.display())]
    Syntax {
        path: PathBuf,
        #[source]
        source: toml::de::Error,
    },
    /// A key outside any section.
    #[error(
        "{}:{line}: `{key}` is outside any section: put each setting in the section of its \
         subcommand, e.g. [{example}]",
        path.display()
    )]
    TopLevelKey {
        path: PathBuf,
        line: usize,
        key: String,
        example: String,
    },
    /// A section written as an array of tables, `[[train]]`.
    #[error(
        "{}:{line}: [[{section}]] is an array of tables: write the section as [{section}]",
        path.display()
    )]
    NotATable {
        path: PathBuf,
        line: usize,
        section: String,
    },
    /// A section named after no subcommand.
    #[error(
        "{}:{line}: unknown section [{section}]; the sections are the subcommands: {}",
        path.display(),
        sections.join(", ")
    )]
    UnknownSection {
        path: PathBuf,
        line: usize,
        section: String,
        sections: Box<[String]>,
    },
    /// A key that is no long flag of the section's subcommand (nor a subsection of it).
    #[error(
        "{}:{line}: unknown key `{key}` in [{section}]; the keys of [{section}] are: {}{}",
        path.display(),
        if valid.is_empty() { "(none)".to_owned() } else { valid.join(", ") },
        if subsections.is_empty() {
            String::new()
        } else {
            format!("; its subsections: [{}]", subsections.join("], ["))
        }
    )]
    UnknownKey {
        path: PathBuf,
        line: usize,
        section: String,
        key: String,
        valid: Box<[String]>,
        subsections: Box<[String]>,
    },
    /// One key twice in a section, as `eval_every` and `eval-every`.
    #[error("{}:{line}: `{key}` is given twice in [{section}]", path.display())]
    DuplicateKey {
        path: PathBuf,
        line: usize,
        section: String,
        key: String,
    },
    /// A value of a type that the key's flag cannot take.
    #[error("{}:{line}: [{section}] {key}: {reason}", path.display())]
    BadValue {
        path: PathBuf,
        line: usize,
        section: String,
        key: String,
        reason: String,
    },
}

/// Applies the configuration file to `argv` (program name first, as from
/// `std::env::args_os()`): removes `--config PATH`, reads the file (that path, else the one
/// `env` gives for `FALCON_CONFIG`), and inserts the settings of the subcommand that `argv`
/// runs as flags right after the subcommand's name. The result is for `cmd`'s parser.
///
/// `cmd` is the whole command (e.g. `<Cli as clap::CommandFactory>::command()`); it tells
/// the subcommands, their long flags, which take values and which repeat, and their `env`
/// names. `env` reads the environment: a setting whose flag has an environment variable that
/// `env` reports set is left out, so that the variable wins.
///
/// A flag that the user typed after the subcommand's name drops the file's setting for it,
/// so the result never repeats a flag from the file (and a repeatable flag typed by the user
/// replaces the file's list instead of adding to it). Building the command with
/// `args_override_self(true)` is still advisable, so that a flag typed twice takes its last
/// value.
///
/// Nothing is read when `argv` names no subcommand (`falcon --help`); a subcommand without a
/// section gets nothing, and the sections of other subcommands are not looked into.
pub fn expand(
    cmd: &Command,
    argv: Vec<OsString>,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Vec<OsString>, ConfigError> {
    let (mut argv, flag_path) = take_config_flag(argv)?;
    let path = match flag_path {
        Some(p) => p,
        None => match env(ENV_VAR) {
            Some(p) if !p.is_empty() => PathBuf::from(p),
            _ => return Ok(argv),
        },
    };
    let chain = subcommands(cmd, &argv);
    let Some(first) = chain.first() else {
        return Ok(argv);
    };
    let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::Read {
        path: path.clone(),
        source,
    })?;
    let doc = DeTable::parse(&text).map_err(|source| ConfigError::Syntax {
        path: path.clone(),
        source,
    })?;
    let file = File {
        path: &path,
        text: &text,
    };
    let Some(section) = file.section(cmd, doc.get_ref(), first.cmd.get_name())? else {
        return Ok(argv);
    };
    let settings = file.settings(&chain, section)?;
    // The deepest level first, so that the shallower ones' positions stay valid.
    for (j, level) in chain.iter().enumerate().rev() {
        let end = chain.get(j + 1).map_or(argv.len(), |next| next.at);
        let (typed, _) = scan(level.cmd, &argv[level.at + 1..end]);
        let mut flags = Vec::new();
        for s in settings.iter().filter(|s| s.level == j) {
            let overridden = typed.iter().any(|id| id == s.key.arg.get_id())
                || s.key
                    .arg
                    .get_env()
                    .and_then(OsStr::to_str)
                    .is_some_and(|name| env(name).is_some());
            if !overridden {
                flags.extend(file.flags(s)?);
            }
        }
        argv.splice(level.at + 1..level.at + 1, flags);
    }
    Ok(argv)
}

/// Text for clap's `after_long_help`: the file's format and the precedence of the sources.
pub fn help_footer() -> &'static str {
    "\
Configuration file:
  --config PATH (or FALCON_CONFIG=PATH) reads settings from a TOML file. Each subcommand
  reads the section named after it: [train], [local], [sim], [experiment] (whose keys apply
  to every experiment that has them; [experiment.NAME] is for one experiment and wins).
  Other sections are not used. The keys are the subcommand's long flag names without the
  dashes (snake_case works too). Precedence, highest first: a flag on the command line,
  the option's environment variable, the file, the built-in default.
  Values: strings, numbers and booleans; `key = true` passes a switch (false leaves it
  off); a repeatable flag takes an array, one value each; other arrays are joined with
  commas.

  Example (falcon --config run.toml train --epochs 2):
    [train]
    workers = 4
    policy = \"dssp(3,15)\"
    hetero = [\"3:h=0.25\", \"2:gauss(5,2)\"]
    quiet = true

    [sim]
    policies = \"bsp,epsp\"

    [experiment]
    mode = \"sim\"

    [experiment.dssp]
    workers = 2
"
}

/// Removes every `--config PATH` and `--config=PATH` before `--` from `argv`; the last one
/// names the file.
fn take_config_flag(argv: Vec<OsString>) -> Result<(Vec<OsString>, Option<PathBuf>), ConfigError> {
    let mut out = Vec::with_capacity(argv.len());
    let mut path = None;
    let mut args = argv.into_iter();
    out.extend(args.next());
    while let Some(arg) = args.next() {
        if arg == "--" {
            out.push(arg);
            out.extend(args);
            break;
        }
        if arg == "--config" {
            match args.next() {
                Some(p) if !p.is_empty() && !p.to_string_lossy().starts_with("--") => {
                    path = Some(PathBuf::from(p));
                }
                _ => return Err(ConfigError::MissingValue),
            }
        } else if let Some(p) = strip_config_eq(&arg) {
            if p.is_empty() {
                return Err(ConfigError::MissingValue);
            }
            path = Some(PathBuf::from(p));
        } else {
            out.push(arg);
        }
    }
    Ok((out, path))
}

/// The path of a `--config=PATH` argument.
fn strip_config_eq(arg: &OsStr) -> Option<OsString> {
    const PREFIX: &str = "--config=";
    if let Some(s) = arg.to_str() {
        return s.strip_prefix(PREFIX).map(OsString::from);
    }
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        arg.as_bytes()
            .strip_prefix(PREFIX.as_bytes())
            .map(|rest| OsStr::from_bytes(rest).to_owned())
    }
    #[cfg(not(unix))]
    {
        arg.to_string_lossy()
            .strip_prefix(PREFIX)
            .map(OsString::from)
    }
}

/// One subcommand on the command line: its position in argv and its command.
struct Level<'c> {
    at: usize,
    cmd: &'c Command,
}

/// The subcommands that `argv` runs, outermost first: `train`, or `experiment` then `dssp`.
fn subcommands<'c>(cmd: &'c Command, argv: &[OsString]) -> Vec<Level<'c>> {
    let mut chain = Vec::new();
    let (mut cur, mut from) = (cmd, 1);
    while from <= argv.len() {
        let (_, Some(i)) = scan(cur, &argv[from..]) else {
            break;
        };
        let at = from + i;
        let Some(sub) = cur.find_subcommand(&argv[at]) else {
            break;
        };
        chain.push(Level { at, cmd: sub });
        (cur, from) = (sub, at + 1);
    }
    chain
}

/// Reads `args` (up to `--`) as `cmd`'s arguments: the ids of the arguments given, and the
/// index of the first operand (an argument that is neither a flag nor a flag's value, like a
/// subcommand's name or a positional argument).
fn scan(cmd: &Command, args: &[OsString]) -> (Vec<String>, Option<usize>) {
    let mut typed = Vec::new();
    let looks_like_flag = |a: &OsString| a.to_string_lossy().starts_with('-');
    // Whether an option without an inline value takes the next argument as its value (clap
    // takes one that does not look like a flag, unless the option allows hyphens).
    let takes_next = |a: &Arg, next: Option<&OsString>| {
        a.get_action().takes_values()
            && next.is_some_and(|n| !looks_like_flag(n) || a.is_allow_hyphen_values_set())
    };
    let (mut i, mut operand) = (0, None);
    while i < args.len() {
        let raw = &args[i];
        i += 1;
        let arg = raw.to_string_lossy();
        if arg == "--" {
            break;
        }
        if let Some(long) = arg.strip_prefix("--") {
            let (name, inline) = match long.split_once('=') {
                Some((name, _)) => (name, true),
                None => (long, false),
            };
            if let Some(a) = cmd
                .get_arguments()
                .find(|a| long_names(a).any(|l| l == name))
            {
                typed.push(a.get_id().to_string());
                if !inline && takes_next(a, args.get(i)) {
                    i += 1;
                }
            }
        } else if let Some(shorts) = arg.strip_prefix('-').filter(|s| !s.is_empty()) {
            // A cluster of short flags (`-qv`), the last of which may take a value (`-n5`,
            // `-n 5`).
            let mut chars = shorts.chars().peekable();
            while let Some(c) = chars.next() {
                let Some(a) = cmd.get_arguments().find(|a| {
                    a.get_short() == Some(c)
                        || a.get_all_short_aliases().is_some_and(|s| s.contains(&c))
                }) else {
                    break;
                };
                typed.push(a.get_id().to_string());
                if a.get_action().takes_values() {
                    if chars.peek().is_none() && takes_next(a, args.get(i)) {
                        i += 1;
                    }
                    break;
                }
            }
        } else if operand.is_none() {
            operand = Some(i - 1);
        }
    }
    (typed, operand)
}

/// The long name and long aliases of an argument.
fn long_names(arg: &Arg) -> impl Iterator<Item = &str> {
    arg.get_long()
        .into_iter()
        .chain(arg.get_all_aliases().unwrap_or_default())
}

/// The arguments that the file may set: those with a long name, but help, version and
/// `--config` itself.
fn settable(cmd: &Command) -> impl Iterator<Item = &Arg> {
    cmd.get_arguments().filter(|a| {
        a.get_long().is_some_and(|l| l != "config")
            && !matches!(
                a.get_action(),
                ArgAction::Help | ArgAction::HelpShort | ArgAction::HelpLong | ArgAction::Version
            )
    })
}

/// `cmd` and its subcommands, theirs, and so on.
fn subtree(cmd: &Command) -> Vec<&Command> {
    let mut all = vec![cmd];
    let mut i = 0;
    while i < all.len() {
        all.extend(all[i].get_subcommands());
        i += 1;
    }
    all
}

/// A key of a section, resolved to its argument.
struct Key<'c> {
    name: String,
    line: usize,
    arg: &'c Arg,
}

/// One setting of the file: the level of the subcommand chain whose argument it sets.
struct Setting<'c, 'd, 'i> {
    level: usize,
    section: String,
    key: Key<'c>,
    value: &'d Spanned<DeValue<'i>>,
}

/// The file being applied, for its errors.
struct File<'a> {
    path: &'a Path,
    text: &'a str,
}

impl File<'_> {
    /// The 1-based line of a span.
    fn line(&self, span: std::ops::Range<usize>) -> usize {
        let end = span.start.min(self.text.len());
        self.text.as_bytes()[..end]
            .iter()
            .filter(|b| **b == b'\n')
            .count()
            + 1
    }

    /// Checks the document's shape (only sections, each named after a subcommand) and
    /// returns the section `name`, if any.
    fn section<'d, 'i>(
        &self,
        cmd: &Command,
        doc: &'d DeTable<'i>,
        name: &str,
    ) -> Result<Option<&'d DeTable<'i>>, ConfigError> {
        let mut found = None;
        for (key, value) in in_file_order(doc) {
            let section = key.get_ref().replace('_', "-");
            let line = self.line(key.span());
            let DeValue::Table(table) = value.get_ref() else {
                if let DeValue::Array(items) = value.get_ref()
                    && !items.is_empty()
                    && items.iter().all(|i| i.get_ref().is_table())
                {
                    return Err(ConfigError::NotATable {
                        path: self.path.to_owned(),
                        line,
                        section,
                    });
                }
                return Err(ConfigError::TopLevelKey {
                    path: self.path.to_owned(),
                    line,
                    key: key.get_ref().to_string(),
                    example: name.to_owned(),
                });
            };
            let Some(sub) = cmd.find_subcommand(&section) else {
                return Err(ConfigError::UnknownSection {
                    path: self.path.to_owned(),
                    line,
                    section,
                    sections: cmd
                        .get_subcommands()
                        .map(|s| s.get_name().to_owned())
                        .collect(),
                });
            };
            if sub.get_name() == name {
                if found.is_some() {
                    return Err(ConfigError::DuplicateKey {
                        path: self.path.to_owned(),
                        line,
                        section: "the top level".to_owned(),
                        key: format!("[{section}]"),
                    });
                }
                found = Some(table);
            }
        }
        Ok(found)
    }

    /// The settings for the subcommands of `chain` from `section` (the first one's) and its
    /// subsections along the chain, a deeper one's settings replacing the shallower ones'.
    fn settings<'c, 'd, 'i>(
        &self,
        chain: &[Level<'c>],
        section: &'d DeTable<'i>,
    ) -> Result<Vec<Setting<'c, 'd, 'i>>, ConfigError> {
        let mut settings: Vec<Setting<'c, 'd, 'i>> = Vec::new();
        let mut table = Some(section);
        let mut section = chain[0].cmd.get_name().to_owned();
        for (k, level) in chain.iter().enumerate() {
            let Some(t) = table.take() else { break };
            let next = chain.get(k + 1).map(|l| l.cmd.get_name());
            let mut seen: Vec<&str> = Vec::new();
            for (key, value) in in_file_order(t) {
                let name = key.get_ref().replace('_', "-");
                let line = self.line(key.span());
                if let DeValue::Table(sub_table) = value.get_ref()
                    && let Some(sub) = level.cmd.find_subcommand(&name)
                {
                    if Some(sub.get_name()) == next {
                        table = Some(sub_table);
                    }
                    continue;
                }
                // A key of any subcommand below this one, applied to the deepest one on the
                // command line that has it, if any.
                let Some(arg) = subtree(level.cmd)
                    .into_iter()
                    .flat_map(settable)
                    .find(|a| long_names(a).any(|l| l == name))
                else {
                    return Err(self.unknown_key(level.cmd, &section, key.get_ref(), line));
                };
                let canonical = arg.get_long().unwrap_or_default();
                if seen.contains(&canonical) {
                    return Err(ConfigError::DuplicateKey {
                        path: self.path.to_owned(),
                        line,
                        section: section.clone(),
                        key: name,
                    });
                }
                seen.push(canonical);
                let target = (k..chain.len()).rev().find_map(|j| {
                    settable(chain[j].cmd)
                        .find(|a| long_names(a).any(|l| l == name))
                        .map(|a| (j, a))
                });
                let Some((j, arg)) = target else { continue };
                settings.retain(|s| !(s.level == j && s.key.arg.get_id() == arg.get_id()));
                settings.push(Setting {
                    level: j,
                    section: section.clone(),
                    key: Key { name, line, arg },
                    value,
                });
            }
            if let Some(next) = next {
                section = format!("{section}.{next}");
            }
        }
        Ok(settings)
    }

    fn unknown_key(&self, cmd: &Command, section: &str, key: &str, line: usize) -> ConfigError {
        let mut valid: Vec<String> = Vec::new();
        for long in subtree(cmd)
            .into_iter()
            .flat_map(settable)
            .filter_map(Arg::get_long)
        {
            if !valid.iter().any(|v| v == long) {
                valid.push(long.to_owned());
            }
        }
        ConfigError::UnknownKey {
            path: self.path.to_owned(),
            line,
            section: section.to_owned(),
            key: key.to_owned(),
            valid: valid.into(),
            subsections: cmd
                .get_subcommands()
                .map(|s| format!("{section}.{}", s.get_name()))
                .collect(),
        }
    }

    /// The flags that make a setting.
    fn flags(&self, s: &Setting<'_, '_, '_>) -> Result<Vec<OsString>, ConfigError> {
        let bad = |reason: &str| ConfigError::BadValue {
            path: self.path.to_owned(),
            line: s.key.line,
            section: s.section.clone(),
            key: s.key.name.clone(),
            reason: reason.to_owned(),
        };
        let long = s.key.arg.get_long().unwrap_or(&s.key.name);
        let with = |v: &str| OsString::from(format!("--{long}={v}"));
        let action = s.key.arg.get_action();
        if !action.takes_values() {
            // A switch: SetTrue, SetFalse (whose flag is named for what it turns off) or Count.
            let times = match s.value.get_ref() {
                DeValue::Boolean(b) => usize::from(*b),
                v @ DeValue::Integer(_) if matches!(action, ArgAction::Count) => scalar(v)
                    .and_then(|n| n.parse().ok())
                    .ok_or_else(|| bad("expects true, false or a count"))?,
                _ => return Err(bad("is a switch: expects true or false")),
            };
            return Ok(vec![OsString::from(format!("--{long}")); times]);
        }
        match s.value.get_ref() {
            DeValue::Array(items) => {
                let values = items
                    .iter()
                    .map(|v| scalar(v.get_ref()))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| bad("an array may hold only strings, numbers and booleans"))?;
                if matches!(action, ArgAction::Append) {
                    Ok(values.iter().map(|v| with(v)).collect())
                } else {
                    Ok(vec![with(&values.join(","))])
                }
            }
            v => {
                let v = scalar(v).ok_or_else(|| {
                    bad("expects a string, a number, a boolean or an array of them")
                })?;
                Ok(vec![with(&v)])
            }
        }
    }
}

/// A table's entries in the file's order.
fn in_file_order<'d, 'i>(
    table: &'d DeTable<'i>,
) -> Vec<(&'d Spanned<DeString<'i>>, &'d Spanned<DeValue<'i>>)> {
    let mut entries: Vec<_> = table.iter().collect();
    entries.sort_by_key(|(k, _)| k.span().start);
    entries
}

/// A scalar value as it would be typed on the command line.
fn scalar(value: &DeValue<'_>) -> Option<String> {
    Some(match value {
        DeValue::String(s) => s.to_string(),
        DeValue::Integer(i) => i128::from_str_radix(i.as_str(), i.radix())
            .map_or_else(|_| i.to_string(), |n| n.to_string()),
        DeValue::Float(f) => f.as_str().to_owned(),
        DeValue::Boolean(b) => b.to_string(),
        DeValue::Datetime(d) => d.to_string(),
        DeValue::Array(_) | DeValue::Table(_) => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

    /// A small command with the kinds of arguments of the real one.
    #[derive(Parser, Debug)]
    #[command(name = "falcon", args_override_self = true)]
    struct Cli {
        /// The configuration file.
        #[arg(long = "config", global = true, value_name = "PATH")]
        _config: Option<PathBuf>,
        #[command(subcommand)]
        command: Sub,
    }

    #[derive(Subcommand, Debug, PartialEq)]
    enum Sub {
        Train(TrainArgs),
        Sim(SimArgs),
        Experiment(ExperimentArgs),
        /// A positional argument besides the flags, like `falcon bench`.
        Bench {
            #[arg(default_value = "transport")]
            what: String,
            #[arg(long)]
            quick: bool,
        },
        Doctor,
    }

    /// A subcommand with subcommands, like `falcon experiment`.
    #[derive(clap::Args, Debug, PartialEq)]
    struct ExperimentArgs {
        #[command(subcommand)]
        which: Which,
    }

    #[derive(Subcommand, Debug, PartialEq)]
    enum Which {
        Dssp(Knobs),
        Fluentps(Knobs),
        Zipline {
            #[arg(long)]
            out: Option<String>,
            #[arg(long)]
            quick: bool,
        },
    }

    #[derive(clap::Args, Debug, PartialEq)]
    struct Knobs {
        #[arg(long, value_parser = ["real", "sim", "both"])]
        mode: Option<String>,
        #[arg(long)]
        workers: Option<u32>,
        #[arg(long)]
        hetero: Vec<String>,
        #[arg(long)]
        out: Option<String>,
        #[arg(long)]
        quick: bool,
    }

    #[derive(clap::Args, Debug, PartialEq)]
    struct TrainArgs {
        /// A value with a default.
        #[arg(long, default_value_t = 4)]
        workers: u32,
        /// A value with a default.
        #[arg(long, default_value = "epsp")]
        policy: String,
        /// An optional value.
        #[arg(long)]
        lr: Option<f32>,
        /// A value with an environment variable (set only in the tests' fake environment).
        #[arg(long, env = "FALCON_TEST_SEED", default_value_t = 1)]
        seed: u64,
        /// A value with an environment variable that `cargo test` sets.
        #[arg(long, env = "CARGO_PKG_NAME", default_value = "none")]
        crate_name: String,
        /// A snake_case field: the flag is --eval-every.
        #[arg(long, default_value_t = 10)]
        eval_every: u64,
        /// A switch.
        #[arg(long)]
        quiet: bool,
        /// A switch with a short name.
        #[arg(short = 'm', long)]
        metrics: bool,
        /// A repeatable value.
        #[arg(long)]
        hetero: Vec<String>,
    }

    #[derive(clap::Args, Debug, PartialEq)]
    struct SimArgs {
        #[arg(long, default_value_t = 16)]
        workers: u32,
        #[arg(long, default_value = "bsp,epsp")]
        policies: String,
    }

    /// A TOML file in the temporary directory, removed on drop.
    struct TempFile(PathBuf);

    impl TempFile {
        fn new(name: &str, text: &str) -> Self {
            let path = std::env::temp_dir().join(format!(
                "falcon-config-test-{}-{name}.toml",
                std::process::id()
            ));
            std::fs::write(&path, text).unwrap();
            Self(path)
        }

        fn path(&self) -> &str {
            self.0.to_str().unwrap()
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn os(argv: &[&str]) -> Vec<OsString> {
        argv.iter().map(OsString::from).collect()
    }

    /// Expands `argv` with a fake environment.
    fn expand_with(argv: &[&str], env: &[(&str, &str)]) -> Result<Vec<String>, ConfigError> {
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let out = expand(&Cli::command(), os(argv), |name| {
            env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
        })?;
        Ok(out.into_iter().map(|a| a.into_string().unwrap()).collect())
    }

    fn parse(argv: &[String]) -> Sub {
        Cli::try_parse_from(argv).unwrap().command
    }

    fn train(argv: &[String]) -> TrainArgs {
        match parse(argv) {
            Sub::Train(a) => a,
            other => panic!("not train: {other:?}"),
        }
    }

    const TRAIN: &str = r#"
[train]
workers = 8
policy = "ssp(3)"
lr = -0.5
eval_every = 0x10
quiet = true
metrics = false
hetero = ["3:h=0.25", "2:gauss(5,2)"]
"#;

    #[test]
    fn file_values_are_applied() {
        let f = TempFile::new("applied", TRAIN);
        let argv = expand_with(&["falcon", "--config", f.path(), "train"], &[]).unwrap();
        assert_eq!(
            argv,
            [
                "falcon",
                "train",
                "--workers=8",
                "--policy=ssp(3)",
                "--lr=-0.5",
                "--eval-every=16",
                "--quiet",
                "--hetero=3:h=0.25",
                "--hetero=2:gauss(5,2)",
            ]
        );
        let a = train(&argv);
        assert_eq!(a.workers, 8);
        assert_eq!(a.policy, "ssp(3)");
        assert_eq!(a.lr, Some(-0.5));
        assert_eq!(a.eval_every, 16);
        assert!(a.quiet);
        assert!(!a.metrics);
        assert_eq!(a.hetero, ["3:h=0.25", "2:gauss(5,2)"]);
        // Untouched: the defaults.
        assert_eq!(a.seed, 1);
    }

    #[test]
    fn flags_override_the_file() {
        let f = TempFile::new("flags", TRAIN);
        let argv = expand_with(
            &[
                "falcon",
                "train",
                "--workers",
                "2",
                "--config",
                f.path(),
                "--lr=0.25",
                "--hetero",
                "0:none",
                "--quiet",
                "-m",
            ],
            &[],
        )
        .unwrap();
        // The file's settings for typed flags are dropped, not just overridden.
        assert!(
            !argv.iter().any(|a| a.starts_with("--workers=")),
            "{argv:?}"
        );
        assert!(!argv.iter().any(|a| a.starts_with("--hetero=")), "{argv:?}");
        assert_eq!(argv.iter().filter(|a| *a == "--quiet").count(), 1);
        let a = train(&argv);
        assert_eq!(a.workers, 2);
        assert_eq!(a.lr, Some(0.25));
        // A repeatable flag typed by the user replaces the file's list, not adds to it.
        assert_eq!(a.hetero, ["0:none"]);
        assert!(a.metrics);
        // The rest of the file still applies.
        assert_eq!(a.policy, "ssp(3)");
        assert_eq!(a.eval_every, 16);
    }

    #[test]
    fn flags_override_the_file_without_args_override_self() {
        let f = TempFile::new("no-override", TRAIN);
        let argv = expand_with(
            &[
                "falcon",
                "train",
                "--config",
                f.path(),
                "--workers=3",
                "--quiet",
            ],
            &[],
        )
        .unwrap();
        let cmd = Cli::command().args_override_self(false);
        let matches = cmd.try_get_matches_from(&argv).unwrap();
        let Sub::Train(a) = Cli::from_arg_matches(&matches).unwrap().command else {
            panic!("not train");
        };
        assert_eq!(a.workers, 3);
        assert!(a.quiet);
    }

    #[test]
    fn flags_after_a_positional_argument_override_the_file() {
        let f = TempFile::new("positional", "[bench]\nquick = true\n");
        let argv = expand_with(
            &["falcon", "--config", f.path(), "bench", "knee", "--quick"],
            &[],
        )
        .unwrap();
        assert_eq!(argv, ["falcon", "bench", "knee", "--quick"]);
        let argv = expand_with(&["falcon", "--config", f.path(), "bench", "knee"], &[]).unwrap();
        assert_eq!(
            parse(&argv),
            Sub::Bench {
                what: "knee".into(),
                quick: true
            }
        );
    }

    #[test]
    fn args_override_self_takes_the_last_value() {
        // What the caller's `args_override_self(true)` gives: the last of a repeated flag,
        // for every kind but the repeatable one, which appends.
        let argv: Vec<String> = [
            "falcon",
            "train",
            "--workers=8",
            "--workers=2",
            "--lr=1",
            "--lr=2",
            "--quiet",
            "--quiet",
            "--hetero=a",
            "--hetero=b",
        ]
        .map(String::from)
        .into();
        let a = train(&argv);
        assert_eq!((a.workers, a.lr, a.quiet), (2, Some(2.0), true));
        assert_eq!(a.hetero, ["a", "b"]);
    }

    #[test]
    fn environment_overrides_the_file() {
        let f = TempFile::new("env", "[train]\nseed = 5\nworkers = 6\n");
        let argv = expand_with(
            &["falcon", "--config", f.path(), "train"],
            &[("FALCON_TEST_SEED", "7")],
        )
        .unwrap();
        assert_eq!(argv, ["falcon", "train", "--workers=6"]);
        // Without the variable, the file applies.
        let argv = expand_with(&["falcon", "--config", f.path(), "train"], &[]).unwrap();
        assert_eq!(train(&argv).seed, 5);
    }

    #[test]
    fn environment_overrides_the_file_end_to_end() {
        // CARGO_PKG_NAME is set by `cargo test` in the real environment, which clap reads.
        let f = TempFile::new("env-real", "[train]\ncrate-name = \"from-file\"\n");
        let out = expand(
            &Cli::command(),
            os(&["falcon", "--config", f.path(), "train"]),
            |k| std::env::var(k).ok(),
        )
        .unwrap();
        let argv: Vec<String> = out.into_iter().map(|a| a.into_string().unwrap()).collect();
        let expected = std::env::var("CARGO_PKG_NAME").unwrap_or_else(|_| "from-file".into());
        assert_eq!(train(&argv).crate_name, expected);
        // A flag beats both.
        let mut typed = argv.clone();
        typed.push("--crate-name=typed".into());
        assert_eq!(train(&typed).crate_name, "typed");
    }

    #[test]
    fn unknown_key_lists_the_valid_keys() {
        let f = TempFile::new("unknown", "[train]\nworkers = 2\nwokers = 3\n");
        let e = expand_with(&["falcon", "--config", f.path(), "train"], &[]).unwrap_err();
        let ConfigError::UnknownKey {
            line,
            ref section,
            ref key,
            ref valid,
            ..
        } = e
        else {
            panic!("{e:?}");
        };
        assert_eq!(
            (line, section.as_str(), key.as_str()),
            (3, "train", "wokers")
        );
        assert_eq!(
            valid.iter().map(String::as_str).collect::<Vec<_>>(),
            [
                "workers",
                "policy",
                "lr",
                "seed",
                "crate-name",
                "eval-every",
                "quiet",
                "metrics",
                "hetero"
            ]
        );
        let msg = e.to_string();
        assert!(msg.starts_with(&format!("{}:3: ", f.path())), "{msg}");
        assert!(msg.contains("unknown key `wokers` in [train]"), "{msg}");
        assert!(
            msg.contains("workers, policy, lr, seed, crate-name"),
            "{msg}"
        );
    }

    #[test]
    fn top_level_key_is_an_error() {
        let f = TempFile::new("top", "workers = 2\n\n[train]\nquiet = true\n");
        let e = expand_with(&["falcon", "--config", f.path(), "train"], &[]).unwrap_err();
        assert!(
            matches!(e, ConfigError::TopLevelKey { line: 1, .. }),
            "{e:?}"
        );
        let msg = e.to_string();
        assert!(msg.contains(f.path()), "{msg}");
        assert!(msg.contains("`workers` is outside any section"), "{msg}");
        assert!(msg.contains("e.g. [train]"), "{msg}");
    }

    #[test]
    fn unknown_section_and_array_of_tables_are_errors() {
        let f = TempFile::new("section", "[trian]\nworkers = 2\n");
        let e = expand_with(&["falcon", "--config", f.path(), "train"], &[]).unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(e, ConfigError::UnknownSection { line: 1, .. }),
            "{e:?}"
        );
        assert!(msg.contains("unknown section [trian]"), "{msg}");
        assert!(
            msg.contains("train, sim, experiment, bench, doctor"),
            "{msg}"
        );
        let f = TempFile::new("aot", "[[train]]\nworkers = 2\n");
        let e = expand_with(&["falcon", "--config", f.path(), "train"], &[]).unwrap_err();
        assert!(matches!(e, ConfigError::NotATable { .. }), "{e:?}");
    }

    #[test]
    fn missing_file_is_an_error_naming_it() {
        let path = std::env::temp_dir().join("falcon-config-test-no-such-file.toml");
        let path = path.to_str().unwrap();
        let e = expand_with(&["falcon", "train", "--config", path], &[]).unwrap_err();
        assert!(matches!(e, ConfigError::Read { .. }), "{e:?}");
        assert!(e.to_string().contains(path), "{e}");
    }

    #[test]
    fn syntax_error_names_the_file_and_line() {
        let f = TempFile::new("syntax", "[train]\nworkers = = 2\n");
        let e = expand_with(&["falcon", "--config", f.path(), "train"], &[]).unwrap_err();
        assert!(matches!(e, ConfigError::Syntax { .. }), "{e:?}");
        let msg = e.to_string();
        assert!(msg.contains(f.path()), "{msg}");
        assert!(msg.contains("line 2"), "{msg}");
        // A key given twice is the parser's error too.
        let f = TempFile::new("dup", "[train]\nworkers = 1\nworkers = 2\n");
        let e = expand_with(&["falcon", "--config", f.path(), "train"], &[]).unwrap_err();
        assert!(matches!(e, ConfigError::Syntax { .. }), "{e:?}");
    }

    #[test]
    fn snake_and_kebab_spellings_of_one_key_are_an_error() {
        let f = TempFile::new("dup2", "[train]\neval_every = 1\neval-every = 2\n");
        let e = expand_with(&["falcon", "--config", f.path(), "train"], &[]).unwrap_err();
        assert!(
            matches!(e, ConfigError::DuplicateKey { line: 3, .. }),
            "{e:?}"
        );
        assert!(e.to_string().contains("given twice in [train]"), "{e}");
    }

    #[test]
    fn config_equals_form() {
        let f = TempFile::new("eq", "[train]\nworkers = 9\n");
        let flag = format!("--config={}", f.path());
        let argv = expand_with(&["falcon", "train", &flag, "--quiet"], &[]).unwrap();
        assert_eq!(argv, ["falcon", "train", "--workers=9", "--quiet"]);
    }

    #[test]
    fn falcon_config_names_the_file_and_the_flag_beats_it() {
        let env_file = TempFile::new("envfile", "[train]\nworkers = 5\n");
        let flag_file = TempFile::new("flagfile", "[train]\nworkers = 6\n");
        let argv = expand_with(&["falcon", "train"], &[(ENV_VAR, env_file.path())]).unwrap();
        assert_eq!(train(&argv).workers, 5);
        let argv = expand_with(
            &["falcon", "train", "--config", flag_file.path()],
            &[(ENV_VAR, env_file.path())],
        )
        .unwrap();
        assert_eq!(train(&argv).workers, 6);
        // An empty FALCON_CONFIG is no file.
        let argv = expand_with(&["falcon", "train"], &[(ENV_VAR, "")]).unwrap();
        assert_eq!(argv, ["falcon", "train"]);
    }

    #[test]
    fn config_without_a_value_is_an_error() {
        for argv in [
            &["falcon", "train", "--config"][..],
            &["falcon", "--config", "--workers", "2", "train"],
            &["falcon", "train", "--config="],
        ] {
            let e = expand_with(argv, &[]).unwrap_err();
            assert!(matches!(e, ConfigError::MissingValue), "{argv:?}: {e:?}");
        }
    }

    #[test]
    fn booleans_and_arrays() {
        let f = TempFile::new(
            "bool",
            "[train]\nquiet = false\nmetrics = true\npolicy = [\"bsp\", \"epsp\"]\nhetero = \"1:h=0.5\"\n",
        );
        let argv = expand_with(&["falcon", "--config", f.path(), "train"], &[]).unwrap();
        assert_eq!(
            argv,
            [
                "falcon",
                "train",
                "--metrics",
                "--policy=bsp,epsp",
                "--hetero=1:h=0.5"
            ]
        );
        let a = train(&argv);
        assert!(!a.quiet && a.metrics);
        assert_eq!(a.policy, "bsp,epsp");
        assert_eq!(a.hetero, ["1:h=0.5"]);
        // An empty list for a repeatable flag sets nothing.
        let f = TempFile::new("empty", "[train]\nhetero = []\n");
        let argv = expand_with(&["falcon", "--config", f.path(), "train"], &[]).unwrap();
        assert_eq!(argv, ["falcon", "train"]);
        // A switch takes only a boolean; values take no tables or nested arrays.
        for (name, text) in [
            ("bad-switch", "[train]\nquiet = \"yes\"\n"),
            ("bad-table", "[train]\nworkers = { n = 1 }\n"),
            ("bad-nested", "[train]\nhetero = [[\"a\"]]\n"),
        ] {
            let f = TempFile::new(name, text);
            let e = expand_with(&["falcon", "--config", f.path(), "train"], &[]).unwrap_err();
            assert!(
                matches!(e, ConfigError::BadValue { line: 2, .. }),
                "{name}: {e:?}"
            );
        }
    }

    #[test]
    fn sections_of_other_subcommands_are_not_used() {
        let f = TempFile::new(
            "other",
            "[sim]\nworkers = 99\nnot-a-sim-key = 1\n\n[train]\nworkers = 3\n",
        );
        let argv = expand_with(&["falcon", "--config", f.path(), "train"], &[]).unwrap();
        assert_eq!(argv, ["falcon", "train", "--workers=3"]);
        // A subcommand with no section gets nothing.
        let argv = expand_with(&["falcon", "--config", f.path(), "doctor"], &[]).unwrap();
        assert_eq!(argv, ["falcon", "doctor"]);
        // Its own section is checked when it runs.
        let e = expand_with(&["falcon", "--config", f.path(), "sim"], &[]).unwrap_err();
        assert!(
            matches!(e, ConfigError::UnknownKey { line: 3, .. }),
            "{e:?}"
        );
        let f = TempFile::new("sim", "[sim]\nworkers = 99\n[train]\nworkers = 3\n");
        let argv = expand_with(&["falcon", "--config", f.path(), "sim"], &[]).unwrap();
        assert_eq!(
            parse(&argv),
            Sub::Sim(SimArgs {
                workers: 99,
                policies: "bsp,epsp".into()
            })
        );
    }

    #[test]
    fn nothing_is_read_without_a_subcommand_or_after_double_dash() {
        let missing = "/nonexistent/falcon.toml";
        let argv = expand_with(&["falcon", "--config", missing], &[]).unwrap();
        assert_eq!(argv, ["falcon"]);
        let argv = expand_with(&["falcon", "--help"], &[(ENV_VAR, missing)]).unwrap();
        assert_eq!(argv, ["falcon", "--help"]);
        // After `--`, `--config` is an operand, left alone.
        let argv = expand_with(&["falcon", "--", "--config", "x"], &[]).unwrap();
        assert_eq!(argv, ["falcon", "--", "--config", "x"]);
    }

    #[test]
    fn the_help_footers_example_is_valid() {
        let footer = help_footer();
        let example: String = footer
            .lines()
            .skip_while(|l| !l.contains("Example"))
            .skip(1)
            .map(|l| format!("{}\n", l.trim()))
            .collect();
        let f = TempFile::new("footer", &example);
        let argv = expand_with(&["falcon", "--config", f.path(), "train"], &[]).unwrap();
        let a = train(&argv);
        assert_eq!(
            (a.workers, a.policy.as_str(), a.quiet),
            (4, "dssp(3,15)", true)
        );
        assert_eq!(a.hetero.len(), 2);
        let argv = expand_with(&["falcon", "--config", f.path(), "sim"], &[]).unwrap();
        assert!(matches!(
            parse(&argv),
            Sub::Sim(SimArgs { workers: 16, .. })
        ));
        let argv =
            expand_with(&["falcon", "--config", f.path(), "experiment", "dssp"], &[]).unwrap();
        let Sub::Experiment(ExperimentArgs {
            which: Which::Dssp(k),
        }) = parse(&argv)
        else {
            panic!("{argv:?}");
        };
        assert_eq!((k.mode.as_deref(), k.workers), (Some("sim"), Some(2)));
    }

    const EXPERIMENT: &str = r#"
[experiment]
mode = "sim"
workers = 3
hetero = ["0:h=0.5"]
quick = true

[experiment.dssp]
workers = 5
out = "dssp-out"

[experiment.zipline]
out = "zip-out"
"#;

    fn experiment(argv: &[String]) -> Which {
        match parse(argv) {
            Sub::Experiment(e) => e.which,
            other => panic!("not experiment: {other:?}"),
        }
    }

    #[test]
    fn nested_subcommands_read_their_section_then_their_subsection() {
        let f = TempFile::new("nested", EXPERIMENT);
        let argv =
            expand_with(&["falcon", "--config", f.path(), "experiment", "dssp"], &[]).unwrap();
        assert_eq!(
            argv,
            [
                "falcon",
                "experiment",
                "dssp",
                "--mode=sim",
                "--hetero=0:h=0.5",
                "--quick",
                "--workers=5",
                "--out=dssp-out",
            ]
        );
        // The section's keys apply to each experiment that has them; its subsection wins.
        let Which::Dssp(k) = experiment(&argv) else {
            panic!()
        };
        assert_eq!(
            k,
            Knobs {
                mode: Some("sim".into()),
                workers: Some(5),
                hetero: vec!["0:h=0.5".into()],
                out: Some("dssp-out".into()),
                quick: true,
            }
        );
        // Another experiment: the section, not dssp's subsection; a typed flag still wins.
        let argv = expand_with(
            &[
                "falcon",
                "experiment",
                "fluentps",
                "--config",
                f.path(),
                "--workers",
                "7",
            ],
            &[],
        )
        .unwrap();
        let Which::Fluentps(k) = experiment(&argv) else {
            panic!()
        };
        assert_eq!((k.workers, k.out, k.quick), (Some(7), None, true));
        // One without most of the keys: those are left out.
        let argv = expand_with(
            &["falcon", "--config", f.path(), "experiment", "zipline"],
            &[],
        )
        .unwrap();
        assert_eq!(
            argv,
            [
                "falcon",
                "experiment",
                "zipline",
                "--quick",
                "--out=zip-out"
            ]
        );
        // No experiment named: nothing to set (clap then asks for one).
        let argv = expand_with(&["falcon", "--config", f.path(), "experiment"], &[]).unwrap();
        assert_eq!(argv, ["falcon", "experiment"]);
    }

    #[test]
    fn nested_sections_check_their_keys() {
        let f = TempFile::new("nested-bad", "[experiment]\nmode = \"sim\"\nwokers = 1\n");
        let e =
            expand_with(&["falcon", "--config", f.path(), "experiment", "dssp"], &[]).unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(e, ConfigError::UnknownKey { line: 3, .. }),
            "{e:?}"
        );
        // The keys of every experiment, once each, and the subsections.
        assert!(
            msg.contains(
                "are: mode, workers, hetero, out, quick; its subsections: [experiment.dssp], \
                 [experiment.fluentps], [experiment.zipline]"
            ),
            "{msg}"
        );
        // A subsection's keys are those of its experiment.
        let f = TempFile::new("nested-bad2", "[experiment.zipline]\nmode = \"sim\"\n");
        let e = expand_with(
            &["falcon", "--config", f.path(), "experiment", "zipline"],
            &[],
        )
        .unwrap_err();
        assert!(
            e.to_string().contains(
                "unknown key `mode` in [experiment.zipline]; the keys of [experiment.zipline] \
                 are: out, quick"
            ),
            "{e}"
        );
        // A subsection named after no experiment.
        let f = TempFile::new("nested-bad3", "[experiment.dsp]\nworkers = 1\n");
        let e =
            expand_with(&["falcon", "--config", f.path(), "experiment", "dssp"], &[]).unwrap_err();
        assert!(matches!(e, ConfigError::UnknownKey { .. }), "{e:?}");
        assert!(
            e.to_string().contains("unknown key `dsp` in [experiment]"),
            "{e}"
        );
    }
}
