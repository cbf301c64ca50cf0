//! falcon's C ABI: a worker process written in C (or any language with a C FFI) joins a
//! falcon job, declares its tensors, and pushes gradients and pulls parameters as float
//! arrays. The header is `capi/include/falcon.h`, generated from this file by cbindgen
//! (see `capi/README.md`).
//!
//! Conventions, for every function:
//!
//! - it returns an `int`: `FALCON_OK` (0) on success, a negative `FALCON_ERR_*` code on
//!   failure (a few also return a non-negative answer, said in their documentation);
//! - on failure, `falcon_last_error` and `falcon_last_error_code` tell the calling
//!   thread what went wrong (a thread-local record, like `errno`: a success leaves it as
//!   it was);
//! - no Rust panic crosses the boundary: one is caught and reported as
//!   `FALCON_ERR_PANIC`;
//! - a null pointer where one is required is `FALCON_ERR_NULL`, never a crash; a length
//!   that is not the tensor's is `FALCON_ERR_WRONG_LENGTH`. What C cannot tell — a pointer
//!   to too little memory, a freed object — remains the caller's to get right.
//!
//! Data moves by copy: a push copies the caller's floats into memory registered with the
//! transport before it returns (so the caller's array may be reused at once, even for an
//! asynchronous push), and a pull lands in registered memory and is copied into the
//! caller's array when it completes (so for an asynchronous pull the destination must stay
//! valid until the handle's wait returns). Registered memory is kept per tensor and reused.

#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_int};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use falcon_engine::Error as EngineError;
use falcon_engine::keys::TensorSpec;
use falcon_engine::launch::{Launch, LaunchError};
use falcon_engine::proto::Role;
use falcon_transport::Region;

// --- codes -----------------------------------------------------------------------------------

/// The codes the functions return: `FALCON_OK`, `FALCON_PENDING` (a wait that timed out),
/// or a negative error. The functions' return type is `int`; these are its values.
#[repr(C)]
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum falcon_code {
    /// Success.
    FALCON_OK = 0,
    /// Not an error: `falcon_handle_wait_for` returned before the operation completed.
    FALCON_PENDING = 1,
    /// Invalid configuration: a launch variable or argument refused, no role, a worker that
    /// has finished, a tensor declared twice.
    FALCON_ERR_CONFIG = -1,
    /// No tensor of that name was declared at join.
    FALCON_ERR_UNKNOWN_TENSOR = -2,
    /// An array's length is not the tensor's.
    FALCON_ERR_WRONG_LENGTH = -3,
    /// A clock that is not valid now (a push at a clock other than the tensor's next, a pull
    /// from the future).
    FALCON_ERR_BAD_CLOCK = -4,
    /// A peer is gone: the scheduler or a server unreachable or dead, this worker evicted or
    /// cut off from the scheduler, a server fenced.
    FALCON_ERR_PEER_GONE = -5,
    /// Something did not happen in time (a push's acknowledgement, the rendezvous).
    FALCON_ERR_TIMEOUT = -6,
    /// The data plane failed (a link, a socket, registered memory), or a malformed message.
    FALCON_ERR_TRANSPORT = -7,
    /// A required pointer is null (a worker or handle not initialized, a null array or name).
    FALCON_ERR_NULL = -8,
    /// A panic inside falcon, caught at the boundary (a bug: please report the message).
    FALCON_ERR_PANIC = -9,
    /// The scheduler refused this worker (a wrong token, a rank taken, the job full).
    FALCON_ERR_REFUSED = -10,
    /// A server checkpoint failed, and the job is set to stop on that.
    FALCON_ERR_CHECKPOINT = -11,
    /// An argument that cannot be used: a string that is not UTF-8, a tensor of no floats, a
    /// negative count.
    FALCON_ERR_ARGUMENT = -12,
    /// An operating-system call failed: a thread that cannot start, an address that cannot
    /// be listened on.
    FALCON_ERR_SYSTEM = -13,
}

const FALCON_OK: c_int = falcon_code::FALCON_OK as c_int;
const FALCON_PENDING: c_int = falcon_code::FALCON_PENDING as c_int;
const FALCON_ERR_CONFIG: c_int = falcon_code::FALCON_ERR_CONFIG as c_int;
const FALCON_ERR_UNKNOWN_TENSOR: c_int = falcon_code::FALCON_ERR_UNKNOWN_TENSOR as c_int;
const FALCON_ERR_WRONG_LENGTH: c_int = falcon_code::FALCON_ERR_WRONG_LENGTH as c_int;
const FALCON_ERR_BAD_CLOCK: c_int = falcon_code::FALCON_ERR_BAD_CLOCK as c_int;
const FALCON_ERR_PEER_GONE: c_int = falcon_code::FALCON_ERR_PEER_GONE as c_int;
const FALCON_ERR_TIMEOUT: c_int = falcon_code::FALCON_ERR_TIMEOUT as c_int;
const FALCON_ERR_TRANSPORT: c_int = falcon_code::FALCON_ERR_TRANSPORT as c_int;
const FALCON_ERR_NULL: c_int = falcon_code::FALCON_ERR_NULL as c_int;
const FALCON_ERR_PANIC: c_int = falcon_code::FALCON_ERR_PANIC as c_int;
const FALCON_ERR_REFUSED: c_int = falcon_code::FALCON_ERR_REFUSED as c_int;
const FALCON_ERR_CHECKPOINT: c_int = falcon_code::FALCON_ERR_CHECKPOINT as c_int;
const FALCON_ERR_ARGUMENT: c_int = falcon_code::FALCON_ERR_ARGUMENT as c_int;
const FALCON_ERR_SYSTEM: c_int = falcon_code::FALCON_ERR_SYSTEM as c_int;

/// A failure on its way to the caller: its code and its message.
struct Failure {
    code: c_int,
    msg: String,
}

impl Failure {
    fn new(code: c_int, msg: impl Into<String>) -> Failure {
        Failure {
            code,
            msg: msg.into(),
        }
    }

    fn null(what: &str) -> Failure {
        Failure::new(FALCON_ERR_NULL, format!("{what} must not be NULL"))
    }
}

impl From<EngineError> for Failure {
    fn from(e: EngineError) -> Failure {
        use EngineError as E;
        let code = match &e {
            E::Config(_) => FALCON_ERR_CONFIG,
            E::UnknownTensor(_) => FALCON_ERR_UNKNOWN_TENSOR,
            E::WrongLength { .. } => FALCON_ERR_WRONG_LENGTH,
            E::BadClock { .. } => FALCON_ERR_BAD_CLOCK,
            E::PeerGone { .. } | E::Evicted { .. } | E::SchedulerLost { .. } | E::Fenced { .. } => {
                FALCON_ERR_PEER_GONE
            }
            E::Refused(_) | E::Server { .. } => FALCON_ERR_REFUSED,
            E::Timeout(..) | E::Rendezvous { .. } => FALCON_ERR_TIMEOUT,
            E::Transport(_) | E::Malformed(_) | E::Cuda(_) => FALCON_ERR_TRANSPORT,
            E::Checkpoint(_) | E::CheckpointFailed { .. } => FALCON_ERR_CHECKPOINT,
            E::Os { .. } => FALCON_ERR_SYSTEM,
        };
        Failure::new(code, e.to_string())
    }
}

impl From<falcon_transport::Error> for Failure {
    fn from(e: falcon_transport::Error) -> Failure {
        Failure::from(EngineError::from(e))
    }
}

impl From<LaunchError> for Failure {
    fn from(e: LaunchError) -> Failure {
        Failure::new(FALCON_ERR_CONFIG, e.to_string())
    }
}

type Res<T> = Result<T, Failure>;

// --- the thread's last error -----------------------------------------------------------------

thread_local! {
    /// The calling thread's last failure: its code and message.
    static LAST: RefCell<(c_int, CString)> = RefCell::new((FALCON_OK, CString::default()));
}

/// Records `f` as the calling thread's last failure.
fn record(f: &Failure) {
    // A message with a NUL byte (a tensor name from C cannot hold one, but a peer's text
    // might) is cut there rather than lost.
    let text = f.msg.split('\0').next().unwrap_or_default();
    let msg = CString::new(text).unwrap_or_default();
    // During thread teardown the record may be gone already: then there is no one to tell.
    let _ = LAST.try_with(|l| *l.borrow_mut() = (f.code, msg));
}

/// The text of a caught panic.
fn panic_text(payload: &(dyn std::any::Any + Send)) -> &str {
    if let Some(s) = payload.downcast_ref::<&'static str>() {
        s
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s
    } else {
        "a panic without a message"
    }
}

/// Runs one C entry point's body: its failure is recorded and becomes its code; a panic is
/// caught here and becomes `FALCON_ERR_PANIC`.
fn guard(body: impl FnOnce() -> Res<c_int>) -> c_int {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(code)) => code,
        Ok(Err(f)) => {
            record(&f);
            f.code
        }
        Err(payload) => {
            let f = Failure::new(
                FALCON_ERR_PANIC,
                format!(
                    "internal error in falcon (a panic, caught at the C boundary): {}",
                    panic_text(payload.as_ref())
                ),
            );
            record(&f);
            // The payload's own destructor must not unwind out of here either.
            let _ = catch_unwind(AssertUnwindSafe(move || drop(payload)));
            f.code
        }
    }
}

/// The message of the calling thread's last error: a NUL-terminated UTF-8 string, empty if
/// no falcon function has failed on this thread.
///
/// The string belongs to falcon: do not free it. It stays valid until the next falcon
/// function fails on the same thread (copy it to keep it longer). A successful call leaves
/// the record as it was, so read it right after a function returned a negative code.
///
/// Thread safety: safe from any thread; each thread has its own record.
#[unsafe(no_mangle)]
pub extern "C" fn falcon_last_error() -> *const c_char {
    // The CString lives in the thread-local record until the next failure replaces it.
    catch_unwind(|| {
        LAST.try_with(|l| l.borrow().1.as_ptr())
            .unwrap_or(c"".as_ptr())
    })
    .unwrap_or(c"".as_ptr())
}

/// The code of the calling thread's last error (a negative `FALCON_ERR_*`), or `FALCON_OK`
/// if no falcon function has failed on this thread.
///
/// Thread safety: safe from any thread; each thread has its own record.
#[unsafe(no_mangle)]
pub extern "C" fn falcon_last_error_code() -> c_int {
    catch_unwind(|| LAST.try_with(|l| l.borrow().0).unwrap_or(FALCON_OK)).unwrap_or(FALCON_OK)
}

/// The name of a code (`"FALCON_ERR_BAD_CLOCK"`, …), or `"FALCON_UNKNOWN_CODE"`: a static
/// string, never to be freed.
///
/// Thread safety: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn falcon_code_name(code: c_int) -> *const c_char {
    let name: &'static CStr = match code {
        FALCON_OK => c"FALCON_OK",
        FALCON_PENDING => c"FALCON_PENDING",
        FALCON_ERR_CONFIG => c"FALCON_ERR_CONFIG",
        FALCON_ERR_UNKNOWN_TENSOR => c"FALCON_ERR_UNKNOWN_TENSOR",
        FALCON_ERR_WRONG_LENGTH => c"FALCON_ERR_WRONG_LENGTH",
        FALCON_ERR_BAD_CLOCK => c"FALCON_ERR_BAD_CLOCK",
        FALCON_ERR_PEER_GONE => c"FALCON_ERR_PEER_GONE",
        FALCON_ERR_TIMEOUT => c"FALCON_ERR_TIMEOUT",
        FALCON_ERR_TRANSPORT => c"FALCON_ERR_TRANSPORT",
        FALCON_ERR_NULL => c"FALCON_ERR_NULL",
        FALCON_ERR_PANIC => c"FALCON_ERR_PANIC",
        FALCON_ERR_REFUSED => c"FALCON_ERR_REFUSED",
        FALCON_ERR_CHECKPOINT => c"FALCON_ERR_CHECKPOINT",
        FALCON_ERR_ARGUMENT => c"FALCON_ERR_ARGUMENT",
        FALCON_ERR_SYSTEM => c"FALCON_ERR_SYSTEM",
        _ => c"FALCON_UNKNOWN_CODE",
    };
    name.as_ptr()
}

// --- arguments -------------------------------------------------------------------------------

/// A C string argument as UTF-8 text.
///
/// # Safety
///
/// `p` is null or points to a NUL-terminated string that lives for `'a`.
unsafe fn text<'a>(p: *const c_char, what: &str) -> Res<&'a str> {
    if p.is_null() {
        return Err(Failure::null(what));
    }
    // SAFETY: non-null, and NUL-terminated and live by the caller's contract.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str()
        .map_err(|_| Failure::new(FALCON_ERR_ARGUMENT, format!("{what} is not UTF-8 text")))
}

/// An optional C string argument: null or empty is `None`.
///
/// # Safety
///
/// As [`text`].
unsafe fn optional_text<'a>(p: *const c_char, what: &str) -> Res<Option<&'a str>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: forwarded contract.
    let s = unsafe { text(p, what) }?;
    Ok((!s.is_empty()).then_some(s))
}

/// Sets an out-pointer to NULL, so that a failure leaves no stale pointer behind.
///
/// # Safety
///
/// `out` is null or valid for a write of one pointer.
unsafe fn clear<T>(out: *mut *mut T, what: &str) -> Res<()> {
    // SAFETY: forwarded contract.
    unsafe { put(out, std::ptr::null_mut(), what) }.map(|_| ())
}

/// Stores `value` through an out-pointer.
///
/// # Safety
///
/// `out` is null or valid for a write of one `T`.
unsafe fn put<T>(out: *mut T, value: T, what: &str) -> Res<c_int> {
    if out.is_null() {
        return Err(Failure::null(what));
    }
    // SAFETY: non-null and valid for a write by the caller's contract.
    unsafe { out.write(value) };
    Ok(FALCON_OK)
}

// --- the worker ------------------------------------------------------------------------------

/// A worker of a falcon job (opaque): made by `falcon_join` or `falcon_join_with`, released
/// by `falcon_worker_free`.
pub struct FalconWorker {
    shared: Arc<Shared>,
}

/// What a worker and its handles share.
struct Shared {
    w: falcon_engine::Worker,
    /// Registered regions waiting for reuse, by tensor index.
    regions: Mutex<HashMap<usize, Vec<Region>>>,
    /// The scheduler and servers a launched rank hosts beside this worker (rank 0, each
    /// node's first rank), until `falcon_finish` waits for the job's end with them.
    hosted: Mutex<Option<falcon_engine::local::HostedRoles>>,
}

/// Regions kept per tensor for reuse (more in flight at once are made and dropped).
const KEPT_REGIONS: usize = 4;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    /// The tensor's index, checking that `len` floats are its length.
    fn tensor(&self, name: &str, len: usize) -> Res<usize> {
        let keymap = self.w.keymap();
        let t = keymap.tensor(name)?;
        let spec = &keymap.tensors[t];
        if len as u64 != spec.len {
            return Err(EngineError::WrongLength {
                tensor: spec.name.clone(),
                expected: spec.len,
                got: len as u64,
            }
            .into());
        }
        Ok(t)
    }

    /// A registered region for tensor `t` (a kept one, or a new one).
    fn take(&self, t: usize) -> Res<Region> {
        if let Some(r) = lock(&self.regions).get_mut(&t).and_then(Vec::pop) {
            return Ok(r);
        }
        Ok(Region::new(self.w.keymap().tensors[t].len * 4)?)
    }

    /// Keeps `r` for reuse: only once nothing of the engine may still read or write it (its
    /// operation completed successfully).
    fn give(&self, t: usize, r: Region) {
        let mut kept = lock(&self.regions);
        let v = kept.entry(t).or_default();
        if v.len() < KEPT_REGIONS {
            v.push(r);
        }
    }
}

/// The worker behind a pointer.
///
/// # Safety
///
/// `w` is null or a pointer from `falcon_join*` not yet freed.
unsafe fn worker<'a>(w: *const FalconWorker) -> Res<&'a Arc<Shared>> {
    if w.is_null() {
        return Err(Failure::null("the worker"));
    }
    // SAFETY: a live worker by the caller's contract; only shared access is made.
    Ok(unsafe { &(*w).shared })
}

/// A float array argument as bytes, its length checked against the tensor's.
///
/// # Safety
///
/// `p` is null or valid for reads of `len` floats for `'a`.
unsafe fn float_bytes<'a>(p: *const f32, len: usize, what: &str) -> Res<&'a [u8]> {
    if p.is_null() {
        return Err(Failure::null(what));
    }
    // A length the tensor matched fits in memory; this guards the multiplication alone.
    let bytes = len
        .checked_mul(4)
        .ok_or_else(|| Failure::new(FALCON_ERR_WRONG_LENGTH, format!("{what}: {len} floats")))?;
    // SAFETY: non-null and valid for `len` floats (bytes, no alignment needed) by the
    // caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(p.cast::<u8>(), bytes) })
}

/// The tensors declared at join.
///
/// # Safety
///
/// `names` is null or points to `count` C strings; `lens` is null or points to `count`
/// lengths.
unsafe fn tensor_specs(
    names: *const *const c_char,
    lens: *const u64,
    count: usize,
) -> Res<Vec<TensorSpec>> {
    if count == 0 {
        return Err(Failure::new(
            FALCON_ERR_CONFIG,
            "a worker must declare at least one tensor (count is 0)",
        ));
    }
    if names.is_null() {
        return Err(Failure::null("the tensor names"));
    }
    if lens.is_null() {
        return Err(Failure::null("the tensor lengths"));
    }
    // SAFETY: non-null and `count` elements long by the caller's contract.
    let (names, lens) = unsafe {
        (
            std::slice::from_raw_parts(names, count),
            std::slice::from_raw_parts(lens, count),
        )
    };
    let mut specs: Vec<TensorSpec> = Vec::with_capacity(count);
    for (i, (&name, &len)) in names.iter().zip(lens).enumerate() {
        // SAFETY: each name is a NUL-terminated string by the caller's contract.
        let name = unsafe { text(name, &format!("tensor name {i}")) }?;
        if name.is_empty() || len == 0 {
            return Err(Failure::new(
                FALCON_ERR_ARGUMENT,
                format!(
                    "tensor {i} (\"{name}\", {len} floats): a tensor needs a name and at least one float"
                ),
            ));
        }
        if specs.iter().any(|s| s.name == name) {
            return Err(Failure::new(
                FALCON_ERR_CONFIG,
                format!("tensor \"{name}\" is declared twice"),
            ));
        }
        specs.push(TensorSpec::new(name.to_string(), len));
    }
    Ok(specs)
}

/// The environment variable `name` (the launch contract counts an empty one as unset).
fn env(name: &str) -> Option<String> {
    std::env::var_os(name).map(|v| v.to_string_lossy().into_owned())
}

/// Joins as a worker with `launch`, hands the worker out.
///
/// # Safety
///
/// `out` is null or valid for a write of one pointer.
unsafe fn join_as_worker(
    launch: Launch,
    tensors: Vec<TensorSpec>,
    out: *mut *mut FalconWorker,
) -> Res<c_int> {
    if launch.role != Role::Worker {
        return Err(Failure::new(
            FALCON_ERR_CONFIG,
            format!(
                "this process is the job's {} by its environment, not a worker",
                launch.role.name()
            ),
        ));
    }
    // Under a launcher, the roles this rank hosts run beside its worker, on threads.
    let hosted = falcon_engine::local::HostedRoles::start(&launch)?;
    let w = falcon_engine::Worker::join(&launch.config, tensors, launch.rank)?;
    let boxed = Box::new(FalconWorker {
        shared: Arc::new(Shared {
            w,
            regions: Mutex::new(HashMap::new()),
            hosted: Mutex::new((!hosted.is_empty()).then_some(hosted)),
        }),
    });
    // SAFETY: forwarded contract. (Checked before joining, so a null `out` joins nothing.)
    unsafe { put(out, Box::into_raw(boxed), "the worker out-pointer") }
}

/// Joins the job that the environment describes, as a worker training the `count` tensors
/// named `names[i]`, of `lens[i]` floats each (every worker of a job declares the same).
/// On success `*out` is the worker, to be released with `falcon_worker_free`; on failure
/// it is NULL.
///
/// The environment is falcon's launch contract: `FALCON_ROLE=worker` (or `DMLC_ROLE`, or a
/// launcher's global rank: torchrun's `RANK`/`WORLD_SIZE`, Slurm's
/// `SLURM_PROCID`/`SLURM_NTASKS`, Open MPI's), the scheduler (`FALCON_SCHEDULER=HOST:PORT`,
/// or `FALCON_SCHEDULER_URI` and `FALCON_SCHEDULER_PORT`, `DMLC_PS_ROOT_URI`/`_PORT`,
/// `MASTER_ADDR`/`MASTER_PORT`), `FALCON_NUM_WORKER`, `FALCON_NUM_SERVER`, `FALCON_RANK`,
/// `FALCON_JOB`, `FALCON_TOKEN`, the timeouts (`FALCON_RENDEZVOUS_TIMEOUT_MS`, …): see the
/// README's launch contract. An environment that makes this process the scheduler or a
/// server is `FALCON_ERR_CONFIG`.
///
/// Blocks until the job's rendezvous completes: every worker and server has joined, or
/// the rendezvous timeout passed (`FALCON_ERR_TIMEOUT`, or `FALCON_ERR_PEER_GONE` for a
/// scheduler that never answered).
///
/// Thread safety: safe from any thread; each call joins a worker of its own.
///
/// # Safety
///
/// `names` points to `count` NUL-terminated strings and `lens` to `count` lengths; `out` is
/// valid for a write of one pointer. Null pointers are reported (`FALCON_ERR_NULL`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn falcon_join(
    names: *const *const c_char,
    lens: *const u64,
    count: usize,
    out: *mut *mut FalconWorker,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract (valid for a write of one pointer, or null).
        unsafe { clear(out, "the worker out-pointer") }?;
        // SAFETY: forwarded contract.
        let tensors = unsafe { tensor_specs(names, lens, count) }?;
        let launch = Launch::from_env()?;
        // SAFETY: forwarded contract.
        unsafe { join_as_worker(launch, tensors, out) }
    })
}

/// Joins a job as a worker with explicit arguments, as `falcon_join` does; each argument
/// not given falls back to the environment's variable (in brackets):
///
/// - `scheduler`: the scheduler's address, `HOST:PORT` (`FALCON_SCHEDULER`, …); NULL or ""
///   not given;
/// - `workers`, `servers`: the job's workers and servers (`FALCON_NUM_WORKER`,
///   `FALCON_NUM_SERVER`); 0 not given;
/// - `rank`: this worker's rank, or -1 for the environment's (`FALCON_RANK`), and without
///   one the scheduler assigns one;
/// - `job`, `token`: the job's name and its token (`FALCON_JOB`, `FALCON_TOKEN`); NULL or
///   "" not given.
///
/// This process is a worker whatever `FALCON_ROLE` says, and a launcher's global rank
/// (torchrun's, Slurm's) is not consulted: the `FALCON_*`/`DMLC_*` variables fill in what
/// is not given. A negative `workers` or `servers`, or a rank below -1, is
/// `FALCON_ERR_ARGUMENT`.
///
/// Thread safety: safe from any thread; each call joins a worker of its own.
///
/// # Safety
///
/// As `falcon_join`; `scheduler`, `job` and `token` are NULL or NUL-terminated strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn falcon_join_with(
    scheduler: *const c_char,
    workers: i32,
    servers: i32,
    rank: i64,
    job: *const c_char,
    token: *const c_char,
    names: *const *const c_char,
    lens: *const u64,
    count: usize,
    out: *mut *mut FalconWorker,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract (valid for a write of one pointer, or null).
        unsafe { clear(out, "the worker out-pointer") }?;
        // SAFETY: forwarded contract.
        let tensors = unsafe { tensor_specs(names, lens, count) }?;
        let mut given: HashMap<&str, String> = HashMap::new();
        given.insert("FALCON_ROLE", "worker".into());
        // SAFETY: forwarded contract (NULL or NUL-terminated).
        if let Some(s) = unsafe { optional_text(scheduler, "the scheduler address") }? {
            given.insert("FALCON_SCHEDULER", s.to_string());
        }
        // SAFETY: as above.
        if let Some(s) = unsafe { optional_text(job, "the job name") }? {
            given.insert("FALCON_JOB", s.to_string());
        }
        // SAFETY: as above.
        if let Some(s) = unsafe { optional_text(token, "the job token") }? {
            given.insert("FALCON_TOKEN", s.to_string());
        }
        for (var, n, what) in [
            ("FALCON_NUM_WORKER", workers, "workers"),
            ("FALCON_NUM_SERVER", servers, "servers"),
        ] {
            match n {
                0 => {}
                n if n < 0 => {
                    return Err(Failure::new(
                        FALCON_ERR_ARGUMENT,
                        format!("{what} = {n}: a count of {what} (0: the environment's)"),
                    ));
                }
                n => {
                    given.insert(var, n.to_string());
                }
            }
        }
        match rank {
            -1 => {}
            r if r < -1 || r > i64::from(u32::MAX) => {
                return Err(Failure::new(
                    FALCON_ERR_ARGUMENT,
                    format!("rank = {r}: a worker rank, or -1 for the environment's"),
                ));
            }
            r => {
                given.insert("FALCON_RANK", r.to_string());
            }
        }
        // The launcher's variables would decide the role and the rank over the ones given.
        const LAUNCHER: [&str; 6] = [
            "RANK",
            "WORLD_SIZE",
            "SLURM_PROCID",
            "SLURM_NTASKS",
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
        ];
        let launch = Launch::from_vars(|name| {
            if LAUNCHER.contains(&name) || name == "DMLC_ROLE" {
                return None;
            }
            given.get(name).cloned().or_else(|| env(name))
        })?;
        // SAFETY: forwarded contract.
        unsafe { join_as_worker(launch, tensors, out) }
    })
}

/// Releases a worker (NULL does nothing). Call `falcon_finish` first: a worker freed
/// unfinished closes its links, which the job sees as a worker gone. Handles of this
/// worker stay usable until freed themselves.
///
/// Thread safety: no other call on this worker may run or follow (the pointer is invalid
/// after this).
///
/// # Safety
///
/// `w` is NULL or a worker from `falcon_join*` not yet freed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn falcon_worker_free(w: *mut FalconWorker) -> c_int {
    guard(|| {
        if !w.is_null() {
            // SAFETY: a worker from Box::into_raw in join_as_worker, freed once by contract.
            drop(unsafe { Box::from_raw(w) });
        }
        Ok(FALCON_OK)
    })
}

/// Sets `tensor`'s initial values from `values` (`len` floats, the tensor's length). The
/// first initialization of each shard wins: call it from one worker (rank 0) before
/// training. Blocks until the servers acknowledge.
///
/// Thread safety: safe from any thread, concurrently with other calls on the worker.
///
/// # Safety
///
/// `w` is a live worker; `tensor` a NUL-terminated string; `values` valid for reads of
/// `len` floats.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn falcon_init_tensor(
    w: *mut FalconWorker,
    tensor: *const c_char,
    values: *const f32,
    len: usize,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let (s, name) = unsafe { (worker(w)?, text(tensor, "the tensor name")?) };
        let t = s.tensor(name, len)?;
        // SAFETY: forwarded contract.
        let bytes = unsafe { float_bytes(values, len, "the initial values") }?;
        let region = s.take(t)?;
        region.write_at(0, bytes)?;
        s.w.init(name, &region)?;
        s.give(t, region);
        Ok(FALCON_OK)
    })
}

/// Starts a push of `grad` into a region of its own; the region and the engine's handle.
///
/// # Safety
///
/// As `falcon_push`.
unsafe fn start_push(
    w: *const FalconWorker,
    tensor: *const c_char,
    grad: *const f32,
    len: usize,
    clock: u64,
) -> Res<(Arc<Shared>, usize, Region, falcon_engine::Handle)> {
    // SAFETY: forwarded contract.
    let (s, name) = unsafe { (worker(w)?, text(tensor, "the tensor name")?) };
    let t = s.tensor(name, len)?;
    // SAFETY: forwarded contract.
    let bytes = unsafe { float_bytes(grad, len, "the gradient") }?;
    let region = s.take(t)?;
    region.write_at(0, bytes)?;
    let h = s.w.push_async(name, &region, clock)?;
    Ok((s.clone(), t, region, h))
}

/// Pushes `grad` (`len` floats, the tensor's length) as this worker's gradient of `tensor`
/// for iteration `clock`, which must be the tensor's next (`falcon_clock_of`); blocks
/// until the servers acknowledge. The floats are copied before the push starts.
///
/// Thread safety: safe from any thread, concurrently with other calls on the worker
/// (pushes of one tensor must still come in clock order).
///
/// # Safety
///
/// `w` is a live worker; `tensor` a NUL-terminated string; `grad` valid for reads of `len`
/// floats.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn falcon_push(
    w: *mut FalconWorker,
    tensor: *const c_char,
    grad: *const f32,
    len: usize,
    clock: u64,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let (s, t, region, h) = unsafe { start_push(w, tensor, grad, len, clock) }?;
        h.wait()?;
        s.give(t, region);
        Ok(FALCON_OK)
    })
}

/// Pulls `tensor` for iteration `clock` into `out` (`len` floats, the tensor's length):
/// returns once `out` holds values the job's policy lets this clock see (under BSP, every
/// worker's gradients of the clocks before it applied). May block as long as the policy
/// holds the pull; a peer's death ends it with an error.
///
/// Thread safety: safe from any thread, concurrently with other calls on the worker.
///
/// # Safety
///
/// `w` is a live worker; `tensor` a NUL-terminated string; `out` valid for writes of `len`
/// floats.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn falcon_pull(
    w: *mut FalconWorker,
    tensor: *const c_char,
    out: *mut f32,
    len: usize,
    clock: u64,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let mut op = unsafe { start_pull(w, tensor, out, len, clock) }?;
        let outcome = match op.engine.take() {
            Some(h) => h.wait().map_err(Failure::from),
            None => Ok(()),
        };
        op.complete(outcome)?;
        Ok(FALCON_OK)
    })
}

/// Pushes `grad` (`len` floats, the tensor's length) as this worker's gradient of `tensor`
/// for iteration `clock` (the tensor's next), then pulls the values for `clock + 1` into
/// `out` (`len` floats), shard by shard: each shard's pull goes right behind its push, so
/// both directions of a link work at once, and each answer comes after this push was applied
/// (unless the policy drops it or counts it for a later step: Sync-opt's backups). Blocks
/// until `out` is written. The gradient is copied first: `grad` and `out` may be the same
/// array.
///
/// Thread safety: as `falcon_push`.
///
/// # Safety
///
/// `w` is a live worker; `tensor` a NUL-terminated string; `grad` valid for reads and `out`
/// for writes of `len` floats.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn falcon_push_pull(
    w: *mut FalconWorker,
    tensor: *const c_char,
    grad: *const f32,
    out: *mut f32,
    len: usize,
    clock: u64,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let (s, name) = unsafe { (worker(w)?, text(tensor, "the tensor name")?) };
        let t = s.tensor(name, len)?;
        // SAFETY: forwarded contract.
        let bytes = unsafe { float_bytes(grad, len, "the gradient") }?;
        if out.is_null() {
            return Err(Failure::null("the pull's destination"));
        }
        let sent = s.take(t)?;
        sent.write_at(0, bytes)?;
        let back = s.take(t)?;
        // On an error both regions are dropped, not given back: the engine may still hold
        // them.
        s.w.push_pull(name, &sent, &back, clock)?;
        // SAFETY: `out` is non-null (checked above) and valid for writes of `len` floats, the
        // region's length, by the contract; `bytes`, which may cover the same memory, is not
        // used again; bytes need no alignment.
        let dest = unsafe { std::slice::from_raw_parts_mut(out.cast::<u8>(), len * 4) };
        back.read_at(0, dest)?;
        s.give(t, sent);
        s.give(t, back);
        Ok(FALCON_OK)
    })
}

/// Pushes the gradients of `count` rows of `tensor`, seen as a table of rows of `dim` floats,
/// as this worker's gradient for iteration `clock`: `rows` holds the row ids (duplicates are
/// summed), `grads` their `count` × `dim` gradients, row after row. Only these rows travel;
/// every other row's gradient is zero. The job's optimizer must be sgd or adagrad
/// (`FALCON_ERR_CONFIG` otherwise); a row outside the table is `FALCON_ERR_CONFIG`. Blocks
/// until the servers acknowledge; the values are copied before the push starts.
///
/// Thread safety: as `falcon_push`.
///
/// # Safety
///
/// `w` is a live worker; `tensor` a NUL-terminated string; `rows` valid for reads of `count`
/// ids and `grads` of `count` × `dim` floats (either may be null when `count` is 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn falcon_push_rows(
    w: *mut FalconWorker,
    tensor: *const c_char,
    dim: u64,
    rows: *const u64,
    count: usize,
    grads: *const f32,
    clock: u64,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let (s, name) = unsafe { (worker(w)?, text(tensor, "the tensor name")?) };
        let n = rows_len(count, dim)?;
        // SAFETY: forwarded contract (valid for `count` ids and `n` floats, or count 0).
        let (ids, vals) = unsafe {
            (
                slice_or_empty(rows, count, "the rows")?,
                slice_or_empty(grads, n, "the gradients")?,
            )
        };
        s.w.push_rows(name, dim, ids, vals, clock)?;
        Ok(FALCON_OK)
    })
}

/// Pulls `count` rows of `tensor` (a table of rows of `dim` floats) for iteration `clock`
/// into `out` (`count` × `dim` floats, row after row), with the values the job's policy lets
/// this clock see.
///
/// Thread safety: as `falcon_pull`.
///
/// # Safety
///
/// `w` is a live worker; `tensor` a NUL-terminated string; `rows` valid for reads of `count`
/// ids and `out` for writes of `count` × `dim` floats (either may be null when `count` is 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn falcon_pull_rows(
    w: *mut FalconWorker,
    tensor: *const c_char,
    dim: u64,
    rows: *const u64,
    count: usize,
    out: *mut f32,
    clock: u64,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let (s, name) = unsafe { (worker(w)?, text(tensor, "the tensor name")?) };
        let n = rows_len(count, dim)?;
        // SAFETY: forwarded contract.
        let ids = unsafe { slice_or_empty(rows, count, "the rows")? };
        let mut got = vec![0f32; n];
        s.w.pull_rows(name, dim, ids, &mut got, clock)?;
        if n > 0 {
            if out.is_null() {
                return Err(Failure::null("the rows' destination"));
            }
            // SAFETY: non-null and valid for `n` floats by the caller's contract.
            unsafe { std::ptr::copy_nonoverlapping(got.as_ptr(), out, n) };
        }
        Ok(FALCON_OK)
    })
}

/// The floats of `count` rows of `dim`.
fn rows_len(count: usize, dim: u64) -> Res<usize> {
    usize::try_from(dim)
        .ok()
        .and_then(|d| count.checked_mul(d))
        .ok_or_else(|| {
            Failure::new(
                FALCON_ERR_WRONG_LENGTH,
                format!("{count} rows of {dim} floats do not fit in memory"),
            )
        })
}

/// `len` values at `p`, or an empty slice when `len` is 0 (then `p` may be null).
///
/// # Safety
///
/// `p` is valid for reads of `len` values when `len > 0`.
unsafe fn slice_or_empty<'a, T>(p: *const T, len: usize, what: &str) -> Res<&'a [T]> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(Failure::null(what));
    }
    // SAFETY: non-null and valid for `len` values by the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}

// --- handles ---------------------------------------------------------------------------------

/// A push or pull in flight (opaque): made by `falcon_push_async` or `falcon_pull_async`,
/// released by `falcon_handle_free`.
pub struct FalconHandle {
    op: Mutex<Op>,
}

/// The caller's pull destination: a pointer the caller keeps valid until the wait returns.
struct Dest(*mut f32);

// SAFETY: the pointer is only written through while the handle's lock is held, during a
// wait the caller makes; the caller's contract keeps the memory valid until then, from
// whichever thread waits.
unsafe impl Send for Dest {}

enum Kind {
    Push,
    Pull(Dest),
}

/// An operation: its engine handle until it completes, then its outcome.
struct Op {
    shared: Arc<Shared>,
    tensor: usize,
    kind: Kind,
    region: Option<Region>,
    engine: Option<falcon_engine::Handle>,
    outcome: Option<Result<(), (c_int, String)>>,
}

impl Op {
    /// Completes the operation with the engine's `outcome`: a pull's values are copied to the
    /// caller's array; the region is kept for reuse on success. Idempotent.
    fn complete(&mut self, outcome: Res<()>) -> Res<()> {
        if self.outcome.is_none() {
            let mut outcome = outcome;
            if let (Ok(()), Kind::Pull(dest), Some(region)) =
                (&outcome, &self.kind, self.region.as_ref())
            {
                let bytes = region.len() as usize;
                // SAFETY: the destination was checked non-null at the start, and the caller
                // keeps it valid for `len` floats (the region's length) until this wait
                // returns; bytes need no alignment.
                let out = unsafe { std::slice::from_raw_parts_mut(dest.0.cast::<u8>(), bytes) };
                outcome = region.read_at(0, out).map_err(Failure::from);
            }
            if outcome.is_ok()
                && let Some(r) = self.region.take()
            {
                self.shared.give(self.tensor, r);
            }
            // A failed operation's region is dropped: the engine may still hold it.
            self.region = None;
            self.outcome = Some(outcome.map_err(|f| (f.code, f.msg)));
        }
        match self.outcome.as_ref() {
            Some(Err((code, msg))) => Err(Failure::new(*code, msg.clone())),
            _ => Ok(()),
        }
    }
}

/// Starts a pull into a region of its own.
///
/// # Safety
///
/// As `falcon_pull`.
unsafe fn start_pull(
    w: *const FalconWorker,
    tensor: *const c_char,
    out: *mut f32,
    len: usize,
    clock: u64,
) -> Res<Op> {
    // SAFETY: forwarded contract.
    let (s, name) = unsafe { (worker(w)?, text(tensor, "the tensor name")?) };
    let t = s.tensor(name, len)?;
    if out.is_null() {
        return Err(Failure::null("the pull's destination"));
    }
    let region = s.take(t)?;
    let h = s.w.pull_async(name, &region, clock)?;
    Ok(Op {
        shared: s.clone(),
        tensor: t,
        kind: Kind::Pull(Dest(out)),
        region: Some(region),
        engine: Some(h),
        outcome: None,
    })
}

/// Hands a new handle out.
///
/// # Safety
///
/// `out` is null or valid for a write of one pointer.
unsafe fn hand_out(op: Op, out: *mut *mut FalconHandle) -> Res<c_int> {
    let h = Box::new(FalconHandle { op: Mutex::new(op) });
    // SAFETY: forwarded contract (checked non-null by the callers before starting).
    unsafe { put(out, Box::into_raw(h), "the handle out-pointer") }
}

/// Starts a push as `falcon_push` does, without waiting: `*handle` is the push in flight,
/// to be waited for (`falcon_handle_wait`) and released (`falcon_handle_free`); NULL on
/// failure. The floats
/// are copied before this returns: `grad` may be reused at once.
///
/// Thread safety: as `falcon_push`.
///
/// # Safety
///
/// As `falcon_push`; `handle` valid for a write of one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn falcon_push_async(
    w: *mut FalconWorker,
    tensor: *const c_char,
    grad: *const f32,
    len: usize,
    clock: u64,
    handle: *mut *mut FalconHandle,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract (valid for a write of one pointer, or null).
        unsafe { clear(handle, "the handle out-pointer") }?;
        // SAFETY: forwarded contract.
        let (shared, t, region, h) = unsafe { start_push(w, tensor, grad, len, clock) }?;
        let op = Op {
            shared,
            tensor: t,
            kind: Kind::Push,
            region: Some(region),
            engine: Some(h),
            outcome: None,
        };
        // SAFETY: forwarded contract.
        unsafe { hand_out(op, handle) }
    })
}

/// Starts a pull as `falcon_pull` does, without waiting: `*handle` is the pull in flight
/// (NULL on failure).
/// The values are copied into `out` when a wait on the handle completes it
/// (`falcon_handle_wait`, or `falcon_handle_wait_for` returning `FALCON_OK`): **`out` must
/// stay valid, and should not be read, until then.** A handle freed before completing
/// never writes `out`.
///
/// Thread safety: as `falcon_pull`.
///
/// # Safety
///
/// As `falcon_pull`, with `out` valid for writes of `len` floats until the wait returns;
/// `handle` valid for a write of one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn falcon_pull_async(
    w: *mut FalconWorker,
    tensor: *const c_char,
    out: *mut f32,
    len: usize,
    clock: u64,
    handle: *mut *mut FalconHandle,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract (valid for a write of one pointer, or null).
        unsafe { clear(handle, "the handle out-pointer") }?;
        // SAFETY: forwarded contract.
        let op = unsafe { start_pull(w, tensor, out, len, clock) }?;
        // SAFETY: forwarded contract.
        unsafe { hand_out(op, handle) }
    })
}

/// The operation behind a handle pointer, locked.
///
/// # Safety
///
/// `h` is null or a handle not yet freed.
unsafe fn op<'a>(h: *const FalconHandle) -> Res<MutexGuard<'a, Op>> {
    if h.is_null() {
        return Err(Failure::null("the handle"));
    }
    // SAFETY: a live handle by the caller's contract; only shared access is made.
    Ok(lock(unsafe { &(*h).op }))
}

/// Waits until the operation completes: `FALCON_OK`, or its error. For a pull, the values
/// are in the destination array when this returns `FALCON_OK`. A push waits at most the
/// operation timeout (`FALCON_OP_TIMEOUT_MS`); a pull as long as the job's policy holds it
/// (a dead peer ends it with an error). Waiting again returns the same outcome at once.
/// The handle is still to be freed.
///
/// Thread safety: a handle may be waited for from any thread; calls on one handle are
/// serialized (a second waits for the first).
///
/// # Safety
///
/// `h` is a handle not yet freed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn falcon_handle_wait(h: *mut FalconHandle) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let mut op = unsafe { op(h) }?;
        let outcome = match op.engine.take() {
            Some(e) => e.wait().map_err(Failure::from),
            None => Ok(()),
        };
        op.complete(outcome)?;
        Ok(FALCON_OK)
    })
}

/// Waits at most `timeout_ms` milliseconds: `FALCON_OK` once the operation completed (a
/// pull's values are then in its destination), `FALCON_PENDING` (1, not an error) if it
/// is still in flight, or the operation's error (a push unacknowledged past the operation
/// timeout is `FALCON_ERR_TIMEOUT`). 0 polls; `UINT64_MAX` waits as `falcon_handle_wait`.
///
/// Thread safety: as `falcon_handle_wait`.
///
/// # Safety
///
/// `h` is a handle not yet freed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn falcon_handle_wait_for(h: *mut FalconHandle, timeout_ms: u64) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let mut op = unsafe { op(h) }?;
        let outcome = match op.engine.as_ref() {
            None => Ok(()),
            // Capped (at about 34 years) so that a deadline past any clock's end cannot be.
            Some(e) => match e.wait_for(Duration::from_millis(timeout_ms.min(1 << 40))) {
                None => return Ok(FALCON_PENDING),
                Some(r) => r.map_err(Failure::from),
            },
        };
        op.engine = None;
        op.complete(outcome)?;
        Ok(FALCON_OK)
    })
}

/// 1 if the operation has completed (successfully or not: a wait will not block), 0 if it
/// is still in flight, or a negative code (a null handle). A pull's values reach its
/// destination only in a wait: call one even after this says 1.
///
/// Thread safety: as `falcon_handle_wait` (it waits for a wait on the same handle in
/// another thread to return).
///
/// # Safety
///
/// `h` is a handle not yet freed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn falcon_handle_ready(h: *mut FalconHandle) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let op = unsafe { op(h) }?;
        Ok(match op.engine.as_ref() {
            None => 1,
            Some(e) => c_int::from(e.ready()),
        })
    })
}

/// Releases a handle (NULL does nothing). An operation still in flight goes on without
/// it, and a pull's destination is then never written.
///
/// Thread safety: no other call on this handle may run or follow.
///
/// # Safety
///
/// `h` is NULL or a handle not yet freed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn falcon_handle_free(h: *mut FalconHandle) -> c_int {
    guard(|| {
        if !h.is_null() {
            // SAFETY: a handle from Box::into_raw in hand_out, freed once by contract.
            drop(unsafe { Box::from_raw(h) });
        }
        Ok(FALCON_OK)
    })
}

// --- the rest of the worker ------------------------------------------------------------------

/// Waits until every live worker of the job has reached this barrier (the n-th call of each
/// worker meets the others' n-th).
///
/// Thread safety: safe from any thread; one thread per worker should take the job's
/// barriers (each call is a barrier of its own).
///
/// # Safety
///
/// `w` is a live worker.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn falcon_barrier(w: *mut FalconWorker) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let s = unsafe { worker(w) }?;
        s.w.barrier()?;
        Ok(FALCON_OK)
    })
}

/// Stores in `*out` the worker's clock: the iteration it is on, i.e. the fewest gradients
/// pushed to any tensor it has pushed at all.
///
/// Thread safety: safe from any thread.
///
/// # Safety
///
/// `w` is a live worker; `out` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn falcon_clock(w: *mut FalconWorker, out: *mut u64) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let s = unsafe { worker(w) }?;
        // SAFETY: forwarded contract.
        unsafe { put(out, s.w.clock(), "the clock out-pointer") }
    })
}

/// Stores in `*out` the gradients pushed to `tensor` so far: its next push's clock.
///
/// Thread safety: safe from any thread.
///
/// # Safety
///
/// `w` is a live worker; `tensor` a NUL-terminated string; `out` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn falcon_clock_of(
    w: *mut FalconWorker,
    tensor: *const c_char,
    out: *mut u64,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let (s, name) = unsafe { (worker(w)?, text(tensor, "the tensor name")?) };
        let c = s.w.clock_of(name)?;
        // SAFETY: forwarded contract.
        unsafe { put(out, c, "the clock out-pointer") }
    })
}

/// Stores in `*out` the length of `tensor` in floats, as declared at join.
///
/// Thread safety: safe from any thread.
///
/// # Safety
///
/// `w` is a live worker; `tensor` a NUL-terminated string; `out` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn falcon_tensor_len(
    w: *mut FalconWorker,
    tensor: *const c_char,
    out: *mut u64,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let (s, name) = unsafe { (worker(w)?, text(tensor, "the tensor name")?) };
        let keymap = s.w.keymap();
        let len = keymap.tensors[keymap.tensor(name)?].len;
        // SAFETY: forwarded contract.
        unsafe { put(out, len, "the length out-pointer") }
    })
}

/// Stores in `*out` this worker's rank (0 to workers − 1).
///
/// Thread safety: safe from any thread.
///
/// # Safety
///
/// `w` is a live worker; `out` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn falcon_rank(w: *mut FalconWorker, out: *mut u32) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let s = unsafe { worker(w) }?;
        // SAFETY: forwarded contract.
        unsafe { put(out, s.w.rank(), "the rank out-pointer") }
    })
}

/// Stores in `*out` the number of workers in the job.
///
/// Thread safety: safe from any thread.
///
/// # Safety
///
/// `w` is a live worker; `out` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn falcon_workers(w: *mut FalconWorker, out: *mut u32) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let s = unsafe { worker(w) }?;
        // SAFETY: forwarded contract.
        unsafe { put(out, s.w.workers(), "the workers out-pointer") }
    })
}

/// Stores in `*out` the learning rate the servers apply, as the scheduler announced it: under
/// BSP a clock's update is `w -= lr · mean of the workers' gradients`; under an asynchronous
/// policy each gradient is applied on its own at this rate, which is the job's `FALCON_LR`
/// divided by the workers.
///
/// Thread safety: safe from any thread.
///
/// # Safety
///
/// `w` is a live worker; `out` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn falcon_learning_rate(w: *mut FalconWorker, out: *mut f32) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let s = unsafe { worker(w) }?;
        // SAFETY: forwarded contract.
        unsafe { put(out, s.w.optimizer().lr(), "the learning-rate out-pointer") }
    })
}

/// Tells the scheduler this worker is done (the job ends when every worker is) and closes
/// its links in order. Operations still waiting fail; later pushes and pulls are
/// `FALCON_ERR_CONFIG`. A second call does nothing. The worker is still to be freed. On a
/// launched rank that hosts the scheduler or servers (`falcon_join` under torchrun, srun or
/// mpirun: rank 0, each node's first rank) it then waits for the job's end, since they
/// serve every worker until then.
///
/// Thread safety: safe from any thread.
///
/// # Safety
///
/// `w` is a live worker.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn falcon_finish(w: *mut FalconWorker) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let s = unsafe { worker(w) }?;
        s.w.finish()?;
        // A rank hosting the scheduler or servers serves the job to its end.
        let hosted = s.hosted.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(h) = hosted {
            h.finish()?;
        }
        Ok(FALCON_OK)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn null_pointers_are_typed_errors_with_a_message() {
        // SAFETY: null pointers are what is tested; nothing is dereferenced.
        let code = unsafe { falcon_barrier(std::ptr::null_mut()) };
        assert_eq!(code, FALCON_ERR_NULL);
        assert_eq!(falcon_last_error_code(), FALCON_ERR_NULL);
        // SAFETY: falcon_last_error returns a NUL-terminated string owned by the record.
        let msg = unsafe { CStr::from_ptr(falcon_last_error()) };
        assert_eq!(msg.to_str().unwrap(), "the worker must not be NULL");
        // SAFETY: as above.
        let ready = unsafe { falcon_handle_ready(std::ptr::null_mut()) };
        assert_eq!(ready, FALCON_ERR_NULL);
        // SAFETY: NULL frees nothing.
        assert_eq!(
            unsafe { falcon_worker_free(std::ptr::null_mut()) },
            FALCON_OK
        );
        // SAFETY: as above.
        assert_eq!(
            unsafe { falcon_handle_free(std::ptr::null_mut()) },
            FALCON_OK
        );
    }

    #[test]
    fn tensor_declarations_are_checked_before_joining() {
        let mut w: *mut FalconWorker = std::ptr::null_mut();
        let names = [c"w".as_ptr(), c"w".as_ptr()];
        let lens = [4u64, 4];
        // SAFETY: two names and two lengths; `w` is a valid out-pointer.
        let code = unsafe { falcon_join(names.as_ptr(), lens.as_ptr(), 2, &mut w) };
        assert_eq!(code, FALCON_ERR_CONFIG);
        // SAFETY: falcon_last_error returns a NUL-terminated string owned by the record.
        let msg = unsafe { CStr::from_ptr(falcon_last_error()) };
        assert_eq!(msg.to_str().unwrap(), "tensor \"w\" is declared twice");
        // SAFETY: as above, one of each.
        let code = unsafe { falcon_join(names.as_ptr(), [0u64].as_ptr(), 1, &mut w) };
        assert_eq!(code, FALCON_ERR_ARGUMENT);
        // SAFETY: zero tensors: nothing is read.
        let code = unsafe { falcon_join(names.as_ptr(), lens.as_ptr(), 0, &mut w) };
        assert_eq!(code, FALCON_ERR_CONFIG);
        assert!(w.is_null(), "no worker was made");
    }

    #[test]
    fn a_panic_is_caught_and_reported() {
        let code = guard(|| panic!("boom"));
        assert_eq!(code, FALCON_ERR_PANIC);
        // SAFETY: falcon_last_error returns a NUL-terminated string owned by the record.
        let msg = unsafe { CStr::from_ptr(falcon_last_error()) };
        assert!(msg.to_str().unwrap().ends_with(": boom"), "{msg:?}");
    }

    #[test]
    fn every_code_has_a_name() {
        for code in -12..=1 {
            // SAFETY: falcon_code_name returns a static NUL-terminated string.
            let name = unsafe { CStr::from_ptr(falcon_code_name(code)) };
            assert_ne!(name.to_str().unwrap(), "FALCON_UNKNOWN_CODE", "{code}");
        }
    }
}
