//! Control messages between scheduler, servers and workers (bulk data never goes here: it
//! moves by one-sided writes and reads). Encoded with postcard behind a 3-byte prefix (magic,
//! version); decoding validates both and never panics on bad input.

use serde::{Deserialize, Serialize};

use falcon_transport::RemoteKey;

use crate::error::{Error, Result};
use crate::keys::{KeyMap, TensorSpec};
use crate::sync::PolicySpec;
use crate::update::{Aggregate, Optimizer, ScaleSpec, UpdateMode};

const MAGIC: [u8; 2] = *b"FE";

/// A worker's or a server's counters since it started (totals, so a lost message loses
/// nothing), as it sends them to the scheduler.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeMetrics {
    /// Worker: iterations completed (its clock: every tensor pushed this many times).
    pub iterations: u64,
    /// Worker: shard pushes; server: gradients received.
    pub pushes: u64,
    /// Worker: shard pulls (one-sided reads and server answers); server: pulls answered.
    pub pulls: u64,
    /// Worker: time blocked on pulls the policy parked and at barriers; server: unused.
    pub blocked_nanos: u64,
    /// Staleness of acknowledged pushes (worker) or applied gradients (server): sum, count,
    /// largest.
    pub staleness_sum: u64,
    /// Pushes counted in `staleness_sum`.
    pub staleness_count: u64,
    /// The largest staleness.
    pub staleness_max: u64,
    /// Server: gradient bytes received.
    pub bytes_in: u64,
    /// Server: parameter bytes written to answer pulls (worker: bytes read one-sided).
    pub bytes_out: u64,
    /// Server: updates applied to parameters.
    pub updates: u64,
    /// Server: pulls parked now, waiting for the policy.
    pub parked_pulls: u64,
    /// Server: pulls that waited for the policy, in all.
    pub delayed_pulls: u64,
    /// Server: gradients the policy dropped.
    pub dropped_gradients: u64,
    /// Server: late gradients folded into a later step (`syncopt(…,fold)`).
    pub folded_gradients: u64,
}

/// Bumped whenever `Msg` or the slot trailer changes shape (2: ElasticBSP's `Superstep` and
/// `Plan`; 6: server recovery and worker rejoin; 7: typed acknowledgements and refused pulls;
/// 10: metrics; 12: the trailer names a gradient left in the worker's memory, so nodes of
/// older builds, whose slots are shorter, are refused by name, not by a failed write; 13:
/// folded gradients in the metrics).
const VERSION: u8 = 13;

/// A process's role in a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Role {
    /// Rendezvous, barriers, heartbeats, membership.
    Scheduler,
    /// Owns shards.
    Server,
    /// Computes, pushes and pulls.
    Worker,
}

impl Role {
    /// The role's name.
    pub fn name(self) -> &'static str {
        match self {
            Role::Scheduler => "scheduler",
            Role::Server => "server",
            Role::Worker => "worker",
        }
    }
}

impl std::str::FromStr for Role {
    type Err = Error;
    fn from_str(s: &str) -> Result<Role> {
        match s.to_ascii_lowercase().as_str() {
            "scheduler" => Ok(Role::Scheduler),
            "server" => Ok(Role::Server),
            "worker" => Ok(Role::Worker),
            other => Err(Error::Config(format!(
                "unknown role {other:?} (scheduler, server, worker)"
            ))),
        }
    }
}

/// What every node learns at rendezvous.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Book {
    /// This node's rank within its role.
    pub rank: u32,
    /// Server addresses, by rank.
    pub servers: Vec<String>,
    /// Number of workers.
    pub workers: u32,
    /// Tensors, shards and their servers.
    pub keymap: KeyMap,
    /// Synchronization policy (one instance per shard).
    pub policy: PolicySpec,
    /// When updates are applied.
    pub mode: UpdateMode,
    /// How aggregated gradients combine.
    pub aggregate: Aggregate,
    /// The server-side optimizer.
    pub optimizer: Optimizer,
    /// Staleness scaling of asynchronously applied gradients.
    pub scale: ScaleSpec,
    /// The precision of gradients and pulled values on the wire.
    pub wire: crate::precision::Wire,
    /// Servers checkpoint and a dead server is waited for (it restarts from its checkpoint)
    /// instead of ending the job.
    pub recovery: bool,
    /// This node joins a running job: a server restarting from its checkpoint, or a worker
    /// rejoining at the current clock.
    pub rejoin: bool,
    /// This run of the job (random, from the scheduler): a checkpoint of an earlier run of
    /// the same job is never restored.
    pub instance: u64,
    /// Barriers fallen so far: a rejoining worker's next barrier is the one after.
    pub barriers: u64,
    /// The job's workers and servers on this node's host at the start, this one included:
    /// more of them than cores, and a wait parks at once instead of spinning (see
    /// [`crate::JobConfig::spin_auto`]).
    pub host_peers: u32,
}

impl Book {
    /// The precision tensor `tensor`'s gradients and values travel in: its own where it has
    /// one (a 16-bit parameter's), else the job's.
    pub fn wire_of(&self, tensor: u32) -> crate::precision::Wire {
        self.keymap
            .tensors
            .get(tensor as usize)
            .map_or(self.wire, |t| t.wire_in(self.wire))
    }
}

/// What a worker reattaching to a server says of one shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResumeShard {
    /// Global shard id.
    pub shard: u32,
    /// Its gradients acknowledged by the server (rejoin: the clock it starts at).
    pub pushes: u64,
    /// Its transferred-task gradients acknowledged.
    pub helps: u64,
}

/// The keys a worker needs for one shard on its server.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardKeys {
    /// Global shard id.
    pub shard: u32,
    /// The shard's parameters (read one-sided).
    pub params: Vec<u8>,
    /// The shard's meta block (read one-sided).
    pub meta: Vec<u8>,
    /// The lowest applied count among the other live workers on this shard: where a
    /// rejoining worker starts.
    pub clock: u64,
    /// This worker's gradient slot (written one-sided).
    pub slot: Vec<u8>,
}

/// A control message.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Msg {
    /// connecting node → acceptor: challenge me (the first message on a new link).
    Knock,
    /// acceptor → connecting node: prove you know the job token (see [`crate::auth`]).
    Challenge {
        /// A fresh random nonce.
        nonce: Vec<u8>,
    },
    /// node → scheduler: join the job.
    Hello {
        /// The role.
        role: Role,
        /// A requested rank, if any.
        rank: Option<u32>,
        /// The answer to the scheduler's challenge (the token itself never travels).
        proof: Vec<u8>,
        /// Where this node accepts links (servers).
        addr: String,
        /// The tensors this worker trains (workers).
        tensors: Vec<TensorSpec>,
    },
    /// scheduler → node: not admitted.
    Refused {
        /// Why.
        reason: String,
    },
    /// scheduler → node: the address book.
    Book(Book),
    /// node → scheduler: alive.
    Heartbeat,
    /// worker or server → scheduler, with each heartbeat: its counters, for the metrics
    /// endpoint.
    Metrics(NodeMetrics),
    /// worker → scheduler: arrived at barrier `seq`.
    Barrier {
        /// Barrier number.
        seq: u64,
    },
    /// scheduler → worker: every live worker arrived at barrier `seq`.
    BarrierDone {
        /// Barrier number.
        seq: u64,
    },
    /// scheduler → everyone: a node is gone.
    Dead {
        /// Its role.
        role: Role,
        /// Its rank.
        rank: u32,
    },
    /// worker → scheduler: finished.
    Done,
    /// worker → scheduler: this worker stops the whole job (its process was interrupted,
    /// terminated, or its script failed), saying why.
    Abort {
        /// Why, in words ("SIGINT", "its script raised ValueError: …").
        why: String,
    },
    /// scheduler → everyone: worker `rank` stopped the job; every operation fails with
    /// this cause.
    Aborted {
        /// The worker that stopped it.
        rank: u32,
        /// Why, in its words.
        why: String,
    },
    /// scheduler → servers: the job is over.
    Shutdown,
    /// worker → server: this link belongs to worker `rank`.
    Attach {
        /// The worker's rank.
        rank: u32,
        /// The answer to the server's challenge.
        proof: Vec<u8>,
    },
    /// server → worker: keys of every shard on this server.
    Keys {
        /// One entry per shard.
        shards: Vec<ShardKeys>,
    },
    /// worker → server: a pull the lock-free check did not allow.
    PullReq {
        /// Global shard id.
        shard: u32,
        /// The worker's clock.
        clock: u64,
        /// Request id (echoed as the immediate of the answering write).
        req: u32,
        /// Where to write the values (a key granted by the worker).
        dst: Vec<u8>,
        /// Offset in `dst`.
        dst_off: u64,
    },
    /// server → worker: a request was refused.
    Failed {
        /// What it concerns (`attach`).
        what: String,
        /// Why.
        reason: String,
    },
    /// server → worker: pull `req` was refused.
    PullFailed {
        /// The request id of the [`Msg::PullReq`].
        req: u32,
        /// Why.
        reason: String,
    },
    /// server → worker: a push was consumed; its slot is free.
    PushAck {
        /// Global shard id.
        shard: u32,
        /// Which push.
        of: AckOf,
        /// Its staleness: the updates applied to the shard between the values the gradient
        /// was computed on and its own (0 for synchronous clocks).
        staleness: u64,
    },
    /// worker → scheduler (ElasticBSP): at my barrier, about to start iteration `clock`.
    Superstep {
        /// The iteration the worker is about to start.
        clock: u64,
        /// Its estimated iteration interval in nanoseconds (0: unknown).
        interval_ns: u64,
    },
    /// scheduler → workers: server `rank` restarted from its checkpoint at `addr`; reattach.
    ServerBack {
        /// Its rank.
        rank: u32,
        /// Its new address.
        addr: String,
    },
    /// scheduler → everyone: worker `rank`, declared dead, rejoined the job.
    Rejoined {
        /// Its rank.
        rank: u32,
    },
    /// worker → server, after `Keys` on a reattach or a rejoin: where this worker stands on
    /// each of the server's shards (what it had acknowledged; a rejoin: its starting clock).
    Resume {
        /// A fresh process rejoining at the current clock (nothing of it is lost), not a
        /// reconnection of a live one.
        rejoin: bool,
        /// One entry per shard on the server.
        shards: Vec<ResumeShard>,
    },
    /// server → worker: the resume is in force; in-flight requests may be sent again.
    Resumed {
        /// Acknowledged updates of this worker the server no longer has (taken after its
        /// last checkpoint).
        lost: u64,
    },
    /// scheduler → worker (ElasticBSP): run the iterations `< until`, then wait at the next
    /// barrier.
    Plan {
        /// The clock of the worker's next barrier.
        until: u64,
    },
    /// server → worker (EPSP, FlexRR): you would block, or are ahead; take unprocessed tasks
    /// of `straggler`'s iteration `clock` if any are left.
    Offer {
        /// The worker behind.
        straggler: u32,
        /// Its iteration.
        clock: u64,
    },
    /// helper → scheduler → straggler (task transfer): give `helper` up to `want` unprocessed
    /// tasks of your iteration `clock` (the scheduler fills `helper` from the link it came on).
    Steal {
        /// The worker asked.
        straggler: u32,
        /// The worker asking.
        helper: u32,
        /// The straggler's iteration.
        clock: u64,
        /// The most tasks wanted.
        want: u32,
    },
    /// worker → scheduler (supervisor): an iteration took `nanos` with `threads` threads and
    /// `tasks` of its own tasks.
    IterationDone {
        /// Pool threads it ran with.
        threads: u32,
        /// Its own tasks it computed.
        tasks: u32,
        /// Its duration (compute and injected slowness, not waiting).
        nanos: u64,
    },
    /// scheduler → worker (parallelism manager): use this many threads from the next
    /// iteration on.
    Threads {
        /// The thread count.
        threads: u32,
    },
    /// straggler → scheduler → helper: tasks `start..end` of `straggler`'s iteration `clock`
    /// are now the helper's (empty: none left, or the straggler is gone).
    Tasks {
        /// The worker the tasks were taken from.
        straggler: u32,
        /// The worker they go to.
        helper: u32,
        /// The straggler's iteration.
        clock: u64,
        /// First task.
        start: u32,
        /// One past the last task.
        end: u32,
    },
    /// scheduler → node: you are declared dead (silent past the suspicion timeout); your links
    /// close. A worker may rejoin under its rank; a server restarts from its checkpoint.
    Evicted {
        /// Why, in words.
        reason: String,
    },
    /// server → scheduler: writing a checkpoint failed (sent at every failure).
    CheckpointFailed {
        /// The server's rank.
        rank: u32,
        /// Why, in words.
        reason: String,
        /// Its failed checkpoint writes so far, this one included.
        failures: u64,
    },
    /// worker → server: some rows of a shard, answered with [`Msg::Rows`] when the shard's
    /// policy allows clock `clock` (or refused with [`Msg::PullFailed`]).
    PullRows {
        /// Global shard id.
        shard: u32,
        /// The worker's clock.
        clock: u64,
        /// Request id (echoed in the answer).
        req: u32,
        /// The parts wanted: a row index (plain or packed, see [`crate::rows`]) of
        /// (first float from the shard's start, floats).
        #[serde(with = "serde_bytes")]
        ranges: Vec<u8>,
    },
    /// server → worker: the values of a [`Msg::PullRows`], its ranges one after another
    /// (f32, little-endian).
    Rows {
        /// The request id.
        req: u32,
        /// The values.
        #[serde(with = "serde_bytes")]
        values: Vec<u8>,
    },
}

impl Msg {
    /// The message's kind, for messages a user may see (never its contents).
    pub fn name(&self) -> &'static str {
        match self {
            Msg::Knock => "knock",
            Msg::Challenge { .. } => "challenge",
            Msg::Hello { .. } => "hello",
            Msg::Refused { .. } => "refused",
            Msg::Book(..) => "book",
            Msg::Heartbeat => "heartbeat",
            Msg::Metrics(_) => "metrics",
            Msg::Barrier { .. } => "barrier",
            Msg::BarrierDone { .. } => "barrier done",
            Msg::Dead { .. } => "dead",
            Msg::Done => "done",
            Msg::Abort { .. } => "abort",
            Msg::Aborted { .. } => "aborted",
            Msg::Shutdown => "shutdown",
            Msg::Attach { .. } => "attach",
            Msg::Keys { .. } => "keys",
            Msg::PullReq { .. } => "pull req",
            Msg::Failed { .. } => "failed",
            Msg::PullFailed { .. } => "pull failed",
            Msg::PushAck { .. } => "push ack",
            Msg::Superstep { .. } => "superstep",
            Msg::ServerBack { .. } => "server back",
            Msg::Rejoined { .. } => "rejoined",
            Msg::Resume { .. } => "resume",
            Msg::Resumed { .. } => "resumed",
            Msg::Plan { .. } => "plan",
            Msg::Offer { .. } => "offer",
            Msg::Steal { .. } => "steal",
            Msg::IterationDone { .. } => "iteration done",
            Msg::Threads { .. } => "threads",
            Msg::Tasks { .. } => "tasks",
            Msg::Evicted { .. } => "evicted",
            Msg::CheckpointFailed { .. } => "checkpoint failed",
            Msg::PullRows { .. } => "pull rows",
            Msg::Rows { .. } => "rows",
        }
    }
}

impl Msg {
    /// Encodes the message.
    pub fn encode(&self) -> Vec<u8> {
        // Sized first, then written once into a buffer of that size: a message carrying a
        // large byte string (row ranges, row values) is copied once, not regrown and copied
        // again as it is built.
        let size = postcard::experimental::serialized_size(self).unwrap_or(0);
        let mut out = Vec::with_capacity(3 + size);
        out.extend_from_slice(&[MAGIC[0], MAGIC[1], VERSION]);
        // Encoding plain data into a Vec cannot fail.
        postcard::to_io(self, &mut out).expect("encodable");
        out
    }

    /// The encoding of [`Msg::Rows`] `{ req, values }` with `bytes` bytes of values, which
    /// `fill` writes straight into the message: the same bytes as encoding the message, with
    /// no `values` vector built and copied first.
    pub fn encode_rows(req: u32, bytes: usize, fill: impl FnOnce(&mut [u8])) -> Vec<u8> {
        Msg::Rows {
            req,
            values: Vec::new(),
        }
        .encode_tail(bytes, fill)
    }

    /// The encoding of [`Msg::PullRows`] with the index `ranges`, written straight from the
    /// caller's bytes (no vector of them built first).
    pub fn encode_pull_rows(shard: u32, clock: u64, req: u32, ranges: &[u8]) -> Vec<u8> {
        Msg::PullRows {
            shard,
            clock,
            req,
            ranges: Vec::new(),
        }
        .encode_tail(ranges.len(), |b| b.copy_from_slice(ranges))
    }

    /// Where `data` is a whole [`Msg::Rows`] message: its request id and where its values
    /// start (they run to the end), so that they are read in place rather than copied out.
    /// `None` for any other message, and for one whose values do not end where `data` does
    /// (left to [`Msg::decode`], which refuses it or reads it as any message).
    pub fn rows_in(data: &[u8]) -> Option<(u32, usize)> {
        // The head every Rows message starts with: magic, version, the variant's tag (the
        // empty message less its two one-byte varints, the request id and the length).
        static HEAD: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
        let head = HEAD.get_or_init(|| {
            let mut empty = Msg::Rows {
                req: 0,
                values: Vec::new(),
            }
            .encode();
            empty.truncate(empty.len() - 2);
            empty
        });
        let rest = data.strip_prefix(&head[..])?;
        // The two fields read by postcard itself, so that exactly what it decodes is read.
        let (req, rest) = postcard::take_from_bytes::<u32>(rest).ok()?;
        let (len, rest) = postcard::take_from_bytes::<usize>(rest).ok()?;
        (len == rest.len()).then_some((req, data.len() - rest.len()))
    }

    /// Encodes `self`, whose last field is an empty byte string, as if that string held the
    /// `bytes` bytes `fill` writes.
    fn encode_tail(&self, bytes: usize, fill: impl FnOnce(&mut [u8])) -> Vec<u8> {
        let mut out = self.encode();
        // The empty byte string is its length, a varint 0, last: write the real length there.
        out.pop();
        out.reserve(10 + bytes);
        let mut len = bytes as u64;
        while len >= 0x80 {
            out.push((len as u8) | 0x80);
            len >>= 7;
        }
        out.push(len as u8);
        let start = out.len();
        out.resize(start + bytes, 0);
        fill(&mut out[start..]);
        out
    }

    /// Decodes a message, validating magic and version.
    pub fn decode(bytes: &[u8]) -> Result<Msg> {
        if bytes.len() < 3 || bytes[..2] != MAGIC {
            return Err(Error::Malformed(format!(
                "not an engine message ({} bytes)",
                bytes.len()
            )));
        }
        if bytes[2] != VERSION {
            return Err(Error::Malformed(format!(
                "engine protocol version {} (this build speaks {VERSION})",
                bytes[2]
            )));
        }
        postcard::from_bytes(&bytes[3..])
            .map_err(|e| Error::Malformed(format!("engine message: {e}")))
    }
}

/// Which push an acknowledgement answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum AckOf {
    /// The gradient of the worker's iteration `clock`.
    Push {
        /// Its clock.
        clock: u64,
    },
    /// A gradient of transferred tasks (acknowledged in order: one in flight per shard).
    Help,
    /// Initial values.
    Init,
}

/// What a push's slot holds after the floats: the version of the parameters the gradient was
/// computed on, the push's sequence number (a retried push is not applied twice), for
/// transferred tasks whose iteration they belong to, and a pull that rides on the push.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotTrailer {
    /// The version computed on (`None`: the one the server last sent this worker).
    pub computed_on: Option<u64>,
    /// The sequence number (1 for the first push of its kind; 0 for none).
    pub seq: u64,
    /// A [`PushKind::Help`] push: the straggler and the iteration its tasks were taken from.
    pub help_for: Option<(u32, u64)>,
    /// A pull of the pushed shard for the clock `seq` names, asked for with the push
    /// ([`crate::Worker::push_pull`]): answered as a [`Msg::PullReq`] arriving right behind
    /// the push would be, without a message of its own.
    pub pull: Option<TrailerPull>,
    /// A gradient left where the worker holds it: its values are not in the slot, the server
    /// reads them from the worker's memory (shm maps it; see [`TrailerSrc`]).
    pub src: Option<TrailerSrc>,
    /// The learning rate and weight decay the push asks for, as multiples of the job's
    /// (`None`: the job's own).
    pub rates: Option<crate::update::Rates>,
}

/// Where a gradient left in the worker's memory lies: a region the worker granted on the link
/// ([`falcon_transport::RemoteKey`] bytes, checked where the push is taken) and the offset of
/// the shard's first float in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TrailerSrc {
    /// The region's key.
    pub key: [u8; RemoteKey::SIZE],
    /// Where the shard's values start in it.
    pub off: u64,
}

/// The pull a push carries in its trailer: what a [`Msg::PullReq`] says besides the shard
/// and the clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TrailerPull {
    /// The worker's request id.
    pub req: u32,
    /// The answer's destination: a granted region's key ([`falcon_transport::RemoteKey`]
    /// bytes, checked where the pull is taken) and where in it.
    pub dst: [u8; RemoteKey::SIZE],
    /// Where in `dst`.
    pub dst_off: u64,
}

impl SlotTrailer {
    /// Its size on the wire: four little-endian u64 (`u64::MAX` stands for no version and no
    /// straggler): version, sequence number, straggler, its iteration; then the pull: a u32
    /// (1: there is one), its request id (u32), the destination offset (u64) and key; then
    /// the gradient's place in the worker's memory: a u32 (1: it is there, not in the slot),
    /// four reserved bytes, the offset (u64) and the key; then the rates: two little-endian
    /// f32 (the learning rate's factor, the weight decay's), both 0 for none (a factor of 0
    /// travels as −0).
    pub const BYTES: u64 = 72 + 2 * RemoteKey::SIZE as u64;

    /// Where the rates start.
    const RATES: usize = 64 + 2 * RemoteKey::SIZE;

    /// The wire form.
    pub fn to_bytes(self) -> [u8; Self::BYTES as usize] {
        let mut b = [0u8; Self::BYTES as usize];
        let (w, c) = self
            .help_for
            .map_or((u64::MAX, 0), |(w, c)| (u64::from(w), c));
        for (i, v) in [self.computed_on.unwrap_or(u64::MAX), self.seq, w, c]
            .into_iter()
            .enumerate()
        {
            b[i * 8..(i + 1) * 8].copy_from_slice(&v.to_le_bytes());
        }
        if let Some(p) = self.pull {
            b[32..36].copy_from_slice(&1u32.to_le_bytes());
            b[36..40].copy_from_slice(&p.req.to_le_bytes());
            b[40..48].copy_from_slice(&p.dst_off.to_le_bytes());
            b[48..88].copy_from_slice(&p.dst);
        }
        if let Some(src) = self.src {
            b[88..92].copy_from_slice(&1u32.to_le_bytes());
            b[96..104].copy_from_slice(&src.off.to_le_bytes());
            b[104..Self::RATES].copy_from_slice(&src.key);
        }
        if let Some(r) = self.rates {
            // 0 is "none": a factor of 0 is sent as −0 (the same number).
            let bits = |x: f32| {
                if x.to_bits() == 0 {
                    (-0.0f32).to_bits()
                } else {
                    x.to_bits()
                }
            };
            b[Self::RATES..Self::RATES + 4].copy_from_slice(&bits(r.lr).to_le_bytes());
            b[Self::RATES + 4..].copy_from_slice(&bits(r.wd).to_le_bytes());
        }
        b
    }

    /// Reads the wire form (any such bytes are a trailer; a straggler beyond `u32` is none,
    /// and so is a pull whose flag is not 1).
    pub fn from_bytes(b: [u8; Self::BYTES as usize]) -> SlotTrailer {
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i * 8..(i + 1) * 8]);
            u64::from_le_bytes(w)
        };
        let half = |at: usize| {
            let mut h = [0u8; 4];
            h.copy_from_slice(&b[at..at + 4]);
            u32::from_le_bytes(h)
        };
        let pull = (half(32) == 1).then(|| {
            let mut dst = [0u8; RemoteKey::SIZE];
            dst.copy_from_slice(&b[48..88]);
            TrailerPull {
                req: half(36),
                dst,
                dst_off: word(5),
            }
        });
        let src = (half(88) == 1).then(|| {
            let mut key = [0u8; RemoteKey::SIZE];
            key.copy_from_slice(&b[104..Self::RATES]);
            TrailerSrc { key, off: word(12) }
        });
        // Rates that are not finite numbers ≥ 0 are none (a worker cannot send them).
        let (lr, wd) = (half(Self::RATES), half(Self::RATES + 4));
        let rates = (lr != 0 || wd != 0)
            .then(|| crate::update::Rates {
                lr: f32::from_bits(lr),
                wd: f32::from_bits(wd),
            })
            .filter(crate::update::Rates::valid);
        SlotTrailer {
            computed_on: Some(word(0)).filter(|&v| v != u64::MAX),
            seq: word(1),
            help_for: u32::try_from(word(2)).ok().map(|w| (w, word(3))),
            pull,
            src,
            rates,
        }
    }
}

/// What a push into a slot carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PushKind {
    /// A gradient of the pusher's iteration.
    Gradient,
    /// Initial values (the first one wins).
    Init,
    /// A gradient of tasks taken from another worker (task transfer): applied, not counted
    /// in the pusher's clock.
    Help,
    /// A gradient of the pusher's iteration, as rows (see [`crate::rows`]).
    Rows,
}

/// The immediate of a push: the kind in the top two bits, the shard's index on its server in
/// the 30 below.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Immediate {
    /// What the slot holds.
    pub kind: PushKind,
    /// The shard's index on its server.
    pub local: u32,
}

impl Immediate {
    /// The most shards a server can hold.
    pub const MAX_LOCAL: u32 = 0x3FFF_FFFF;

    /// The 32-bit form.
    pub fn pack(self) -> u32 {
        let kind = match self.kind {
            PushKind::Gradient => 0,
            PushKind::Init => 1,
            PushKind::Help => 2,
            PushKind::Rows => 3,
        };
        (kind << 30) | (self.local & Self::MAX_LOCAL)
    }

    /// Reads the 32-bit form; an unknown kind is an error.
    pub fn unpack(v: u32) -> Result<Immediate> {
        let kind = match v >> 30 {
            0 => PushKind::Gradient,
            1 => PushKind::Init,
            2 => PushKind::Help,
            3 => PushKind::Rows,
            k => {
                return Err(Error::Malformed(format!(
                    "push immediate of unknown kind {k}"
                )));
            }
        };
        Ok(Immediate {
            kind,
            local: v & Self::MAX_LOCAL,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_garbage_is_an_error() {
        let m = Msg::Hello {
            role: Role::Worker,
            rank: Some(3),
            proof: vec![7; 32],
            addr: String::new(),
            tensors: vec![TensorSpec::new("w", 10)],
        };
        assert_eq!(Msg::decode(&m.encode()).unwrap(), m);
        let mut rng = fastrand::Rng::with_seed(1);
        for _ in 0..20_000 {
            let mut b = vec![0u8; rng.usize(0..64)];
            rng.fill(&mut b);
            if b.len() >= 3 && rng.bool() {
                b[..3].copy_from_slice(&[b'F', b'E', VERSION]);
            }
            let _ = Msg::decode(&b);
        }
        assert!(Msg::decode(b"FE\x09").is_err());
        for m in [
            Msg::Superstep {
                clock: 7,
                interval_ns: 1_500_000,
            },
            Msg::Plan { until: 11 },
            Msg::Offer {
                straggler: 2,
                clock: 9,
            },
            Msg::Steal {
                straggler: 1,
                helper: 0,
                clock: 4,
                want: 8,
            },
            Msg::IterationDone {
                threads: 2,
                tasks: 4,
                nanos: 1_000_000,
            },
            Msg::Threads { threads: 3 },
            Msg::Tasks {
                straggler: 1,
                helper: 0,
                clock: 4,
                start: 8,
                end: 16,
            },
            Msg::CheckpointFailed {
                rank: 1,
                reason: "write server-1.ckpt: No space left on device".into(),
                failures: 3,
            },
            Msg::PullRows {
                shard: 3,
                clock: 9,
                req: 77,
                ranges: vec![2, 0, 0, 0, 0, 0, 0, 0, 4, 0, 0, 0, 12, 0, 0, 0, 4, 0, 0, 0],
            },
            Msg::Rows {
                req: 77,
                values: vec![1, 2, 3, 4],
            },
        ] {
            assert_eq!(Msg::decode(&m.encode()).unwrap(), m);
        }
        // A row answer written in place is the message's own encoding.
        for n in [0usize, 1, 127, 128, 16_383, 16_384, 300_001] {
            let values: Vec<u8> = (0..n).map(|i| (i * 7) as u8).collect();
            let req = 0x1234_5678;
            let direct = Msg::encode_rows(req, n, |b| b.copy_from_slice(&values));
            assert_eq!(direct, Msg::Rows { req, values }.encode(), "{n} bytes");
        }
        // A row pull written from borrowed bytes is the message's own encoding, and a row
        // answer is read in place where it is one, whole.
        for n in [0usize, 1, 127, 128, 16_384, 300_001] {
            let bytes: Vec<u8> = (0..n).map(|i| (i * 5) as u8).collect();
            let m = Msg::PullRows {
                shard: 7,
                clock: 1 << 40,
                req: 300,
                ranges: bytes.clone(),
            };
            assert_eq!(Msg::encode_pull_rows(7, 1 << 40, 300, &bytes), m.encode());
            assert_eq!(Msg::rows_in(&m.encode()), None, "not a row answer");
            let req = 0x8765_4321;
            let rows = Msg::Rows {
                req,
                values: bytes.clone(),
            }
            .encode();
            let (id, at) = Msg::rows_in(&rows).unwrap();
            assert_eq!((id, &rows[at..]), (req, &bytes[..]));
            // Cut short (refused by decode too) or overlong: not read in place.
            if n > 0 {
                assert_eq!(Msg::rows_in(&rows[..rows.len() - 1]), None);
                assert!(Msg::decode(&rows[..rows.len() - 1]).is_err());
            }
            let mut long = rows.clone();
            long.push(0);
            assert_eq!(Msg::rows_in(&long), None);
        }
        // Integers postcard refuses are refused in place too: a request id in six bytes, a
        // length whose tenth byte overflows 64 bits.
        let head = {
            let mut m = Msg::Rows {
                req: 0,
                values: Vec::new(),
            }
            .encode();
            m.truncate(m.len() - 2);
            m
        };
        for tail in [
            &[0x80, 0x80, 0x80, 0x80, 0x80, 0x00, 0x00][..],
            &[
                0x00, 0x81, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x02, 0x07,
            ][..],
        ] {
            let m = [&head[..], tail].concat();
            assert_eq!(Msg::rows_in(&m), None, "{tail:?}");
            assert!(Msg::decode(&m).is_err(), "{tail:?}");
        }
        // A message of another protocol version is refused, not misread.
        let mut old = Msg::Plan { until: 1 }.encode();
        old[2] = VERSION - 1;
        assert!(Msg::decode(&old).is_err());
        // The two kind bits are all taken: every immediate reads as one kind.
        for kind in [
            PushKind::Gradient,
            PushKind::Init,
            PushKind::Help,
            PushKind::Rows,
        ] {
            let i = Immediate { kind, local: 12345 };
            assert_eq!(Immediate::unpack(i.pack()).unwrap(), i);
        }
        for t in [
            SlotTrailer {
                computed_on: None,
                seq: 0,
                help_for: None,
                pull: None,
                src: None,
                rates: None,
            },
            SlotTrailer {
                computed_on: Some(7),
                seq: 9,
                help_for: Some((3, 41)),
                pull: None,
                src: None,
                rates: None,
            },
            SlotTrailer {
                computed_on: Some(1),
                seq: 2,
                help_for: None,
                pull: Some(TrailerPull {
                    req: u32::MAX,
                    dst: [0xA5; RemoteKey::SIZE],
                    dst_off: 1 << 40,
                }),
                src: Some(TrailerSrc {
                    key: [0x5A; RemoteKey::SIZE],
                    off: (1 << 33) + 4,
                }),
                rates: Some(crate::update::Rates { lr: 0.25, wd: 0.0 }),
            },
            SlotTrailer {
                computed_on: None,
                seq: 3,
                help_for: None,
                pull: None,
                src: Some(TrailerSrc {
                    key: [1; RemoteKey::SIZE],
                    off: 0,
                }),
                rates: Some(crate::update::Rates { lr: 0.0, wd: 3.5 }),
            },
        ] {
            assert_eq!(SlotTrailer::from_bytes(t.to_bytes()), t);
        }
        // Any bytes are a trailer; a pull or source flag other than 1 is none.
        let mut b = [0xFFu8; SlotTrailer::BYTES as usize];
        assert_eq!(SlotTrailer::from_bytes(b).pull, None);
        assert_eq!(SlotTrailer::from_bytes(b).src, None);
        b[88..92].copy_from_slice(&1u32.to_le_bytes());
        assert_eq!(
            SlotTrailer::from_bytes(b).src.map(|s| s.off),
            Some(u64::MAX)
        );
        b[32..36].copy_from_slice(&1u32.to_le_bytes());
        assert_eq!(
            SlotTrailer::from_bytes(b).pull.map(|p| p.req),
            Some(u32::MAX)
        );
        // Rates that are not finite numbers ≥ 0 (NaN here, then −1) are none.
        assert_eq!(SlotTrailer::from_bytes(b).rates, None);
        let at = SlotTrailer::BYTES as usize - 8;
        b[at..at + 4].copy_from_slice(&(-1.0f32).to_bits().to_le_bytes());
        b[at + 4..].copy_from_slice(&0.5f32.to_bits().to_le_bytes());
        assert_eq!(SlotTrailer::from_bytes(b).rates, None);
        b[at..at + 4].copy_from_slice(&2.0f32.to_bits().to_le_bytes());
        assert_eq!(
            SlotTrailer::from_bytes(b).rates,
            Some(crate::update::Rates { lr: 2.0, wd: 0.5 })
        );
        for m in [
            Msg::PushAck {
                shard: 1,
                of: AckOf::Push { clock: 4 },
                staleness: 2,
            },
            Msg::PushAck {
                shard: 1,
                of: AckOf::Help,
                staleness: 0,
            },
            Msg::PushAck {
                shard: 1,
                of: AckOf::Init,
                staleness: 0,
            },
            Msg::PullFailed {
                req: 3,
                reason: "no".into(),
            },
        ] {
            assert_eq!(Msg::decode(&m.encode()).unwrap(), m);
        }
    }
}
