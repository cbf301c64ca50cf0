//! Process hygiene: standard output that may close under us, the signals `falcon local`
//! forwards to its role processes, and role processes that die with the process that
//! started them.
//!
//! Exit statuses of `falcon`: 0 success; 1 an error (its message on stderr); 2 a usage error
//! or a value refused before anything started; 128 + N when `falcon local` was stopped by
//! signal N (130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP) after its role processes are
//! gone; [`EXIT_STDOUT_CLOSED`] (141) when standard output was closed under it (`falcon
//! train | head -1`): the program then ends at once and quietly, as a program killed by
//! SIGPIPE would.

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The exit status when standard output is closed: 128 + SIGPIPE, what a shell reports for a
/// program that a closed pipe ended.
pub const EXIT_STDOUT_CLOSED: i32 = 141;

/// Prints a line on standard output; a closed standard output ends the program (see
/// [`stdout_failed`]). Use it instead of `println!`, which panics there.
macro_rules! outln {
    () => {
        $crate::hygiene::write_stdout(format_args!(""), true)
    };
    ($($arg:tt)*) => {
        $crate::hygiene::write_stdout(format_args!($($arg)*), true)
    };
}

/// Writes `args` (and a newline) to standard output.
pub fn write_stdout(args: std::fmt::Arguments<'_>, newline: bool) {
    let result = {
        let mut out = std::io::stdout().lock();
        out.write_fmt(args).and_then(|()| {
            if newline {
                out.write_all(b"\n")
            } else {
                Ok(())
            }
        })
    };
    if let Err(e) = result {
        stdout_failed(&e);
    }
}

/// Flushes standard output (what is still buffered at the end of the program).
pub fn flush_stdout() {
    if let Err(e) = std::io::stdout().lock().flush() {
        stdout_failed(&e);
    }
}

/// Standard output failed: closed (the reader of the pipe is gone) ends the program quietly
/// with [`EXIT_STDOUT_CLOSED`]; any other failure is said on stderr and ends it with 1.
/// Nothing is left running: `falcon train` is one process; the role processes of `falcon
/// local` die with it (their parent-death signal).
pub fn stdout_failed(e: &std::io::Error) -> ! {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(EXIT_STDOUT_CLOSED);
    }
    let _ = writeln!(
        std::io::stderr(),
        "falcon: error: cannot write to standard output: {e}"
    );
    std::process::exit(1);
}

/// Says `falcon: error: {e}` on stderr; a closed stderr is no reason to panic.
pub fn error_line(e: &dyn std::fmt::Display) {
    let _ = writeln!(std::io::stderr().lock(), "falcon: error: {e}");
}

/// The variable with which `falcon local` tells a role process its pid: the role then dies
/// with it.
pub const PARENT_PID_VAR: &str = "FALCON_PARENT_PID";

/// Why a role process refuses to start under the parent named by [`PARENT_PID_VAR`].
#[derive(Debug, thiserror::Error)]
pub enum ParentError {
    /// The variable is not a process id.
    #[error("{PARENT_PID_VAR}={value}: not a process id (a whole number > 0)")]
    BadPid {
        /// Its value.
        value: String,
    },
    /// The kernel refused the parent-death signal.
    #[error("cannot ask to die with the parent process (prctl PR_SET_PDEATHSIG): {0}")]
    Prctl(std::io::Error),
    /// The parent died before the parent-death signal was set.
    #[error(
        "the process that started this role (pid {pid}) is gone; not starting (this role would \
         be left running on its own)"
    )]
    Gone {
        /// The parent's pid.
        pid: i32,
    },
}

/// When `FALCON_PARENT_PID` is set (by `falcon local`): this process gets SIGTERM when its
/// parent dies, and refuses to start if the parent already has (the window between its fork
/// and the `prctl`).
pub fn die_with_parent() -> Result<(), ParentError> {
    let Some(value) = std::env::var_os(PARENT_PID_VAR) else {
        return Ok(());
    };
    let value = value.to_string_lossy().into_owned();
    let pid: i32 = value
        .trim()
        .parse()
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| ParentError::BadPid {
            value: value.clone(),
        })?;
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::TERM))
        .map_err(|e| ParentError::Prctl(e.into()))?;
    match rustix::process::getppid() {
        Some(p) if p.as_raw_nonzero().get() == pid => Ok(()),
        _ => Err(ParentError::Gone { pid }),
    }
}

/// SIGINT, SIGTERM and SIGHUP, noted instead of ending the process (for as long as this
/// lives), so that `falcon local` can forward them to its role processes and wait for them.
pub struct Interrupts {
    got: Arc<AtomicUsize>,
    ids: Vec<signal_hook::SigId>,
}

/// The signals [`Interrupts`] catches.
const CAUGHT: [i32; 3] = [
    signal_hook::consts::SIGINT,
    signal_hook::consts::SIGTERM,
    signal_hook::consts::SIGHUP,
];

impl Interrupts {
    /// Starts catching the signals.
    pub fn catch() -> std::io::Result<Interrupts> {
        let got = Arc::new(AtomicUsize::new(0));
        let mut ids = Vec::new();
        for sig in CAUGHT {
            ids.push(signal_hook::flag::register_usize(
                sig,
                got.clone(),
                sig as usize,
            )?);
        }
        Ok(Interrupts { got, ids })
    }

    /// The last signal caught, if any.
    pub fn received(&self) -> Option<i32> {
        match self.got.load(Ordering::SeqCst) {
            0 => None,
            s => i32::try_from(s).ok(),
        }
    }
}

impl Drop for Interrupts {
    fn drop(&mut self) {
        for id in self.ids.drain(..) {
            signal_hook::low_level::unregister(id);
        }
    }
}

/// The name of a signal `falcon local` forwards.
pub fn signal_name(sig: i32) -> &'static str {
    match sig {
        signal_hook::consts::SIGINT => "SIGINT",
        signal_hook::consts::SIGTERM => "SIGTERM",
        signal_hook::consts::SIGHUP => "SIGHUP",
        signal_hook::consts::SIGKILL => "SIGKILL",
        _ => "a signal",
    }
}

/// The rustix signal of a caught one (SIGTERM for any other).
pub fn rustix_signal(sig: i32) -> rustix::process::Signal {
    use rustix::process::Signal;
    match sig {
        signal_hook::consts::SIGINT => Signal::INT,
        signal_hook::consts::SIGHUP => Signal::HUP,
        signal_hook::consts::SIGKILL => Signal::KILL,
        _ => Signal::TERM,
    }
}
