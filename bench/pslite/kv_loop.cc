// kv_loop: falcon's synthetic worker loop, written against ps-lite's public API.
//
// One binary for every role (ps-lite reads DMLC_ROLE and the other DMLC_* variables).
//   PSBENCH_FLOATS  model size in floats (default 1048576)
//   PSBENCH_ITERS   iterations per worker, warm-up included (default 100)
//   PSBENCH_LR      the servers' SGD learning rate (default 1e-3)
//   KV_MODE         dense (default) or sparse
//   KV_LOOP         dense: pullpush (default: ZPull, wait, ZPush, wait) or pushpull (one
//                   ZPushPull per iteration, wait: the push and the next iteration's pull
//                   in one request; a pull before the loop)
//   KV_TABLE        sparse: the table's rows, one float each (default 1000000)
//   KV_KEYS         sparse: keys drawn per iteration (default 1000)
//   KV_SETS         sparse: 0 (default) draws the keys in each iteration; N >= 1 draws N
//                   sets of them before the loop (then a barrier of the workers) and uses
//                   them in turn, as falcon's FALCON_ROWS_SETS
//
// Layout ("dense"): the model is split into one slice per server; slice s is stored under
// one key, the first key of server s's range (Postoffice::GetServerKeyRanges), so ps-lite's
// default slicer sends each slice to its own server.
//
// Worker: per iteration, pull the whole model (wait), grad_i = w_i - (rank + 1), push it
// (wait). The first 10 % of the iterations are a warm-up and are not timed. At the end it
// prints one line:
//   RESULT role=worker rank=R iters=N secs=S it_s=X p50_us=Y mean_us=Z all_iters=M
//          all_secs=T all_it_s=U w0=V
// where N counts the timed iterations, S their total time, p50_us the median of one
// pull+push iteration; all_* cover the whole loop, warm-up included, as falcon's worker
// counts its it/s.
//
// Server: a request handle that keeps its slice; a push applies w -= lr * g, a pull answers
// the stored values without copying them (the SArray is shared with the outgoing message).
//
// Sparse mode (KV_MODE=sparse; PSBENCH_FLOATS is not used): a table of KV_TABLE rows of one
// float. Each iteration a worker draws KV_KEYS random rows with replacement and keeps the
// distinct ones, sorted (the set falcon's FALCON_WORKLOAD=rows worker draws, with its
// generator, wyrand seeded with rank + 1, and its unbiased bounded draw; it sorts and dedups a
// vector, kv_loop marks a bitmap, which is cheaper), pulls their values with one ZPull (one
// value per key, wait), computes grad = value - (rank + 1), and ZPushes the gradients (wait).
// Layout: row i belongs to server s = the s with lo(s) <= i < lo(s+1), lo(s) = floor(s * T / S)
// (contiguous equal blocks, as falcon's shards), and its ps-lite key is
// GetServerKeyRanges()[s].begin() + (i - lo(s)). ps-lite splits the u64 key space into S equal
// ranges and its default slicer cuts a sorted key list at the range boundaries, so each server
// gets exactly its block; the mapping is monotone, so sorted rows give sorted keys. A server
// keeps its block as a flat float array indexed by key - range begin, applies w -= lr * g per
// pushed key and answers a pull with the values of the requested keys (a fresh SArray, the keys
// shared with the request). The RESULT line adds mode=sparse, table=T, keys=K, sets=N,
// mean_keys (distinct keys per iteration, the mean) and gen_us (the mean time to draw the
// keys and map them to ps-lite keys inside each iteration; about 0 with KV_SETS >= 1).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <unordered_map>
#include <vector>

#include "ps/ps.h"

namespace {

long long EnvInt(const char* name, long long dflt) {
  const char* v = std::getenv(name);
  return (v && *v) ? std::atoll(v) : dflt;
}

double EnvDouble(const char* name, double dflt) {
  const char* v = std::getenv(name);
  return (v && *v) ? std::atof(v) : dflt;
}

// Floats in server s's slice: equal slices, the last one takes the remainder.
size_t SliceLen(size_t floats, int servers, int s) {
  size_t base = floats / servers;
  return s + 1 == servers ? floats - base * (servers - 1) : base;
}

// The one key of server s's slice.
ps::Key SliceKey(int s) {
  return ps::Postoffice::Get()->GetServerKeyRanges()[s].begin();
}

struct SgdStore {
  float lr = 1e-3f;
  // One key per server in the dense layout, but keep a map so a stray key is an error, not UB.
  std::unordered_map<ps::Key, ps::SArray<float>> store;

  void operator()(const ps::KVMeta& meta, const ps::KVPairs<float>& req,
                  ps::KVServer<float>* server) {
    ps::KVPairs<float> res;
    if (meta.push) {
      size_t off = 0;
      for (size_t i = 0; i < req.keys.size(); ++i) {
        auto it = store.find(req.keys[i]);
        CHECK(it != store.end()) << "unknown key " << req.keys[i];
        size_t len = req.lens.empty() ? req.vals.size() / req.keys.size()
                                      : static_cast<size_t>(req.lens[i]);
        CHECK_EQ(len, it->second.size()) << "push of the wrong length";
        float* w = it->second.data();
        const float* g = req.vals.data() + off;
        for (size_t j = 0; j < len; ++j) w[j] -= lr * g[j];
        off += len;
      }
    }
    if (meta.pull) {
      res.keys = req.keys;
      if (req.keys.size() == 1) {
        auto it = store.find(req.keys[0]);
        CHECK(it != store.end()) << "unknown key " << req.keys[0];
        res.vals = it->second;  // zero-copy: shares the stored buffer
      } else {
        for (ps::Key k : req.keys) {
          auto it = store.find(k);
          CHECK(it != store.end()) << "unknown key " << k;
          res.vals.append(it->second);
        }
      }
      // A ZPushPull with lens expects the answer's lens (ps-lite checks them).
      if (!req.lens.empty()) {
        for (ps::Key k : req.keys) {
          res.lens.push_back(static_cast<int>(store.find(k)->second.size()));
        }
      }
    }
    server->Response(meta, res);
  }
};

void RunServer(size_t floats, float lr) {
  auto* server = new ps::KVServer<float>(0);
  SgdStore handle;
  handle.lr = lr;
  int s = ps::MyRank();
  ps::SArray<float> slice(SliceLen(floats, ps::NumServers(), s), 0.0f);
  handle.store[SliceKey(s)] = slice;
  server->set_request_handle(handle);
  ps::RegisterExitCallback([server]() { delete server; });
}

void RunWorker(size_t floats, long long iters, bool push_pull) {
  ps::KVWorker<float> kv(0, 0);
  const int servers = ps::NumServers();
  const int rank = ps::MyRank();
  const float target = static_cast<float>(rank + 1);

  ps::SArray<ps::Key> keys(servers);
  ps::SArray<int> lens(servers);
  for (int s = 0; s < servers; ++s) {
    keys[s] = SliceKey(s);
    lens[s] = static_cast<int>(SliceLen(floats, servers, s));
  }
  ps::SArray<float> w(floats, 0.0f);
  ps::SArray<float> grad(floats, 0.0f);

  long long warmup = iters / 10;
  std::vector<double> times_us;
  times_us.reserve(static_cast<size_t>(iters));
  using Clock = std::chrono::steady_clock;
  Clock::time_point timed_start;
  const Clock::time_point loop_start = Clock::now();
  if (push_pull) kv.Wait(kv.ZPull(keys, &w));
  for (long long t = 0; t < iters; ++t) {
    if (t == warmup) timed_start = Clock::now();
    auto t0 = Clock::now();
    if (!push_pull) kv.Wait(kv.ZPull(keys, &w));
    const float* wp = w.data();
    float* gp = grad.data();
    for (size_t i = 0; i < floats; ++i) gp[i] = wp[i] - target;
    if (push_pull) {
      kv.Wait(kv.ZPushPull(keys, grad, &w, &lens));
    } else {
      kv.Wait(kv.ZPush(keys, grad, lens));
    }
    auto t1 = Clock::now();
    if (t >= warmup) {
      times_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
  }
  const Clock::time_point loop_end = Clock::now();
  double secs = std::chrono::duration<double>(loop_end - timed_start).count();
  // The whole loop, warm-up included: what falcon's worker reports as its it/s.
  double all_secs = std::chrono::duration<double>(loop_end - loop_start).count();
  long long timed = iters - warmup;
  std::vector<double> sorted = times_us;
  std::sort(sorted.begin(), sorted.end());
  double p50 = sorted.empty() ? 0.0
      : (sorted.size() % 2 ? sorted[sorted.size() / 2]
                           : 0.5 * (sorted[sorted.size() / 2 - 1] + sorted[sorted.size() / 2]));
  double sum = 0;
  for (double x : times_us) sum += x;
  double mean = times_us.empty() ? 0.0 : sum / times_us.size();
  // Sanity: a finite model near the targets (ASP overshoots a little, never diverges).
  bool ok = true;
  for (size_t i = 0; i < floats; ++i) {
    if (!(w[i] == w[i]) || std::abs(w[i]) > 4.0f * ps::NumWorkers()) { ok = false; break; }
  }
  std::printf("RESULT role=worker rank=%d iters=%lld secs=%.6f it_s=%.3f p50_us=%.3f "
              "mean_us=%.3f all_iters=%lld all_secs=%.6f all_it_s=%.3f w0=%.6f\n",
              rank, timed, secs, timed / secs, p50, mean, iters, all_secs, iters / all_secs,
              static_cast<double>(w[0]));
  std::fflush(stdout);
  if (!ok) {
    std::fprintf(stderr, "worker %d: the model diverged\n", rank);
    std::exit(1);
  }
}

// ---- sparse mode ------------------------------------------------------------------------

// wyrand, as the fastrand crate 2.x (falcon's worker) has it (the wyhash v4.2 constants),
// and its unbiased bounded draw (Lemire's multiply-high with rejection): for the same rank
// both sides draw the same rows.
struct WyRand {
  uint64_t state;
  explicit WyRand(uint64_t seed) : state(seed) {}
  uint64_t Next() {
    state += 0x2d358dccaa6c78a5ULL;
    __uint128_t t = static_cast<__uint128_t>(state) * (state ^ 0x8bb84b93962eacc9ULL);
    return static_cast<uint64_t>(t >> 64) ^ static_cast<uint64_t>(t);
  }
  // Uniform in [0, n), n >= 1.
  uint64_t Below(uint64_t n) {
    uint64_t x = Next();
    __uint128_t m = static_cast<__uint128_t>(x) * n;
    uint64_t lo = static_cast<uint64_t>(m);
    if (lo < n) {
      uint64_t t = (0 - n) % n;
      while (lo < t) {
        x = Next();
        m = static_cast<__uint128_t>(x) * n;
        lo = static_cast<uint64_t>(m);
      }
    }
    return static_cast<uint64_t>(m >> 64);
  }
};

// First table row of server s (s = S gives T).
uint64_t BlockLo(uint64_t table, int servers, int s) {
  return static_cast<uint64_t>((static_cast<__uint128_t>(table) * s) / servers);
}

struct SparseStore {
  float lr = 1e-3f;
  ps::Key begin = 0;  // the ps-lite key of this server's first row
  std::vector<float> w;

  size_t Index(ps::Key k) const {
    CHECK(k >= begin && k - begin < w.size()) << "key " << k << " is not this server's";
    return static_cast<size_t>(k - begin);
  }

  void operator()(const ps::KVMeta& meta, const ps::KVPairs<float>& req,
                  ps::KVServer<float>* server) {
    ps::KVPairs<float> res;
    const size_t n = req.keys.size();
    if (meta.push) {
      CHECK(req.lens.empty()) << "sparse mode: one value per key, no lens";
      CHECK_EQ(req.vals.size(), n) << "sparse mode: one value per key";
      const float* g = req.vals.data();
      for (size_t i = 0; i < n; ++i) w[Index(req.keys[i])] -= lr * g[i];
    }
    if (meta.pull) {
      res.keys = req.keys;  // shared, no copy
      res.vals.resize(n);
      float* v = res.vals.data();
      for (size_t i = 0; i < n; ++i) v[i] = w[Index(req.keys[i])];
    }
    server->Response(meta, res);
  }
};

void RunSparseServer(uint64_t table, float lr) {
  auto* server = new ps::KVServer<float>(0);
  SparseStore handle;
  handle.lr = lr;
  const int s = ps::MyRank();
  const int servers = ps::NumServers();
  handle.begin = ps::Postoffice::Get()->GetServerKeyRanges()[s].begin();
  handle.w.assign(BlockLo(table, servers, s + 1) - BlockLo(table, servers, s), 0.0f);
  server->set_request_handle(handle);
  ps::RegisterExitCallback([server]() { delete server; });
}

void RunSparseWorker(uint64_t table, uint64_t nkeys, long long iters, long long sets) {
  ps::KVWorker<float> kv(0, 0);
  const int servers = ps::NumServers();
  const int rank = ps::MyRank();
  const float target = static_cast<float>(rank + 1);
  const auto& ranges = ps::Postoffice::Get()->GetServerKeyRanges();
  std::vector<uint64_t> lo(servers + 1);
  for (int s = 0; s <= servers; ++s) lo[s] = BlockLo(table, servers, s);

  WyRand rng(static_cast<uint64_t>(rank) + 1);
  std::vector<uint64_t> rows(nkeys);
  std::vector<uint64_t> bits((table + 63) / 64);
  // K draws with replacement, sorted, duplicates dropped: the set falcon's rows worker
  // draws (it sorts and dedups a vector); here a bitmap of the table gives the same sorted
  // set in O(K + T/64), so the drawing costs ps-lite's loop as little as possible. Written
  // as ps-lite keys into `kp`; returns how many.
  auto draw = [&](ps::Key* kp) {
    std::fill(bits.begin(), bits.end(), 0);
    for (uint64_t j = 0; j < nkeys; ++j) {
      uint64_t r = rng.Below(table);
      bits[r >> 6] |= uint64_t{1} << (r & 63);
    }
    size_t n = 0;
    for (size_t wi = 0; wi < bits.size(); ++wi) {
      uint64_t b = bits[wi];
      while (b) {
        rows[n++] = (static_cast<uint64_t>(wi) << 6) |
                    static_cast<uint64_t>(__builtin_ctzll(b));
        b &= b - 1;
      }
    }
    int s = 0;
    for (size_t j = 0; j < n; ++j) {
      while (rows[j] >= lo[s + 1]) ++s;
      kp[j] = ranges[s].begin() + (rows[j] - lo[s]);
    }
    return n;
  };
  // Buffers of K entries; each iteration uses their first n (a zero-copy segment).
  ps::SArray<ps::Key> keys_buf(nkeys);
  ps::SArray<float> vals_buf(nkeys);
  ps::SArray<float> grad_buf(nkeys);
  // KV_SETS >= 1: the key sets drawn now, used in turn by the loop.
  std::vector<ps::SArray<ps::Key>> pool;
  for (long long k = 0; k < sets; ++k) {
    ps::SArray<ps::Key> set(nkeys);
    size_t n = draw(set.data());
    pool.push_back(set.segment(0, n));
  }
  if (sets > 0) ps::Postoffice::Get()->Barrier(0, ps::kWorkerGroup);

  long long warmup = iters / 10;
  std::vector<double> times_us;
  times_us.reserve(static_cast<size_t>(iters));
  double gen_us_sum = 0;
  double keys_sum = 0;
  size_t last_n = 0;
  using Clock = std::chrono::steady_clock;
  Clock::time_point timed_start;
  const Clock::time_point loop_start = Clock::now();
  for (long long t = 0; t < iters; ++t) {
    if (t == warmup) timed_start = Clock::now();
    auto t0 = Clock::now();
    ps::SArray<ps::Key> keys;
    if (pool.empty()) {
      keys = keys_buf.segment(0, draw(keys_buf.data()));
    } else {
      keys = pool[static_cast<size_t>(t % sets)];
    }
    const size_t n = keys.size();
    auto tg = Clock::now();
    ps::SArray<float> vals = vals_buf.segment(0, n);
    ps::SArray<float> grad = grad_buf.segment(0, n);
    kv.Wait(kv.ZPull(keys, &vals));
    const float* vp = vals.data();
    float* gp = grad.data();
    for (size_t j = 0; j < n; ++j) gp[j] = vp[j] - target;
    kv.Wait(kv.ZPush(keys, grad));
    auto t1 = Clock::now();
    gen_us_sum += std::chrono::duration<double, std::micro>(tg - t0).count();
    keys_sum += static_cast<double>(n);
    last_n = n;
    if (t >= warmup) {
      times_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
  }
  const Clock::time_point loop_end = Clock::now();
  double secs = std::chrono::duration<double>(loop_end - timed_start).count();
  double all_secs = std::chrono::duration<double>(loop_end - loop_start).count();
  long long timed = iters - warmup;
  std::vector<double> sorted = times_us;
  std::sort(sorted.begin(), sorted.end());
  double p50 = sorted.empty() ? 0.0
      : (sorted.size() % 2 ? sorted[sorted.size() / 2]
                           : 0.5 * (sorted[sorted.size() / 2 - 1] + sorted[sorted.size() / 2]));
  double sum = 0;
  for (double x : times_us) sum += x;
  double mean = times_us.empty() ? 0.0 : sum / times_us.size();
  // Sanity: the last pulled values are finite and near the targets.
  bool ok = true;
  for (size_t j = 0; j < last_n; ++j) {
    float v = vals_buf[j];
    if (!(v == v) || std::abs(v) > 4.0f * ps::NumWorkers()) { ok = false; break; }
  }
  std::printf("RESULT role=worker rank=%d mode=sparse table=%llu keys=%llu sets=%lld iters=%lld "
              "secs=%.6f it_s=%.3f p50_us=%.3f mean_us=%.3f all_iters=%lld all_secs=%.6f "
              "all_it_s=%.3f mean_keys=%.1f gen_us=%.3f v0=%.6f\n",
              rank, static_cast<unsigned long long>(table),
              static_cast<unsigned long long>(nkeys), sets, timed, secs, timed / secs, p50, mean,
              iters, all_secs, iters / all_secs, keys_sum / iters, gen_us_sum / iters,
              static_cast<double>(vals_buf[0]));
  std::fflush(stdout);
  if (!ok) {
    std::fprintf(stderr, "worker %d: the table diverged\n", rank);
    std::exit(1);
  }
}

}  // namespace

int main() {
  const size_t floats = static_cast<size_t>(EnvInt("PSBENCH_FLOATS", 1 << 20));
  const long long iters = EnvInt("PSBENCH_ITERS", 100);
  const float lr = static_cast<float>(EnvDouble("PSBENCH_LR", 1e-3));
  const char* mode_env = std::getenv("KV_MODE");
  const std::string mode = (mode_env && *mode_env) ? mode_env : "dense";
  const long long table = EnvInt("KV_TABLE", 1000000);
  const long long nkeys = EnvInt("KV_KEYS", 1000);
  const long long sets = EnvInt("KV_SETS", 0);
  if (mode != "dense" && mode != "sparse") {
    std::fprintf(stderr, "kv_loop: KV_MODE must be dense or sparse, not '%s'\n", mode.c_str());
    return 2;
  }
  const bool sparse = mode == "sparse";
  const char* loop_env = std::getenv("KV_LOOP");
  const std::string loop = (loop_env && *loop_env) ? loop_env : "pullpush";
  if (loop != "pullpush" && loop != "pushpull") {
    std::fprintf(stderr, "kv_loop: KV_LOOP must be pullpush or pushpull, not '%s'\n",
                 loop.c_str());
    return 2;
  }
  if (floats < 1 || iters < 1 || !(lr > 0)) {
    std::fprintf(stderr, "kv_loop: PSBENCH_FLOATS and PSBENCH_ITERS must be >= 1, "
                         "PSBENCH_LR > 0\n");
    return 2;
  }
  if (sparse && (table < 1 || nkeys < 1 || nkeys > table)) {
    std::fprintf(stderr, "kv_loop: sparse mode needs 1 <= KV_KEYS <= KV_TABLE\n");
    return 2;
  }
  // As falcon's FALCON_ROWS_SETS: at most 2^27 keys (1 GiB of them) drawn ahead.
  if (sparse && (sets < 0 || sets > (1LL << 27) / nkeys)) {
    std::fprintf(stderr, "kv_loop: KV_SETS must be 0 .. 2^27 / KV_KEYS\n");
    return 2;
  }
  // Start without its barrier, install the server's handle, then meet: with ps::Start(0) a
  // worker's first request can reach a server before its handle is set (ps-lite's own tests
  // have that race; it aborts with "Check failed: request_handle_").
  ps::StartAsync(0);
  if (ps::IsServer()) {
    if (sparse) {
      RunSparseServer(static_cast<uint64_t>(table), lr);
    } else {
      RunServer(floats, lr);
    }
  }
  ps::Postoffice::Get()->Barrier(0, ps::kWorkerGroup + ps::kServerGroup + ps::kScheduler);
  if (ps::IsWorker()) {
    if (sparse) {
      if (static_cast<long long>(ps::NumServers()) > table) {
        std::fprintf(stderr, "kv_loop: fewer table rows than servers\n");
        return 2;
      }
      RunSparseWorker(static_cast<uint64_t>(table), static_cast<uint64_t>(nkeys), iters, sets);
    } else {
      if (static_cast<size_t>(ps::NumServers()) > floats) {
        std::fprintf(stderr, "kv_loop: fewer floats than servers\n");
        return 2;
      }
      RunWorker(floats, iters, loop == "pushpull");
    }
  }
  ps::Finalize(0, true);
  return 0;
}
