// The loop of osdp.split.SplitLinear, driven through a c10d ProcessGroup.
//
// Forward: all-gather slice i+1 while slice i multiplies into its part of the
// output. Backward: gather again, compute the input gradient and the slice's
// weight gradient, reduce-scatter that gradient behind the next slice's
// compute. Same arguments, collectives and order as osdp/split/_loop.py
// (with `pairwise_*`, osdp.comm's reduce-scatter and all-gather: NCCL's traffic on gloo).
//
// Layout: each rank holds rows_per_rank = sum(piece_sizes) rows of the weight
// (FSDP2's Shard(0) chunk, padded on the tail ranks), cut into pieces; slice i
// is piece i of every rank, gathered rank-major into (N * q_i, in).
//
// On CPU (gloo), collectives run on the process group's threads and
// Work::wait() blocks. On a device with streams (CUDA with NCCL), collectives
// are issued from a communication stream, ordered against the compute stream
// with events, into two gather buffers used in turn (ping-pong); Work::wait()
// only makes the issuing stream wait, so the CPU runs ahead. That path is
// written against c10's device-generic Stream/Event API, so the extension
// compiles the same with or without a CUDA toolkit.
//
// The slices travel through a Transport: the process group's collectives, or,
// to measure the overlap on one device where there is no second rank, a
// stand-in (stand_in_forward / stand_in_backward) that moves the same bytes
// between pinned host memory and the device with copies issued where the
// collectives would be, on the communication stream. Everything else (the
// loop, the streams, events and buffers) is the same code.

#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 with torch's casters: not torch/extension.h, whose C++ frontend doubles the compile

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <mutex>
#include <numeric>
#include <optional>
#include <thread>
#include <unordered_map>
#include <utility>

namespace {

using ProcessGroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// _allgather_base / _reduce_scatter_base exist in every torch >= 2.9; newer
// releases deprecate them in favour of all_gather_single / reduce_scatter_single.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
WorkPtr all_gather(const ProcessGroupPtr& pg, at::Tensor& out, at::Tensor& in) {
  return pg->_allgather_base(out, in);
}
#pragma GCC diagnostic pop

// osdp.comm's pairwise reduce-scatter (NCCL's traffic on gloo, whose own reduce-scatter moves about an
// all-reduce's bytes): rank r sends chunk j of its input to rank j, receives chunk r of every peer's input
// (the nearest peer's straight into the output) and sums them with its own in wait(). CPU tensors only.
class PairwiseReduceScatter : public c10d::Work {
 public:
  PairwiseReduceScatter(const ProcessGroupPtr& pg, at::Tensor& out, at::Tensor& in, int tag)
      : out_(out.view({-1})), n_(pg->getSize()) {
    TORCH_CHECK(out.is_cpu() && in.is_contiguous() && out.is_contiguous(),
                "the pairwise reduce-scatter takes contiguous CPU tensors");
    int64_t rank = pg->getRank();
    auto chunks = in.view({n_, -1});
    own_ = chunks[rank];
    for (int64_t step = 1; step < n_; ++step) {
      int64_t to = (rank + step) % n_, from = (rank - step + n_) % n_;
      at::Tensor buffer = step == 1 ? out_ : at::empty_like(out_);
      std::vector<at::Tensor> recv{buffer}, send{chunks[to]};
      works_.push_back(pg->recv(recv, from, tag));
      works_.push_back(pg->send(send, to, tag));
      if (step > 1) received_.push_back(buffer);
    }
  }

  bool wait(std::chrono::milliseconds timeout) override {
    if (done_) return true;
    for (auto& work : works_) work->wait(timeout);
    if (n_ == 1) {
      out_.copy_(own_);
    } else {
      out_.add_(own_);
      for (auto& chunk : received_) out_.add_(chunk);
      out_.div_(n_);  // data-parallel mean, as the native path's AVG
    }
    works_.clear();
    received_.clear();
    own_.reset();
    done_ = true;
    return true;
  }

  bool isCompleted() override { return done_; }

 private:
  at::Tensor out_, own_;
  int64_t n_;
  std::vector<WorkPtr> works_;
  std::vector<at::Tensor> received_;
  bool done_ = false;
};

// osdp.comm's pairwise all-gather (NCCL's traffic on gloo, whose own all-gather is slower through a
// rate-limited link): rank r copies its piece into chunk r of the output, sends it to every peer and
// receives peer j's into chunk j. CPU tensors only.
class PairwiseAllGather : public c10d::Work {
 public:
  PairwiseAllGather(const ProcessGroupPtr& pg, at::Tensor& out, at::Tensor& in, int tag) {
    TORCH_CHECK(out.is_cpu() && in.is_contiguous() && out.is_contiguous(),
                "the pairwise all-gather takes contiguous CPU tensors");
    int64_t n = pg->getSize(), rank = pg->getRank();
    auto chunks = out.view({n, -1});
    at::Tensor own = chunks[rank];
    own.copy_(in.view({-1}));
    for (int64_t step = 1; step < n; ++step) {
      int64_t to = (rank + step) % n, from = (rank - step + n) % n;
      std::vector<at::Tensor> recv{chunks[from]}, send{own};
      works_.push_back(pg->recv(recv, from, tag));
      works_.push_back(pg->send(send, to, tag));
    }
  }

  bool wait(std::chrono::milliseconds timeout) override {
    if (done_) return true;
    for (auto& work : works_) work->wait(timeout);
    works_.clear();
    done_ = true;
    return true;
  }

  bool isCompleted() override { return done_; }

 private:
  std::vector<WorkPtr> works_;
  bool done_ = false;
};

// The group's own reduce-scatter on CPU, as osdp.comm.native_reduce_scatter runs it: gloo's reduce-scatter is an
// all-reduce of a copy of its input that gloo's worker thread frees whenever it next runs, after wait() returned,
// so in some steps one slice more was alive at the peak. Here the copy is made, all-reduced and, once gloo has
// let go of it, freed in wait(): at the same point of every step.
class CopiedReduceScatter : public c10d::Work {
 public:
  CopiedReduceScatter(const ProcessGroupPtr& pg, at::Tensor& out, at::Tensor& in)
      : out_(out), n_(pg->getSize()), rank_(pg->getRank()) {
    TORCH_CHECK(in.numel() == n_ * out.numel() && in.scalar_type() == out.scalar_type(),
                "reduce-scatter: the input must hold world size x the output's elements, of the same dtype");
    copy_ = in.clone(at::MemoryFormat::Contiguous);
    holders_ = holders();
    std::vector<at::Tensor> tensors{copy_};
    work_ = pg->allreduce(tensors);  // a sum: gloo's all-reduce has no mean
  }

  bool wait(std::chrono::milliseconds timeout) override {
    if (done_) return true;
    work_->wait(timeout);
    work_.reset();
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);  // as LET_GO_TIMEOUT_S
    while (held_more(holders()) && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::yield();  // let the worker thread drop the copy and its views of it
    }
    auto chunk = copy_.view({n_, -1})[rank_];
    if (n_ > 1) chunk.div_(n_);  // data-parallel mean, as FSDP2's
    out_.view({-1}).copy_(chunk);
    copy_.reset();
    out_.reset();
    done_ = true;
    return true;
  }

  bool isCompleted() override { return done_; }

 private:
  // Who holds the copy (its handle) and its memory (views).
  std::pair<size_t, size_t> holders() const {
    return {c10::raw::intrusive_ptr::use_count(copy_.unsafeGetTensorImpl()),
            c10::raw::intrusive_ptr::use_count(copy_.storage().unsafeGetStorageImpl())};
  }
  bool held_more(const std::pair<size_t, size_t>& now) const {
    return now.first > holders_.first || now.second > holders_.second;
  }

  at::Tensor out_, copy_;
  int64_t n_, rank_;
  std::pair<size_t, size_t> holders_;
  WorkPtr work_;
  bool done_ = false;
};

// Tags of the op's pairwise collectives: the same sequence on every rank (every rank runs the same
// ops in the same order); osdp/comm.py counts its own from 1 << 24, so the two never meet.
std::atomic<int64_t> pairwise_calls{0};

int next_pairwise_tag() { return static_cast<int>((1 << 25) + pairwise_calls.fetch_add(1) % (1 << 20)); }

WorkPtr all_gather(const ProcessGroupPtr& pg, at::Tensor& out, at::Tensor& in, bool pairwise) {
  if (pairwise) return c10::make_intrusive<PairwiseAllGather>(pg, out, in, next_pairwise_tag());
  return all_gather(pg, out, in);
}

WorkPtr reduce_scatter(const ProcessGroupPtr& pg, at::Tensor& out, at::Tensor& in, bool pairwise) {
  if (pairwise) return c10::make_intrusive<PairwiseReduceScatter>(pg, out, in, next_pairwise_tag());
  if (in.is_cpu()) return c10::make_intrusive<CopiedReduceScatter>(pg, out, in);
  c10d::ReduceScatterOptions opts;
  // Data-parallel mean, like FSDP2 (which also avoids AVG on a single rank).
  opts.reduceOp = pg->getSize() > 1 ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM;
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  return pg->_reduce_scatter_base(out, in, opts);
#pragma GCC diagnostic pop
}

// How slice i moves: gathered into `out` (size() * q_i rows) from this rank's `piece`, and
// its weight gradient `in` (size() * q_i rows, rank-major) reduce-scattered into `out`.
// A null Work means the transfer was enqueued on the current stream (nothing to wait for).
class Transport {
 public:
  virtual ~Transport() = default;
  virtual int64_t size() const = 0;
  virtual WorkPtr gather(at::Tensor& out, at::Tensor& piece, int64_t i) = 0;
  virtual WorkPtr reduce_scatter(at::Tensor& out, at::Tensor& in, int64_t i) = 0;
};

// `pairwise_reduce` / `pairwise_gather`: osdp.comm's collectives instead of the group's own (see
// PairwiseReduceScatter, PairwiseAllGather).
class GroupTransport final : public Transport {
 public:
  GroupTransport(ProcessGroupPtr pg, bool pairwise_reduce, bool pairwise_gather)
      : pg_(std::move(pg)), pairwise_reduce_(pairwise_reduce), pairwise_gather_(pairwise_gather) {}
  int64_t size() const override { return pg_->getSize(); }
  WorkPtr gather(at::Tensor& out, at::Tensor& piece, int64_t) override {
    return all_gather(pg_, out, piece, pairwise_gather_);
  }
  WorkPtr reduce_scatter(at::Tensor& out, at::Tensor& in, int64_t) override {
    return ::reduce_scatter(pg_, out, in, pairwise_reduce_);
  }

 private:
  ProcessGroupPtr pg_;
  bool pairwise_reduce_, pairwise_gather_;
};

// The stand-in: one rank holding the whole weight; slice i is copied in from pinned host
// memory (`slices[i]`, the bytes a gather would bring) and each slice's weight gradient is
// copied out to pinned host memory (`sinks[i]`, the bytes a reduce-scatter would send); the
// reduction over one rank is the identity. On a GPU the copies run on the copy engines
// over PCIe, on the communication stream, for as long as those bytes take.
class HostCopyTransport final : public Transport {
 public:
  HostCopyTransport(std::vector<at::Tensor> slices, std::vector<at::Tensor> sinks)
      : slices_(std::move(slices)), sinks_(std::move(sinks)) {}
  int64_t size() const override { return 1; }
  WorkPtr gather(at::Tensor& out, at::Tensor&, int64_t i) override {
    out.copy_(slices_.at(i), /*non_blocking=*/true);
    return {};
  }
  WorkPtr reduce_scatter(at::Tensor& out, at::Tensor& in, int64_t i) override {
    sinks_.at(i).copy_(in, /*non_blocking=*/true);
    if (!out.is_same(in)) out.copy_(in, /*non_blocking=*/true);
    return {};
  }

 private:
  std::vector<at::Tensor> slices_, sinks_;
};

// On CPU, gloo runs a collective on a worker thread that keeps its tensors (and views of them it made)
// until it is done with them, which can be after Work::wait() returned: memory the op then lets go of
// would be freed whenever that thread next runs, so a step's peak would hold one more slice in some steps
// and not others (osdp.comm.Lent does the same for the Python collectives). LetGo notes how many hold a
// tensor before it is given to a collective and, once the collective completed, waits until no more do:
// its TensorImpl (the handle the collective keeps), and, for memory the op owns alone, its storage (views).
class LetGo {
 public:
  void watch(const at::Tensor& t, bool owned) {
    if (!t.defined() || !t.is_cpu()) return;
    auto* storage = owned ? t.storage().unsafeGetStorageImpl() : nullptr;
    items_.push_back({t.unsafeGetTensorImpl(), t.use_count(), storage, storage ? count(storage) : 0});
  }

  // Called while the op still holds every watched tensor.
  void wait() {
    using clock = std::chrono::steady_clock;
    auto deadline = clock::now() + std::chrono::seconds(1);  // past this, go on (as LET_GO_TIMEOUT_S)
    for (const auto& item : items_) {
      while ((count(item.impl) > item.impl_holders || (item.storage && count(item.storage) > item.storage_holders))
             && clock::now() < deadline) {
        std::this_thread::yield();  // let the worker thread run
      }
    }
    items_.clear();
  }

 private:
  static size_t count(c10::intrusive_ptr_target* target) { return c10::raw::intrusive_ptr::use_count(target); }

  struct Item {
    c10::TensorImpl* impl;
    size_t impl_holders;
    c10::StorageImpl* storage;
    size_t storage_holders;
  };
  std::vector<Item> items_;
};

// Live and peak bytes of the buffers the op holds.
struct Counter {
  std::atomic<int64_t> live{0};
  std::atomic<int64_t> peak{0};
  void add(int64_t n) {
    int64_t now = live.fetch_add(n) + n;
    int64_t old = peak.load();
    while (now > old && !peak.compare_exchange_weak(old, now)) {
    }
  }
};
Counter gathered_bytes, grad_bytes;

// A buffer counted from its allocation until the op lets go of it. (A collective's
// backend may hold it a moment longer, e.g. gloo's worker thread.)
class Counted {
 public:
  Counted(at::Tensor t, Counter& counter) : t_(std::move(t)), counter_(&counter), nbytes_(t_.nbytes()) {
    counter_->add(nbytes_);
  }
  Counted(Counted&& other) noexcept
      : t_(std::move(other.t_)), counter_(other.counter_), nbytes_(std::exchange(other.nbytes_, 0)) {}
  Counted(const Counted&) = delete;
  Counted& operator=(const Counted&) = delete;
  Counted& operator=(Counted&&) = delete;
  ~Counted() { counter_->add(-nbytes_); }
  at::Tensor& tensor() { return t_; }

 private:
  at::Tensor t_;
  Counter* counter_;
  int64_t nbytes_;
};

std::vector<int64_t> offsets_of(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> offsets(sizes.size(), 0);
  for (size_t i = 1; i < sizes.size(); ++i) offsets[i] = offsets[i - 1] + sizes[i - 1];
  return offsets;
}

// One high-priority communication stream per device, reused across calls.
c10::Stream comm_stream(const c10::Device& device) {
  static std::mutex mutex;
  static std::unordered_map<c10::Device, c10::Stream> streams;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = streams.find(device);
  if (it == streams.end()) {
    auto stream = c10::impl::VirtualGuardImpl(device.type()).getStreamFromGlobalPool(device, /*isHighPriority=*/true);
    it = streams.emplace(device, stream).first;
  }
  return it->second;
}

// `waiter` waits for everything enqueued on `on` so far.
void wait_stream(const c10::Stream& waiter, const c10::Stream& on) {
  c10::Event event(on.device_type());
  event.record(on);
  event.block(waiter);
}

// Orders collectives against compute: nothing to do on CPU, streams and events on a device.
class Streams {
 public:
  explicit Streams(const at::Tensor& like) {
    if (like.is_cpu()) return;
    compute_ = c10::impl::VirtualGuardImpl(like.device().type()).getStream(like.device());
    comm_ = comm_stream(like.device());
    for (auto& event : done_) event.emplace(like.device().type());
  }

  // Runs `issue` (which enqueues a collective) on the communication stream, after
  // everything already enqueued on the compute stream; returns once it is queued.
  template <typename F>
  WorkPtr on_comm(F issue, int slot) {
    if (!comm_) return issue();
    wait_stream(*comm_, *compute_);
    c10::StreamGuard guard(*comm_);
    WorkPtr work = issue();
    if (work) work->wait();  // the communication stream waits for the collective; the CPU does not
    done_[slot]->record(*comm_);
    return work;
  }

  // The compute stream (or, on CPU, the calling thread) waits for a collective.
  void wait(const WorkPtr& work, int slot) {
    if (comm_) {
      done_[slot]->block(*compute_);
    } else if (work) {
      work->wait();
    }
  }

  // Called before buffers that collectives used are freed: on a device, the compute
  // stream (where they were allocated) waits for the communication stream. On CPU
  // a collective's Work holds its tensors until it completes.
  void drain() {
    if (comm_) wait_stream(*compute_, *comm_);
  }

 private:
  std::optional<c10::Stream> compute_, comm_;
  std::optional<c10::Event> done_[4];  // slots 0-1: the two gather buffers; 2-3: reduce-scatters in flight
};

// All-gathers slice i+1 into one of two buffers while slice i, in the other, is used.
class Gatherer {
 public:
  Gatherer(const at::Tensor& w, Transport& transport, const std::vector<int64_t>& sizes, at::ScalarType dtype,
           Streams& streams)
      : w_(w), transport_(transport), sizes_(sizes), offsets_(offsets_of(sizes)), dtype_(dtype), streams_(streams) {
    int64_t q_max = *std::max_element(sizes.begin(), sizes.end());
    int count = sizes.size() > 1 ? 2 : 1;
    for (int b = 0; b < count; ++b) {
      buffers_.emplace_back(at::empty({transport.size() * q_max, w.size(1)}, w.options().dtype(dtype)),
                            gathered_bytes);
    }
  }

  ~Gatherer() { streams_.drain(); }

  void start(int64_t i) {
    int slot = i % buffers_.size();
    out_[slot] = buffers_[slot].tensor().narrow(0, 0, transport_.size() * sizes_[i]);
    work_[slot] = streams_.on_comm(
        [&] {
          in_[slot] = piece(i);  // on a device: cast/padded on the communication stream, off the compute path
          let_go_[slot].watch(out_[slot], /*owned=*/true);
          let_go_[slot].watch(in_[slot], /*owned=*/!in_[slot].storage().is_alias_of(w_.storage()));
          return transport_.gather(out_[slot], in_[slot], i);
        },
        slot);
  }

  at::Tensor wait(int64_t i) {
    int slot = i % buffers_.size();
    streams_.wait(work_[slot], slot);
    work_[slot].reset();
    let_go_[slot].wait();
    in_[slot].reset();
    return out_[slot];
  }

 private:
  at::Tensor piece(int64_t i) {
    int64_t off = offsets_[i], q = sizes_[i];
    int64_t real = std::clamp<int64_t>(w_.size(0) - off, 0, q);
    if (real == q && w_.scalar_type() == dtype_ && w_.is_contiguous()) return w_.narrow(0, off, q);
    auto p = at::zeros({q, w_.size(1)}, w_.options().dtype(dtype_));  // padding rows of the tail ranks stay zero
    if (real > 0) p.narrow(0, 0, real).copy_(w_.narrow(0, off, real));
    return p;
  }

  at::Tensor w_;
  Transport& transport_;
  std::vector<int64_t> sizes_, offsets_;
  at::ScalarType dtype_;
  Streams& streams_;
  std::vector<Counted> buffers_;
  at::Tensor out_[2], in_[2];
  WorkPtr work_[2];
  LetGo let_go_[2];
};

at::Tensor forward_loop(const at::Tensor& x, const at::Tensor& w_local, Transport& transport,
                        const std::vector<int64_t>& piece_sizes, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && w_local.dim() == 2 && x.size(1) == w_local.size(1), "split_linear_forward: bad shapes");
  int64_t n = transport.size(), m = x.size(0);
  int64_t c = std::accumulate(piece_sizes.begin(), piece_sizes.end(), int64_t{0});
  auto out = at::empty({m, n * c}, x.options());
  auto out_by_rank = out.view({m, n, c});
  Streams streams(x);
  {
    Gatherer gatherer(w_local, transport, piece_sizes, x.scalar_type(), streams);
    auto offsets = offsets_of(piece_sizes);
    gatherer.start(0);
    for (size_t i = 0; i < piece_sizes.size(); ++i) {
      auto w_i = gatherer.wait(i);
      if (i + 1 < piece_sizes.size()) gatherer.start(i + 1);
      int64_t q = piece_sizes[i];
      out_by_rank.narrow(2, offsets[i], q).copy_(at::mm(x, w_i.t()).view({m, n, q}));
    }
  }
  return n * c == out_features ? out : out.narrow(1, 0, out_features).contiguous();
}

using Grads = std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>>;

Grads backward_loop(const at::Tensor& grad_out_in, const at::Tensor& x, const at::Tensor& w_local,
                    Transport& transport, const std::vector<int64_t>& piece_sizes, int64_t out_features,
                    bool need_input_grad, bool need_weight_grad, std::optional<at::ScalarType> reduce_dtype_opt) {
  int64_t n = transport.size(), m = x.size(0);
  int64_t c = std::accumulate(piece_sizes.begin(), piece_sizes.end(), int64_t{0});
  auto offsets = offsets_of(piece_sizes);
  at::Tensor grad_out = n * c == out_features ? grad_out_in : at::constant_pad_nd(grad_out_in, {0, n * c - out_features});
  auto grad_by_rank = grad_out.view({m, n, c});
  auto reduce_dtype = reduce_dtype_opt.value_or(x.scalar_type());
  std::optional<at::Tensor> grad_x, grad_w;
  if (need_input_grad) grad_x = at::zeros_like(x);
  if (need_weight_grad) grad_w = at::empty({c, w_local.size(1)}, w_local.options());
  bool in_place = need_weight_grad && reduce_dtype == grad_w->scalar_type();

  Streams streams(x);
  {
    std::optional<Gatherer> gatherer;
    if (need_input_grad) gatherer.emplace(w_local, transport, piece_sizes, x.scalar_type(), streams);

    // Reduce-scatters in flight use event slots 2 and 3 in turn: at most two are in flight.
    struct Pending {
      WorkPtr work;
      Counted unreduced;
      at::Tensor reduced;
      int64_t offset;
      int slot;
      LetGo let_go;
    };
    struct InFlight {
      Streams& streams;
      std::deque<Pending> queue;
      ~InFlight() { streams.drain(); }
    } in_flight{streams, {}};
    auto& pending = in_flight.queue;
    auto finish = [&] {
      auto& p = pending.front();
      streams.wait(p.work, p.slot);
      p.work.reset();
      p.let_go.wait();
      if (!in_place) grad_w->narrow(0, p.offset, p.reduced.size(0)).copy_(p.reduced);
      pending.pop_front();
    };

    if (gatherer) gatherer->start(0);
    for (size_t i = 0; i < piece_sizes.size(); ++i) {
      int64_t off = offsets[i], q = piece_sizes[i];
      auto g_i = grad_by_rank.narrow(2, off, q).reshape({m, n * q});
      if (gatherer) {
        auto w_i = gatherer->wait(i);
        if (i + 1 < piece_sizes.size()) gatherer->start(i + 1);
        grad_x->addmm_(g_i, w_i);
      }
      if (need_weight_grad) {
        Counted unreduced(at::mm(g_i.t(), x).to(reduce_dtype), grad_bytes);  // (n * q, in), rank-major
        auto reduced = in_place ? grad_w->narrow(0, off, q) : at::empty({q, x.size(1)}, x.options().dtype(reduce_dtype));
        int slot = 2 + i % 2;
        LetGo let_go;
        let_go.watch(unreduced.tensor(), /*owned=*/true);
        let_go.watch(reduced, /*owned=*/!in_place);
        auto work = streams.on_comm([&] { return transport.reduce_scatter(reduced, unreduced.tensor(), i); }, slot);
        pending.push_back({work, std::move(unreduced), reduced, off, slot, std::move(let_go)});
        while (pending.size() > 1) finish();
      }
    }
    gatherer.reset();
    while (!pending.empty()) finish();
  }
  if (grad_w && grad_w->size(0) != w_local.size(0)) grad_w = grad_w->narrow(0, 0, w_local.size(0));
  return {grad_x, grad_w};
}

at::Tensor split_linear_forward(const at::Tensor& x, const at::Tensor& w_local, const ProcessGroupPtr& pg,
                                const std::vector<int64_t>& piece_sizes, int64_t out_features,
                                bool pairwise_gather) {
  GroupTransport transport(pg, false, pairwise_gather);  // the forward only gathers
  return forward_loop(x, w_local, transport, piece_sizes, out_features);
}

Grads split_linear_backward(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& w_local,
                            const ProcessGroupPtr& pg, const std::vector<int64_t>& piece_sizes, int64_t out_features,
                            bool need_input_grad, bool need_weight_grad,
                            std::optional<at::ScalarType> reduce_dtype, bool pairwise_reduce,
                            bool pairwise_gather) {
  GroupTransport transport(pg, pairwise_reduce, pairwise_gather);
  return backward_loop(grad_out, x, w_local, transport, piece_sizes, out_features, need_input_grad,
                       need_weight_grad, reduce_dtype);
}

void check_stand_in(const at::Tensor& w, const std::vector<at::Tensor>& slices, const std::vector<int64_t>& sizes,
                    int64_t out_features) {
  TORCH_CHECK(w.dim() == 2 && w.size(0) == out_features,
              "stand-in: one rank holds the whole weight, (out_features, in_features)");
  TORCH_CHECK(slices.size() == sizes.size(), "stand-in: one host tensor per slice, got ", slices.size(), " for ",
              sizes.size(), " slices");
  for (size_t i = 0; i < sizes.size(); ++i) {
    TORCH_CHECK(slices[i].dim() == 2 && slices[i].size(0) == sizes[i] && slices[i].size(1) == w.size(1),
                "stand-in: host tensor ", i, " must be (", sizes[i], ", ", w.size(1), ")");
  }
}

at::Tensor stand_in_forward(const at::Tensor& x, const at::Tensor& w, const std::vector<at::Tensor>& slices,
                            const std::vector<int64_t>& piece_sizes) {
  check_stand_in(w, slices, piece_sizes, w.size(0));
  HostCopyTransport transport(slices, {});
  return forward_loop(x, w, transport, piece_sizes, w.size(0));
}

Grads stand_in_backward(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& w,
                        const std::vector<at::Tensor>& slices, const std::vector<at::Tensor>& sinks,
                        const std::vector<int64_t>& piece_sizes) {
  check_stand_in(w, slices, piece_sizes, w.size(0));
  TORCH_CHECK(sinks.size() == piece_sizes.size(), "stand-in: one host gradient sink per slice");
  HostCopyTransport transport(slices, sinks);
  return backward_loop(grad_out, x, w, transport, piece_sizes, w.size(0), true, true, std::nullopt);
}

std::unordered_map<std::string, int64_t> memory_stats() {
  return {{"gathered_bytes", gathered_bytes.live.load()},
          {"peak_gathered_bytes", gathered_bytes.peak.load()},
          {"grad_bytes", grad_bytes.live.load()},
          {"peak_grad_bytes", grad_bytes.peak.load()}};
}

void reset_peak_memory_stats() {
  gathered_bytes.peak.store(gathered_bytes.live.load());
  grad_bytes.peak.store(grad_bytes.live.load());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The loops release the GIL: they block on collectives run by other threads.
  m.def("forward", &split_linear_forward, py::call_guard<py::gil_scoped_release>());
  m.def("backward", &split_linear_backward, py::call_guard<py::gil_scoped_release>());
  // Overlap measurements on one device (see HostCopyTransport); not used by SplitLinear.
  m.def("stand_in_forward", &stand_in_forward, py::call_guard<py::gil_scoped_release>());
  m.def("stand_in_backward", &stand_in_backward, py::call_guard<py::gil_scoped_release>());
  m.def("memory_stats", &memory_stats);
  m.def("reset_peak_memory_stats", &reset_peak_memory_stats);
}
