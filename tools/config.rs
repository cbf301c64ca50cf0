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
//! [`apply`] turns each setting into the default value of its argument in clap's command,
//! so clap's own precedence (typed flag, then environment variable, then default) is the
//! documented one, and every check and value parser of the command applies to file values
//! as to typed ones. Nothing here reads the command line but the `--config` flag itself.

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

/// Applies the configuration file to `cmd` for `argv` (program name first, as from
/// `std::env::args_os()`): removes `--config PATH` from `argv`, reads the file (that path,
/// else the one `env` gives for `FALCON_CONFIG`), checks every section, and makes each
/// setting the default value of its argument in `cmd`. Parse the returned argv with the
/// returned command.
///
/// Nothing is read when `argv` names no subcommand (`falcon --help`).
///
/// `falcon role` has no flags: its section, `[role]`, sets the variables it reads (the
/// names in `role_vars`; a key is a variable's name, or its name after `FALCON_` in any case:
/// `policy` is `FALCON_POLICY`), returned as (variable, value) pairs for the role to read
/// where the environment has nothing.
pub fn apply(
    cmd: Command,
    argv: Vec<OsString>,
    env: impl Fn(&str) -> Option<String>,
    role_vars: &[&str],
) -> Result<Applied, ConfigError> {
    let (argv, flag_path) = take_config_flag(argv)?;
    let path = match flag_path {
        Some(p) => p,
        None => match env(ENV_VAR) {
            Some(p) if !p.is_empty() => PathBuf::from(p),
            _ => return Ok((cmd, argv, Vec::new())),
        },
    };
    let mut operands = argv.iter().skip(1).take_while(|a| *a != "--");
    if operands.all(|a| a.to_string_lossy().starts_with('-')) {
        return Ok((cmd, argv, Vec::new()));
    }
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
    let mut defaults = Vec::new();
    let mut vars = Vec::new();
    for (sub, table) in file.sections(&cmd, doc.get_ref())? {
        let name = sub.get_name().to_owned();
        if name == "role" {
            vars = file.variables(table, role_vars)?;
            continue;
        }
        file.collect(sub, vec![name.clone()], table, &name, &mut defaults)?;
    }
    let mut cmd = cmd;
    // In the order found: a subsection's settings come after its section's, and win.
    for d in defaults {
        cmd = with_default(cmd, &d.path, &d.arg, d.values);
    }
    Ok((cmd, argv, vars))
}

/// What [`apply`] gives: the command with the file's defaults, the argv to parse with it,
/// and the `[role]` section's variables.
pub type Applied = (Command, Vec<OsString>, Vec<(String, String)>);

/// `cmd` with the argument `arg` of its subcommand at `path` defaulting to `values`.
fn with_default(cmd: Command, path: &[String], arg: &str, values: Vec<String>) -> Command {
    match path.split_first() {
        Some((first, rest)) => {
            cmd.mut_subcommand(first, |sub| with_default(sub, rest, arg, values))
        }
        None => cmd.mut_arg(arg, |a| a.default_values(values)),
    }
}

/// Text for clap's `after_long_help`: the file's format and the precedence of the sources.
pub fn help_footer() -> &'static str {
    "\
Configuration file:
  --config PATH (or FALCON_CONFIG=PATH) reads settings from a TOML file. Each subcommand
  reads the section named after it: [train], [local], [sim], [experiment] (whose keys apply
  to every experiment that has them; [experiment.NAME] is for one experiment and wins),
  [role] (its variables: see `falcon role --help`).
  Every section is checked whichever subcommand runs, and each setting becomes the
  default of its flag. The keys are the subcommand's long flag names without the
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

/// One setting of the file: the argument of the subcommand at `path` it gives a default.
struct Default_ {
    path: Vec<String>,
    arg: String,
    values: Vec<String>,
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

    /// Checks the document's shape (only sections, each named after a subcommand, each
    /// once) and returns each section with its subcommand, in the file's order.
    fn sections<'c, 'd, 'i>(
        &self,
        cmd: &'c Command,
        doc: &'d DeTable<'i>,
    ) -> Result<Vec<(&'c Command, &'d DeTable<'i>)>, ConfigError> {
        let mut found: Vec<(&'c Command, &'d DeTable<'i>)> = Vec::new();
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
                    example: "train".to_owned(),
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
            if found.iter().any(|(c, _)| c.get_name() == sub.get_name()) {
                return Err(ConfigError::DuplicateKey {
                    path: self.path.to_owned(),
                    line,
                    section: "the top level".to_owned(),
                    key: format!("[{section}]"),
                });
            }
            found.push((sub, table));
        }
        Ok(found)
    }

    /// The settings of `table`, the section `section` of `cmd` (at `path`): each key gives
    /// a default to the argument of that name of `cmd` and of every subcommand below it that
    /// has one; then its subsections, whose settings come after (and so win) for their
    /// subcommand.
    fn collect<'d, 'i>(
        &self,
        cmd: &Command,
        path: Vec<String>,
        table: &'d DeTable<'i>,
        section: &str,
        out: &mut Vec<Default_>,
    ) -> Result<(), ConfigError> {
        let mut seen: Vec<&str> = Vec::new();
        let mut subsections = Vec::new();
        for (key, value) in in_file_order(table) {
            let name = key.get_ref().replace('_', "-");
            let line = self.line(key.span());
            if let DeValue::Table(sub_table) = value.get_ref()
                && let Some(sub) = cmd.find_subcommand(&name)
            {
                subsections.push((sub, sub_table));
                continue;
            }
            // Every command of the subtree with an argument of that name, with its path.
            let mut targets: Vec<(Vec<String>, &Arg)> = Vec::new();
            let mut stack = vec![(path.clone(), cmd)];
            while let Some((p, c)) = stack.pop() {
                if let Some(a) = settable(c).find(|a| long_names(a).any(|l| l == name)) {
                    targets.push((p.clone(), a));
                }
                for sub in c.get_subcommands() {
                    let mut q = p.clone();
                    q.push(sub.get_name().to_owned());
                    stack.push((q, sub));
                }
            }
            let Some((_, first)) = targets.first() else {
                return Err(self.unknown_key(cmd, section, key.get_ref(), line));
            };
            let canonical = first.get_long().unwrap_or_default();
            if seen.contains(&canonical) {
                return Err(ConfigError::DuplicateKey {
                    path: self.path.to_owned(),
                    line,
                    section: section.to_owned(),
                    key: name,
                });
            }
            seen.push(canonical);
            for (p, arg) in targets {
                if let Some(values) = self.values(section, &name, line, arg, value.get_ref())? {
                    out.push(Default_ {
                        path: p,
                        arg: arg.get_id().to_string(),
                        values,
                    });
                }
            }
        }
        for (sub, t) in subsections {
            let mut p = path.clone();
            p.push(sub.get_name().to_owned());
            let label = format!("{section}.{}", sub.get_name());
            self.collect(sub, p, t, &label, out)?;
        }
        Ok(())
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

    /// The `[role]` section as variables of `falcon role` (any of `names`).
    fn variables(
        &self,
        table: &DeTable<'_>,
        names: &[&str],
    ) -> Result<Vec<(String, String)>, ConfigError> {
        let mut out: Vec<(String, String)> = Vec::new();
        for (key, value) in in_file_order(table) {
            let line = self.line(key.span());
            let upper = key.get_ref().to_ascii_uppercase().replace('-', "_");
            let var = [upper.clone(), format!("FALCON_{upper}")]
                .into_iter()
                .find(|v| names.contains(&v.as_str()));
            let Some(var) = var else {
                return Err(ConfigError::UnknownKey {
                    path: self.path.to_owned(),
                    line,
                    section: "role".to_owned(),
                    key: key.get_ref().to_string(),
                    valid: names.iter().map(|n| (*n).to_owned()).collect(),
                    subsections: Box::new([]),
                });
            };
            if out.iter().any(|(v, _)| *v == var) {
                return Err(ConfigError::DuplicateKey {
                    path: self.path.to_owned(),
                    line,
                    section: "role".to_owned(),
                    key: key.get_ref().to_string(),
                });
            }
            let bad = || ConfigError::BadValue {
                path: self.path.to_owned(),
                line,
                section: "role".to_owned(),
                key: key.get_ref().to_string(),
                reason: "expects a string, a number, a boolean or an array of them".to_owned(),
            };
            let text = match value.get_ref() {
                DeValue::Array(items) => items
                    .iter()
                    .map(|v| scalar(v.get_ref()))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(bad)?
                    // FALCON_HETERO's entries are separated by `;`, lists by `,`.
                    .join(if var == "FALCON_HETERO" { ";" } else { "," }),
                v => scalar(v).ok_or_else(bad)?,
            };
            out.push((var, text));
        }
        Ok(out)
    }

    /// The default values a setting gives `arg` (`None`: leave its default, for a switch
    /// set to false).
    fn values(
        &self,
        section: &str,
        key: &str,
        line: usize,
        arg: &Arg,
        value: &DeValue<'_>,
    ) -> Result<Option<Vec<String>>, ConfigError> {
        let bad = |reason: &str| ConfigError::BadValue {
            path: self.path.to_owned(),
            line,
            section: section.to_owned(),
            key: key.to_owned(),
            reason: reason.to_owned(),
        };
        let action = arg.get_action();
        if !action.takes_values() {
            // A switch: SetTrue, SetFalse (whose flag is named for what it turns off) or Count;
            // `true` (or a count) means the switch as if typed.
            let times: u64 = match value {
                DeValue::Boolean(b) => u64::from(*b),
                v @ DeValue::Integer(_) if matches!(action, ArgAction::Count) => scalar(v)
                    .and_then(|n| n.parse().ok())
                    .ok_or_else(|| bad("expects true, false or a count"))?,
                _ => return Err(bad("is a switch: expects true or false")),
            };
            return Ok(match (action, times) {
                (_, 0) => None,
                (ArgAction::Count, n) => Some(vec![n.to_string()]),
                (ArgAction::SetFalse, _) => Some(vec!["false".into()]),
                _ => Some(vec!["true".into()]),
            });
        }
        match value {
            DeValue::Array(items) => {
                let values = items
                    .iter()
                    .map(|v| scalar(v.get_ref()))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| bad("an array may hold only strings, numbers and booleans"))?;
                if matches!(action, ArgAction::Append) {
                    Ok(Some(values))
                } else {
                    Ok(Some(vec![values.join(",")]))
                }
            }
            v => {
                let v = scalar(v).ok_or_else(|| {
                    bad("expects a string, a number, a boolean or an array of them")
                })?;
                Ok(Some(vec![v]))
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
        /// Configured by variables alone, like `falcon role`.
        Role,
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

    /// The command with the file applied, and the argv to parse with it.
    struct Applied {
        cmd: Command,
        argv: Vec<String>,
    }

    /// Applies the file to `argv` with a fake environment (for `FALCON_CONFIG`; clap reads
    /// the options' own variables from the real one).
    fn expand_with(argv: &[&str], env: &[(&str, &str)]) -> Result<Applied, ConfigError> {
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let (cmd, out, _) = apply(
            Cli::command(),
            os(argv),
            |name| env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()),
            &[],
        )?;
        Ok(Applied {
            cmd,
            argv: out.into_iter().map(|a| a.into_string().unwrap()).collect(),
        })
    }

    /// `argv` parsed by the command without a file.
    fn plain(argv: &[&str]) -> Applied {
        Applied {
            cmd: Cli::command(),
            argv: argv.iter().map(|a| (*a).to_owned()).collect(),
        }
    }

    fn try_parse(a: &Applied) -> Result<Sub, clap::Error> {
        let m = a.cmd.clone().try_get_matches_from(&a.argv)?;
        Ok(Cli::from_arg_matches(&m)?.command)
    }

    fn parse(a: &Applied) -> Sub {
        try_parse(a).unwrap()
    }

    fn train(a: &Applied) -> TrainArgs {
        match parse(a) {
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
        let a = expand_with(&["falcon", "--config", f.path(), "train"], &[]).unwrap();
        // The command line is left as typed, `--config` taken out.
        assert_eq!(a.argv, ["falcon", "train"]);
        let a = train(&a);
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
        let a = expand_with(
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
        let a = train(&a);
        assert_eq!(a.workers, 2);
        assert_eq!(a.lr, Some(0.25));
        // A repeatable flag typed by the user replaces the file's list, not adds to it.
        assert_eq!(a.hetero, ["0:none"]);
        assert!(a.quiet && a.metrics);
        // The rest of the file still applies.
        assert_eq!(a.policy, "ssp(3)");
        assert_eq!(a.eval_every, 16);
    }

    #[test]
    fn flags_override_the_file_without_args_override_self() {
        let f = TempFile::new("no-override", TRAIN);
        let mut a = expand_with(
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
        a.cmd = a.cmd.args_override_self(false);
        let a = train(&a);
        assert_eq!(a.workers, 3);
        assert!(a.quiet);
    }

    #[test]
    fn flags_after_a_positional_argument_override_the_file() {
        let f = TempFile::new("positional", "[bench]\nquick = true\n");
        let a = expand_with(&["falcon", "--config", f.path(), "bench", "knee"], &[]).unwrap();
        assert_eq!(
            parse(&a),
            Sub::Bench {
                what: "knee".into(),
                quick: true
            }
        );
        let a = expand_with(
            &["falcon", "--config", f.path(), "bench", "knee", "--quick"],
            &[],
        )
        .unwrap();
        assert!(matches!(parse(&a), Sub::Bench { quick: true, .. }));
    }

    #[test]
    fn args_override_self_takes_the_last_value() {
        // What the caller's `args_override_self(true)` gives: the last of a repeated flag,
        // for every kind but the repeatable one, which appends.
        let a = train(&plain(&[
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
        ]));
        assert_eq!((a.workers, a.lr, a.quiet), (2, Some(2.0), true));
        assert_eq!(a.hetero, ["a", "b"]);
    }

    #[test]
    fn environment_overrides_the_file() {
        // CARGO_PKG_NAME is set by `cargo test` in the real environment, which clap reads:
        // it beats the file; FALCON_TEST_SEED is not set, so the file gives the seed.
        let f = TempFile::new(
            "env-real",
            "[train]\ncrate-name = \"from-file\"\nseed = 5\n",
        );
        let a = expand_with(&["falcon", "--config", f.path(), "train"], &[]).unwrap();
        let expected = std::env::var("CARGO_PKG_NAME").unwrap_or_else(|_| "from-file".into());
        let t = train(&a);
        assert_eq!(t.crate_name, expected);
        assert_eq!(t.seed, 5);
        // A flag beats both.
        let mut typed = a;
        typed.argv.push("--crate-name=typed".into());
        assert_eq!(train(&typed).crate_name, "typed");
    }

    #[test]
    fn a_bad_value_from_the_file_is_refused_by_the_commands_own_parser() {
        let f = TempFile::new("bad-number", "[train]\nworkers = \"many\"\n");
        let a = expand_with(&["falcon", "--config", f.path(), "train"], &[]).unwrap();
        let e = try_parse(&a).unwrap_err().to_string();
        assert!(e.contains("invalid value 'many' for '--workers"), "{e}");
    }

    #[test]
    fn unknown_key_lists_the_valid_keys() {
        let f = TempFile::new("unknown", "[train]\nworkers = 2\nwokers = 3\n");
        let e = expand_with(&["falcon", "--config", f.path(), "train"], &[])
            .err()
            .unwrap();
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

    fn refused(argv: &[&str], env: &[(&str, &str)]) -> ConfigError {
        match expand_with(argv, env) {
            Ok(a) => panic!("applied: {:?}", a.argv),
            Err(e) => e,
        }
    }

    #[test]
    fn top_level_key_is_an_error() {
        let f = TempFile::new("top", "workers = 2\n\n[train]\nquiet = true\n");
        let e = refused(&["falcon", "--config", f.path(), "train"], &[]);
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
        let e = refused(&["falcon", "--config", f.path(), "train"], &[]);
        let msg = e.to_string();
        assert!(
            matches!(e, ConfigError::UnknownSection { line: 1, .. }),
            "{e:?}"
        );
        assert!(msg.contains("unknown section [trian]"), "{msg}");
        assert!(
            msg.contains("train, sim, experiment, bench, doctor, role"),
            "{msg}"
        );
        let f = TempFile::new("aot", "[[train]]\nworkers = 2\n");
        let e = refused(&["falcon", "--config", f.path(), "train"], &[]);
        assert!(matches!(e, ConfigError::NotATable { .. }), "{e:?}");
    }

    #[test]
    fn missing_file_is_an_error_naming_it() {
        let path = std::env::temp_dir().join("falcon-config-test-no-such-file.toml");
        let path = path.to_str().unwrap();
        let e = refused(&["falcon", "train", "--config", path], &[]);
        assert!(matches!(e, ConfigError::Read { .. }), "{e:?}");
        assert!(e.to_string().contains(path), "{e}");
    }

    #[test]
    fn syntax_error_names_the_file_and_line() {
        let f = TempFile::new("syntax", "[train]\nworkers = = 2\n");
        let e = refused(&["falcon", "--config", f.path(), "train"], &[]);
        assert!(matches!(e, ConfigError::Syntax { .. }), "{e:?}");
        let msg = e.to_string();
        assert!(msg.contains(f.path()), "{msg}");
        assert!(msg.contains("line 2"), "{msg}");
        // A key given twice is the parser's error too.
        let f = TempFile::new("dup", "[train]\nworkers = 1\nworkers = 2\n");
        let e = refused(&["falcon", "--config", f.path(), "train"], &[]);
        assert!(matches!(e, ConfigError::Syntax { .. }), "{e:?}");
    }

    #[test]
    fn snake_and_kebab_spellings_of_one_key_are_an_error() {
        let f = TempFile::new("dup2", "[train]\neval_every = 1\neval-every = 2\n");
        let e = refused(&["falcon", "--config", f.path(), "train"], &[]);
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
        let a = expand_with(&["falcon", "train", &flag, "--quiet"], &[]).unwrap();
        assert_eq!(a.argv, ["falcon", "train", "--quiet"]);
        assert_eq!(train(&a).workers, 9);
    }

    #[test]
    fn falcon_config_names_the_file_and_the_flag_beats_it() {
        let env_file = TempFile::new("envfile", "[train]\nworkers = 5\n");
        let flag_file = TempFile::new("flagfile", "[train]\nworkers = 6\n");
        let a = expand_with(&["falcon", "train"], &[(ENV_VAR, env_file.path())]).unwrap();
        assert_eq!(train(&a).workers, 5);
        let a = expand_with(
            &["falcon", "train", "--config", flag_file.path()],
            &[(ENV_VAR, env_file.path())],
        )
        .unwrap();
        assert_eq!(train(&a).workers, 6);
        // An empty FALCON_CONFIG is no file.
        let a = expand_with(&["falcon", "train"], &[(ENV_VAR, "")]).unwrap();
        assert_eq!(train(&a).workers, 4);
    }

    #[test]
    fn config_without_a_value_is_an_error() {
        for argv in [
            &["falcon", "train", "--config"][..],
            &["falcon", "--config", "--workers", "2", "train"],
            &["falcon", "train", "--config="],
        ] {
            let e = refused(argv, &[]);
            assert!(matches!(e, ConfigError::MissingValue), "{argv:?}: {e:?}");
        }
    }

    #[test]
    fn booleans_and_arrays() {
        let f = TempFile::new(
            "bool",
            "[train]\nquiet = false\nmetrics = true\npolicy = [\"bsp\", \"epsp\"]\nhetero = \"1:h=0.5\"\n",
        );
        let a = train(&expand_with(&["falcon", "--config", f.path(), "train"], &[]).unwrap());
        assert!(!a.quiet && a.metrics);
        assert_eq!(a.policy, "bsp,epsp");
        assert_eq!(a.hetero, ["1:h=0.5"]);
        // An empty list for a repeatable flag sets nothing.
        let f = TempFile::new("empty", "[train]\nhetero = []\n");
        let a = train(&expand_with(&["falcon", "--config", f.path(), "train"], &[]).unwrap());
        assert!(a.hetero.is_empty());
        // A switch takes only a boolean; values take no tables or nested arrays.
        for (name, text) in [
            ("bad-switch", "[train]\nquiet = \"yes\"\n"),
            ("bad-table", "[train]\nworkers = { n = 1 }\n"),
            ("bad-nested", "[train]\nhetero = [[\"a\"]]\n"),
        ] {
            let f = TempFile::new(name, text);
            let e = refused(&["falcon", "--config", f.path(), "train"], &[]);
            assert!(
                matches!(e, ConfigError::BadValue { line: 2, .. }),
                "{name}: {e:?}"
            );
        }
    }

    #[test]
    fn every_section_is_checked_and_each_applies_to_its_subcommand() {
        let f = TempFile::new("sim", "[sim]\nworkers = 99\n[train]\nworkers = 3\n");
        let a = expand_with(&["falcon", "--config", f.path(), "train"], &[]).unwrap();
        assert_eq!(train(&a).workers, 3);
        let a = expand_with(&["falcon", "--config", f.path(), "sim"], &[]).unwrap();
        assert_eq!(
            parse(&a),
            Sub::Sim(SimArgs {
                workers: 99,
                policies: "bsp,epsp".into()
            })
        );
        // A subcommand with no section gets nothing.
        let a = expand_with(&["falcon", "--config", f.path(), "doctor"], &[]).unwrap();
        assert_eq!(parse(&a), Sub::Doctor);
        // A mistake in another subcommand's section is found whichever runs.
        let f = TempFile::new(
            "other",
            "[sim]\nworkers = 99\nnot-a-sim-key = 1\n\n[train]\nworkers = 3\n",
        );
        let e = refused(&["falcon", "--config", f.path(), "train"], &[]);
        assert!(
            matches!(e, ConfigError::UnknownKey { line: 3, .. }),
            "{e:?}"
        );
    }

    #[test]
    fn the_role_section_sets_the_roles_variables() {
        let vars = [
            "FALCON_POLICY",
            "FALCON_HETERO",
            "DMLC_NUM_WORKER",
            "FALCON_LR",
        ];
        let role = |text: &str| {
            let f = TempFile::new("role", text);
            apply(
                Cli::command(),
                os(&["falcon", "--config", f.path(), "role"]),
                |_| None,
                &vars,
            )
            .map(|(_, argv, vars)| (argv, vars))
        };
        let (argv, got) = role(
            "[role]\npolicy = \"ssp(3)\"\nDMLC_NUM_WORKER = 4\nhetero = [\"0:h=0.5\", \"1:none\"]\nLr = 0.1\n",
        )
        .unwrap();
        assert_eq!(argv, os(&["falcon", "role"]));
        let got: Vec<(&str, &str)> = got.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        assert_eq!(
            got,
            [
                ("FALCON_POLICY", "ssp(3)"),
                ("DMLC_NUM_WORKER", "4"),
                ("FALCON_HETERO", "0:h=0.5;1:none"),
                ("FALCON_LR", "0.1"),
            ]
        );
        let e = role("[role]\npolicy = \"bsp\"\nRUST_LOG = \"debug\"\n").unwrap_err();
        assert!(
            matches!(e, ConfigError::UnknownKey { line: 3, .. }),
            "{e:?}"
        );
        assert!(
            e.to_string().contains("FALCON_POLICY, FALCON_HETERO"),
            "{e}"
        );
        let e = role("[role]\npolicy = \"bsp\"\nFALCON_POLICY = \"asp\"\n").unwrap_err();
        assert!(
            matches!(e, ConfigError::DuplicateKey { line: 3, .. }),
            "{e:?}"
        );
        let e = role("[role]\npolicy = { a = 1 }\n").unwrap_err();
        assert!(matches!(e, ConfigError::BadValue { line: 2, .. }), "{e:?}");
    }

    #[test]
    fn nothing_is_read_without_a_subcommand_or_after_double_dash() {
        let missing = "/nonexistent/falcon.toml";
        let a = expand_with(&["falcon", "--config", missing], &[]).unwrap();
        assert_eq!(a.argv, ["falcon"]);
        let a = expand_with(&["falcon", "--help"], &[(ENV_VAR, missing)]).unwrap();
        assert_eq!(a.argv, ["falcon", "--help"]);
        // After `--`, `--config` is an operand, left alone.
        let a = expand_with(&["falcon", "--", "--config", "x"], &[]).unwrap();
        assert_eq!(a.argv, ["falcon", "--", "--config", "x"]);
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
        let a = train(&expand_with(&["falcon", "--config", f.path(), "train"], &[]).unwrap());
        assert_eq!(
            (a.workers, a.policy.as_str(), a.quiet),
            (4, "dssp(3,15)", true)
        );
        assert_eq!(a.hetero.len(), 2);
        let a = expand_with(&["falcon", "--config", f.path(), "sim"], &[]).unwrap();
        assert!(matches!(parse(&a), Sub::Sim(SimArgs { workers: 16, .. })));
        let a = expand_with(&["falcon", "--config", f.path(), "experiment", "dssp"], &[]).unwrap();
        let Sub::Experiment(ExperimentArgs {
            which: Which::Dssp(k),
        }) = parse(&a)
        else {
            panic!("{:?}", a.argv);
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

    fn experiment(a: &Applied) -> Which {
        match parse(a) {
            Sub::Experiment(e) => e.which,
            other => panic!("not experiment: {other:?}"),
        }
    }

    #[test]
    fn nested_subcommands_read_their_section_then_their_subsection() {
        let f = TempFile::new("nested", EXPERIMENT);
        let a = expand_with(&["falcon", "--config", f.path(), "experiment", "dssp"], &[]).unwrap();
        // The section's keys apply to each experiment that has them; its subsection wins.
        let Which::Dssp(k) = experiment(&a) else {
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
        let a = expand_with(
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
        let Which::Fluentps(k) = experiment(&a) else {
            panic!()
        };
        assert_eq!((k.workers, k.out, k.quick), (Some(7), None, true));
        assert_eq!(k.mode.as_deref(), Some("sim"));
        // One without most of the keys: those are left out.
        let a = expand_with(
            &["falcon", "--config", f.path(), "experiment", "zipline"],
            &[],
        )
        .unwrap();
        assert_eq!(
            experiment(&a),
            Which::Zipline {
                out: Some("zip-out".into()),
                quick: true
            }
        );
        // No experiment named: clap asks for one.
        let a = expand_with(&["falcon", "--config", f.path(), "experiment"], &[]).unwrap();
        assert!(try_parse(&a).is_err());
    }

    #[test]
    fn nested_sections_check_their_keys() {
        let f = TempFile::new("nested-bad", "[experiment]\nmode = \"sim\"\nwokers = 1\n");
        let e = refused(&["falcon", "--config", f.path(), "experiment", "dssp"], &[]);
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
        let e = refused(
            &["falcon", "--config", f.path(), "experiment", "zipline"],
            &[],
        );
        assert!(
            e.to_string().contains(
                "unknown key `mode` in [experiment.zipline]; the keys of [experiment.zipline] \
                 are: out, quick"
            ),
            "{e}"
        );
        // A subsection named after no experiment.
        let f = TempFile::new("nested-bad3", "[experiment.dsp]\nworkers = 1\n");
        let e = refused(&["falcon", "--config", f.path(), "experiment", "dssp"], &[]);
        assert!(matches!(e, ConfigError::UnknownKey { .. }), "{e:?}");
        assert!(
            e.to_string().contains("unknown key `dsp` in [experiment]"),
            "{e}"
        );
    }
}
