//! Log lines: on standard error, coloured only when it is a terminal (a log file or a pipe
//! gets plain text), each line naming the process's role and rank once they are known
//! (`[worker 1] 2026-… WARN …`), so the lines of a job's processes can be told apart when
//! they are gathered in one place.

use std::io::IsTerminal;
use std::sync::RwLock;

use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::{DefaultFields, Format, Full, Writer};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// The label every line starts with (empty: none).
static LABEL: RwLock<String> = RwLock::new(String::new());

/// From now on every log line of this process starts with `[label] `.
pub fn label(label: impl Into<String>) {
    *LABEL.write().unwrap_or_else(|p| p.into_inner()) = label.into();
}

/// The default line format, after the process's label.
struct Labelled(Format<Full>);

impl<S, N> FormatEvent<S, N> for Labelled
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'w> FormatFields<'w> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> std::fmt::Result {
        {
            let label = LABEL.read().unwrap_or_else(|p| p.into_inner());
            if !label.is_empty() {
                write!(writer, "[{label}] ")?;
            }
        }
        self.0.format_event(ctx, writer, event)
    }
}

/// Sets up logging to standard error: `RUST_LOG` (default `warn`), colour only on a terminal,
/// each line labelled (see [`label`]).
pub fn init() {
    let ansi = std::io::stderr().is_terminal();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .fmt_fields(DefaultFields::new())
        .event_format(Labelled(Format::default().with_ansi(ansi)))
        .init();
}
