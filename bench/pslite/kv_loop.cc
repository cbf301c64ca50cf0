// kv_loop: falcon's synthetic worker loop, written against ps-lite's public API.
//
// One binary for every role (ps-lite reads DMLC_ROLE and the other DMLC_* variables).
//   PSBENCH_FLOATS  model size in floats (default 1048576)
//   PSBENCH_ITERS   iterations per worker, warm-up included (default 100)
//   PSBENCH_LR      the servers' SGD learning rate (default 1e-3)
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

#include <algorithm>
#include <chrono>
#include <cmath>
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

void RunWorker(size_t floats, long long iters) {
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
  for (long long t = 0; t < iters; ++t) {
    if (t == warmup) timed_start = Clock::now();
    auto t0 = Clock::now();
    kv.Wait(kv.ZPull(keys, &w));
    const float* wp = w.data();
    float* gp = grad.data();
    for (size_t i = 0; i < floats; ++i) gp[i] = wp[i] - target;
    kv.Wait(kv.ZPush(keys, grad, lens));
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

}  // namespace

int main() {
  const size_t floats = static_cast<size_t>(EnvInt("PSBENCH_FLOATS", 1 << 20));
  const long long iters = EnvInt("PSBENCH_ITERS", 100);
  const float lr = static_cast<float>(EnvDouble("PSBENCH_LR", 1e-3));
  if (floats < 1 || iters < 1 || !(lr > 0)) {
    std::fprintf(stderr, "kv_loop: PSBENCH_FLOATS and PSBENCH_ITERS must be >= 1, "
                         "PSBENCH_LR > 0\n");
    return 2;
  }
  // Start without its barrier, install the server's handle, then meet: with ps::Start(0) a
  // worker's first request can reach a server before its handle is set (ps-lite's own tests
  // have that race; it aborts with "Check failed: request_handle_").
  ps::StartAsync(0);
  if (ps::IsServer()) RunServer(floats, lr);
  ps::Postoffice::Get()->Barrier(0, ps::kWorkerGroup + ps::kServerGroup + ps::kScheduler);
  if (ps::IsWorker()) {
    if (static_cast<size_t>(ps::NumServers()) > floats) {
      std::fprintf(stderr, "kv_loop: fewer floats than servers\n");
      return 2;
    }
    RunWorker(floats, iters);
  }
  ps::Finalize(0, true);
  return 0;
}
