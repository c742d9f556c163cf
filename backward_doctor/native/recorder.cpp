// The native first tier: a RecordFunction observer that records what the Python
// dispatch mode (_record.py) records, at a fraction of its cost.
//
// It records the ops a Python TorchDispatchMode would see: dispatcher ops whose
// enclosing ops (since the innermost autograd node) are all
// CompositeImplicitAutograd, i.e. the first op below each decomposition. For each:
// name, phase, autograd sequence numbers, grad mode, input/output tensor metadata
// and storage identity (StorageImpl*, the same number as Python's
// untyped_storage()._cdata), the Python stack as (code object, bytecode offset)
// pairs, live bytes per category after it, in-place writes and a finiteness check of
// scalar forward outputs. Live bytes: storages are counted when first seen as an
// op output (or registered from Python) and uncounted when their memory is freed:
// seen by the CPU allocator, wrapped for the recording, or where it cannot be
// wrapped, reported by c10's memory-reporting hook (as the profiler uses).
//
// Everything is plain ints until stop(), which hands the buffers to Python.
#include <torch/extension.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/SequenceNumber.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/profiler/orchestration/observer.h>
#include <Python.h>
#include <frameobject.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace {

constexpr int kCategories = 5;  // trace.CATEGORIES: parameters, gradients, optimizer, activations, other
constexpr int kActivations = 3, kOther = 4, kOptimizerCat = 2;
constexpr int kMaxFrames = 96;

struct OpInfo {
  bool composite = false;  // CompositeImplicitAutograd: decomposes above the Python key
  bool transparent = false;  // not an operator (user ranges, ...): not an op, does not hide ops
  std::vector<int> mutated;  // positional arguments it writes into
  bool view = false;         // returns a view of an input (shows values its base already had)
  bool keeps_finite = false; // finite inputs give finite outputs (no arithmetic that can overflow)
  int64_t name_id = -1;
};

// Ops whose outputs are finite when their inputs are: they move, select or zero values, and never
// compute new ones that could overflow. Detail screening skips them unless an input already holds
// NaN/Inf (then the output is screened, to carry the origin on). Not here: casts (float32 -> float16
// overflows), masked_fill/where/fill (their scalar may be -inf), anything that sums.
const std::unordered_set<std::string> kKeepsFinite = {
    "aten::relu", "aten::relu_", "aten::threshold", "aten::threshold_", "aten::threshold_backward",
    "aten::native_dropout", "aten::native_dropout_backward", "aten::clone", "aten::cat", "aten::stack",
    "aten::index", "aten::index_select", "aten::gather", "aten::embedding", "aten::max_pool2d_with_indices",
    "aten::max_pool1d_with_indices", "aten::max_pool3d_with_indices", "aten::abs", "aten::neg", "aten::sign",
    "aten::clamp", "aten::clamp_min", "aten::clamp_max", "aten::constant_pad_nd", "aten::roll", "aten::flip",
    "aten::repeat", "aten::tril", "aten::triu", "aten::zeros_like", "aten::ones_like", "aten::zero_",
    "aten::bernoulli_", "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
    "aten::new_empty_strided", "aten::zeros", "aten::ones", "aten::arange", "aten::sort", "aten::topk",
    "aten::max", "aten::min", "aten::amax", "aten::amin", "aten::argmax", "aten::argmin"};

struct Open {  // a RecordFunction still running on this thread
  bool function = false;   // FUNCTION scope (else an autograd node)
  bool visible = false;    // recorded as an op
  bool composite = false;
  int64_t seq = -1;        // autograd node: its sequence number
  int64_t rec = -1;        // visible: index into recs (in units of kWidth)
  int64_t t0 = 0;
  int uncaught = 0;            // std::uncaught_exceptions() at start: more at the end means it failed
  bool light = false;          // past max_ops: counted, not recorded
  int64_t index = -1, name_id = -1, phase = 0;  // visible ops
  const char* name = nullptr;  // autograd node: its name (lives as long as the RecordFunction)
  bool view = false;           // visible op that returns a view
  bool keeps_finite = false;   // visible op that cannot turn finite inputs into NaN/Inf
  std::vector<int> mutated;    // visible op: the positions it writes into
  bool engine = false;         // the engine's range around a node
};

struct Entry { int64_t nbytes; int cat; int64_t producer; int64_t data; };

struct VecHash {
  size_t operator()(const std::vector<int64_t>& v) const {
    size_t h = v.size();
    for (int64_t x : v) h ^= std::hash<int64_t>()(x) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    return h;
  }
};

// Per visible op, kWidth ints: index, name id, phase (0 fwd, 1 bwd, 2 optimizer), node seq (bwd),
// seq before, seq after (fwd), grad mode, tensor offset, inputs, outputs, frame offset, frames,
// live total, 5 category totals, duration ns, non-finite scalar (1), module stack id (set from Python),
// start (ns since recording started).
constexpr int kWidth = 22;
// Where the later fields sit (the 5 category totals are 13-17): named, since a duration written at 17 was
// overwritten by the last category's bytes (every native op's duration read as the 'other' bytes / 1000).
constexpr int kDuration = 18, kNonfiniteScalar = 19, kStackId = 20, kStart = 21;
// The ledger's history for exporters (a memory_viz snapshot): 5 ints per event (action 1 counted, 0 freed,
// 2 moved to another category; storage key; bytes; category; op), at most kStorageLogCap events.
constexpr size_t kStorageLogCap = 100000;

// The CPU blocks allocated since start, with their sizes: every CPU allocation and free of the step is counted
// here (by the wrapped allocator, or torch's memory reports), on the threads that carry the recorder's
// thread-local state (the cell's, autograd's; not a plain Python thread), asleep or not (a small loop: ~60 an
// iteration).
// Open addressing in two flat arrays, so that a report allocates nothing (a node-based map did, at each
// allocation: over a quarter of always on's cost an iteration of a small CPU loop, measured with callgrind).
class BlockTable {
 public:
  BlockTable() { rehash(1024); }
  void insert(void* ptr, int64_t size) {
    if ((used_ + 1) * 2 > keys_.size()) rehash(live_ * 4 > keys_.size() ? keys_.size() * 2 : keys_.size());
    size_t i = slot(ptr), tomb = SIZE_MAX;
    for (;; i = (i + 1) & mask_) {
      void* k = keys_[i];
      if (k == ptr) { sizes_[i] = size; return; }  // (reported twice: the latest size, as a map's [] did)
      if (k == tombstone() && tomb == SIZE_MAX) tomb = i;
      if (k == nullptr) break;
    }
    if (tomb != SIZE_MAX) i = tomb; else ++used_;
    keys_[i] = ptr;
    sizes_[i] = size;
    ++live_;
  }
  // The block's size, removed; 0 when it was not allocated since start.
  int64_t erase(void* ptr) {
    for (size_t i = slot(ptr);; i = (i + 1) & mask_) {
      void* k = keys_[i];
      if (k == nullptr) return 0;
      if (k == ptr) {
        keys_[i] = tombstone();
        --live_;
        return sizes_[i];
      }
    }
  }

 private:
  static void* tombstone() { return reinterpret_cast<void*>(uintptr_t(1)); }
  size_t slot(void* ptr) const {  // (Fibonacci hashing: blocks are 16-64 byte aligned, the low bits say little)
    return size_t((uintptr_t(ptr) >> 4) * 0x9E3779B97F4A7C15ull) & mask_;
  }
  void rehash(size_t capacity) {
    std::vector<void*> keys(std::move(keys_));
    std::vector<int64_t> sizes(std::move(sizes_));
    keys_.assign(capacity, nullptr);
    sizes_.assign(capacity, 0);
    mask_ = capacity - 1;
    used_ = live_ = 0;
    for (size_t i = 0; i < keys.size(); ++i)
      if (keys[i] != nullptr && keys[i] != tombstone()) insert(keys[i], sizes[i]);
  }
  std::vector<void*> keys_;
  std::vector<int64_t> sizes_;
  size_t mask_ = 0, used_ = 0, live_ = 0;  // used_: live blocks and tombstones
};

// A lock held for a few instructions, almost never contended (the other reporting threads: autograd's device
// threads, intra-op workers): a mutex's lock and unlock cost more than the table's work here.
class SpinLock {
 public:
  void lock() { while (flag_.test_and_set(std::memory_order_acquire)) std::this_thread::yield(); }
  void unlock() { flag_.clear(std::memory_order_release); }

 private:
  std::atomic_flag flag_ = ATOMIC_FLAG_INIT;
};

struct State {
  std::thread::id owner;
  std::string cell_file;
  bool frames_on = true;
  int optimizer_depth = 0;
  int paused = 0;  // > 0 while torch.compile compiles: its ops on fake tensors are not the step's
  bool asleep = false;  // the observer is removed (a training loop's iteration not sampled): zero cost
  // A simulated device of `limit` bytes (-1: none): an allocation that would take the live bytes
  // (storages counted so far, as the timeline counts them) past it fails, inside the op that asks for
  // it, as a real device's would. (Temporaries an op frees before it ends are not added up, as the
  // timeline does not see them either: the limit and the peak the report shows mean the same thing.)
  int64_t limit = -1;
  // Detail (the replay that finds where NaN/Inf was born): every output screened. Per storage key,
  // the op that first made its NaN/Inf; per op, the origin of its NaN/Inf; events as ints, their
  // tensors' metadata and statistics (first kDetailBudget origins only) in the ev_* buffers.
  bool detail = false;
  std::unordered_map<int64_t, int64_t> nf_origin, nf_by_index;
  std::vector<int64_t> events;    // index, origin, kind (0 op, 1 input, 2 weights), variable key, meta offset, metas
  std::vector<int64_t> ev_metas;  // dtype, device type, device index, requires_grad, ndim, size offset, stats offset
  std::vector<int64_t> ev_sizes;
  std::vector<double> ev_stats;   // numel, nan, +inf, -inf, has finite, min, max, mean
  int detail_budget = 8;
  bool oom = false;  // the simulated device ran out: index, requested, live, category totals below
  int64_t oom_index = -1, oom_requested = 0, oom_live = 0;
  std::array<int64_t, 5> oom_totals{};
  std::unordered_map<int64_t, int64_t> oom_by_producer;
  int64_t stack_id = 0;
  int saved_log_level = 0;
  std::shared_ptr<c10::MemoryReportingInfoBase> reporter;
  bool reporting = false;  // our reporter is on the debug-info stack (off while a user's profiler runs)
  std::vector<c10::IValue> cur_inputs;  // the running visible op's arguments (kept only while it runs)
  int64_t failed_index = -1;             // the innermost op that raised, and its arguments
  std::vector<c10::IValue> failed_inputs;
  std::string failed_overload;
  int64_t failed_name = -1, failed_phase = 0;
  // Past max_ops (a bounded trace): per-name counts and time, and a timeline of at most
  // kLightCap samples (each the largest of its bucket, buckets doubling when full).
  int64_t max_ops = 50000;
  std::unordered_map<int64_t, std::pair<int64_t, int64_t>> light_totals;
  std::vector<int64_t> light_tl;  // index, total, 5 category totals per sample
  int64_t light_stride = 1, light_in_bucket = 0;
  std::array<int64_t, 2 + kCategories> light_best{}, light_peak_rec{};  // index, total, category totals
  bool has_best = false;
  int64_t light_peak = -1;
  // inplace, 7 ints a write (as recorder/native_records.py reads them): op index, key, version, producer, tensor
  // offset, and for a write through a view its base's sizes: offset in `sizes` (-1: no view), ndim
  std::vector<int64_t> recs, tensors, sizes, inplace;
  std::vector<PyObject*> codes;
  std::vector<int64_t> lastis;
  // Interning, so that Python turns each distinct stack and tensor description into objects once (a
  // loop repeats the same ones): a stack seen before shares the frames of its first op (rec[10]); every
  // tensor record carries the id of its (dtype, device, requires_grad, sizes) in the meta table.
  std::unordered_map<std::vector<int64_t>, int64_t, VecHash> sites, metas;
  std::vector<int64_t> site_key, meta_key;
  std::vector<int64_t> meta_table, meta_sizes;  // per meta: dtype, device type, device index, rg, ndim, size offset
  std::vector<Open> open;
  std::unordered_map<const void*, OpInfo> infos;  // by (name pointer ^ overload pointer)
  std::vector<std::string> names;
  std::unordered_map<int64_t, Entry> live;        // storage key -> entry
  std::unordered_map<int64_t, int64_t> by_data;   // data pointer -> storage key
  std::unordered_map<PyObject*, bool> cell_codes;
  std::vector<std::string> roots;                 // name of each backward's first node
  int64_t totals[kCategories] = {0, 0, 0, 0, 0};
  std::vector<int64_t> storage_log;
  int64_t storage_dropped = 0;
  int64_t total = 0, count = 0, depth_bwd = 0, last_phase = 0;
  int64_t start_ns = 0, last_end_ns = 0;  // when recording started, when the latest op ended
  at::CallbackHandle handle = 0;
  // The CPU allocator is wrapped for the recording (CountingAllocator below): it counts the CPU blocks, and
  // the frees of recorded storages reach the ledger through it, not through torch's memory reports.
  bool wrapped = false;
};
State* S = nullptr;

// Net CPU bytes handed out since start on the threads that carry the recorder's thread-local state (sleeping
// or not): a training loop's live memory at each iteration's end, where the per-op ledger is off. Only blocks
// allocated since start count when freed (a block of an earlier cell collected now is not this run's memory).
// Outside the State: a block allocated by the recording may be freed on another thread, or after it ended.
struct RawCount {
  SpinLock lock;
  BlockTable blocks;
  std::atomic<int64_t> total{0};
  std::atomic<bool> on{false};
  // A recording starts (on) or ends (off): no block counted yet, or any more.
  void reset(bool counting) {
    std::lock_guard<SpinLock> guard(lock);
    on.store(counting, std::memory_order_release);
    blocks = BlockTable();
    total.store(0, std::memory_order_relaxed);
  }
};
RawCount& raw() {
  static RawCount* r = new RawCount();  // (never destroyed: a tensor may be freed at exit)
  return *r;
}

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

OpInfo& info_for(const at::RecordFunction& fn) {
  const void* key = reinterpret_cast<const void*>(
      reinterpret_cast<uintptr_t>(fn.name()) ^ (reinterpret_cast<uintptr_t>(fn.overload_name()) << 1));
  auto it = S->infos.find(key);
  if (it != S->infos.end()) return it->second;
  OpInfo info;
  auto opname = fn.operator_name();
  if (!opname) {
    // Not an operator: its name may be built per call (freed after), so it is never cached by address.
    static OpInfo transparent_info;
    transparent_info.transparent = true;
    return transparent_info;
  }
  {
    auto op = c10::Dispatcher::singleton().findOp(*opname);
    if (op) {
      info.composite = op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd);
      const auto& schema = op->schema();
      const auto& args = schema.arguments();
      for (size_t i = 0; i < args.size(); ++i) {
        const auto* alias = args[i].alias_info();
        if (alias && alias->isWrite() && !args[i].kwarg_only()) info.mutated.push_back((int)i);
      }
      if (info.mutated.empty())
        for (const auto& r : schema.returns()) info.view = info.view || r.alias_info() != nullptr;
      // Collectives and FSDP's all-gather buffer: what they return is filled by the peers, possibly after
      // the op returns (gloo's async work), and until then holds whatever bits the memory had.
      const std::string name = fn.name();
      info.keeps_finite = kKeepsFinite.count(name) > 0 || name.rfind("c10d::", 0) == 0 ||
                          name == "fsdp::all_gather_copy_in";
    }
  }
  info.name_id = (int64_t)S->names.size();
  S->names.emplace_back(fn.name());
  return S->infos.emplace(key, std::move(info)).first->second;
}

void log_storage(int64_t action, int64_t key, int64_t nbytes, int64_t cat, int64_t op) {
  if (S->storage_log.size() < kStorageLogCap * 5)
    S->storage_log.insert(S->storage_log.end(), {action, key, nbytes, cat, op});
  else
    ++S->storage_dropped;
}

void count_storage(int64_t key, int64_t nbytes, int cat, int64_t producer, int64_t data) {
  log_storage(1, key, nbytes, cat, producer);
  S->live.emplace(key, Entry{nbytes, cat, producer, data});
  if (data) S->by_data[data] = key;
  S->totals[cat] += nbytes;
  S->total += nbytes;
}

void uncount(int64_t key) {
  auto it = S->live.find(key);
  if (it == S->live.end()) return;
  S->nf_origin.erase(key);  // (a later storage may take the same address)
  log_storage(0, key, it->second.nbytes, it->second.cat, S->count);
  S->totals[it->second.cat] -= it->second.nbytes;
  S->total -= it->second.nbytes;
  // (the data pointer may be another storage's by now: the memory was freed unseen and handed out again)
  auto d = S->by_data.find(it->second.data);
  if (d != S->by_data.end() && d->second == key) S->by_data.erase(d);
  S->live.erase(it);
}

// A dense tensor's storage: sparse, nested and other non-strided tensors throw when asked for theirs.
inline bool plain_storage(const at::Tensor& t) {
  return t.layout() == c10::kStrided && !t.is_nested() && t.has_storage();
}

// An entry whose memory was never reported freed can outlive its storage: one allocated before the step,
// or freed on another thread (gloo's and DDP's threads drop the buffers of a collective; only the owner
// thread tells the ledger). A different data pointer or size at the same StorageImpl address is then a new
// storage: the old entry, and the NaN/Inf origin it carried, go. Returns whether t's storage is counted.
bool drop_stale(const at::Tensor& t, int64_t key) {
  auto it = S->live.find(key);
  if (it == S->live.end()) return false;
  const auto& st = t.storage();
  if (it->second.data == reinterpret_cast<int64_t>(st.data_ptr().get()) && it->second.nbytes == (int64_t)st.nbytes())
    return true;
  uncount(key);
  return false;
}

// Counts t's storage under cat (made by op producer, -1: before the step) unless it is counted
// already; returns its key (0: no storage).
int64_t note_storage(const at::Tensor& t, int cat, int64_t producer) {
  if (!plain_storage(t)) return 0;  // not counted
  const auto& st = t.storage();
  int64_t key = reinterpret_cast<int64_t>(st.unsafeGetStorageImpl());
  int64_t nbytes = (int64_t)st.nbytes();
  if (nbytes <= 0) return key;
  if (!drop_stale(t, key)) count_storage(key, nbytes, cat, producer, reinterpret_cast<int64_t>(st.data_ptr().get()));
  return key;
}

// One tensor: key, dtype, device type, device index, requires_grad, ndim, size offset, impl, meta id.
constexpr int kTensorWidth = 9;
constexpr int kMetaTableWidth = 6;

int64_t meta_id(const at::Tensor& t, bool rg) {
  auto sz = t.sizes();
  auto& key = S->meta_key;
  key.assign({(int64_t)t.scalar_type(), (int64_t)t.device().type(), (int64_t)t.device().index(), (int64_t)rg});
  key.insert(key.end(), sz.begin(), sz.end());
  auto it = S->metas.find(key);
  if (it != S->metas.end()) return it->second;
  int64_t id = (int64_t)S->meta_table.size() / kMetaTableWidth;
  S->meta_table.insert(S->meta_table.end(), {key[0], key[1], key[2], key[3], (int64_t)sz.size(),
                                             (int64_t)S->meta_sizes.size()});
  S->meta_sizes.insert(S->meta_sizes.end(), sz.begin(), sz.end());
  S->metas.emplace(key, id);
  return id;
}

// Records t. An input first seen here was made before the step and not registered from Python
// ("other"); an output is counted under cat as made by op index. inputs: first tensor record and
// count of this op's inputs (for an output: is it one of them).
void add_tensor(const at::Tensor& t, bool output, int64_t in_first, int64_t n_in, int cat, int64_t index) {
  int64_t impl = reinterpret_cast<int64_t>(t.unsafeGetTensorImpl());
  bool rg = t.requires_grad();
  if (output) {
    // Below autograd (where the Python mode looks) a fresh output does not require grad yet;
    // an in-place op returns its input, which may.
    bool same = false;
    for (int64_t j = in_first; j < in_first + n_in; ++j) same = same || S->tensors[j * kTensorWidth + 7] == impl;
    rg = same && rg;
  }
  int64_t key = output ? note_storage(t, cat, index) : note_storage(t, kOther, -1);
  auto sz = t.sizes();
  S->tensors.insert(S->tensors.end(), {key, (int64_t)t.scalar_type(), (int64_t)t.device().type(),
                                       (int64_t)t.device().index(), (int64_t)rg, (int64_t)sz.size(),
                                       (int64_t)S->sizes.size(), impl, meta_id(t, rg)});
  S->sizes.insert(S->sizes.end(), sz.begin(), sz.end());
}

template <typename F>
void for_tensors(c10::ArrayRef<const c10::IValue> vs, F&& f) {
  for (const auto& v : vs) {
    if (v.isTensor()) {
      const auto& t = v.toTensor();
      if (t.defined()) f(t);
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) if (t.defined()) f(t);
    } else if (v.isList()) {
      for (const c10::IValue& x : v.toListRef()) {
        if (x.isTensor() && x.toTensor().defined()) f(x.toTensor());
      }
    }
  }
}

void add_frames(int64_t* rec) {
  rec[10] = (int64_t)S->codes.size();
  rec[11] = 0;
  if (!S->frames_on || !Py_IsInitialized()) return;
  PyGILState_STATE g = PyGILState_Ensure();
  size_t first = S->codes.size();
  PyFrameObject* f = PyEval_GetFrame();
  Py_XINCREF(f);
  int n = 0;
  while (f && n < kMaxFrames) {
    PyCodeObject* code = PyFrame_GetCode(f);  // new reference: kept until stop()
    S->codes.push_back(reinterpret_cast<PyObject*>(code));
    S->lastis.push_back(PyFrame_GetLasti(f));
    ++n;
    auto it = S->cell_codes.find(reinterpret_cast<PyObject*>(code));
    bool is_cell;
    if (it == S->cell_codes.end()) {
      is_cell = PyUnicode_CompareWithASCIIString(code->co_filename, S->cell_file.c_str()) == 0;
      S->cell_codes.emplace(reinterpret_cast<PyObject*>(code), is_cell);
    } else {
      is_cell = it->second;
    }
    PyFrameObject* back = PyFrame_GetBack(f);
    Py_DECREF(f);
    f = back;
    if (is_cell) break;  // the cell's own frame is the last one the report needs
  }
  Py_XDECREF(f);
  rec[11] = n;
  // The same stack as an earlier op's (a loop, a layer called again): share that op's frames.
  auto& key = S->site_key;
  key.clear();
  for (size_t i = first; i < S->codes.size(); ++i) {
    key.push_back(reinterpret_cast<int64_t>(S->codes[i]));
    key.push_back(S->lastis[i]);
  }
  auto it = S->sites.find(key);
  if (it != S->sites.end()) {
    for (size_t i = first; i < S->codes.size(); ++i) Py_DECREF(S->codes[i]);  // the first op's hold them
    S->codes.resize(first);
    S->lastis.resize(first);
    rec[10] = it->second;
  } else {
    S->sites.emplace(key, (int64_t)first);
  }
  PyGILState_Release(g);
}

int nonfinite_scalar(const at::Tensor& t) {
  if (t.dim() != 0 || !t.device().is_cpu() || !plain_storage(t)) return 0;
  double v;
  switch (t.scalar_type()) {
    case at::kFloat: v = *t.const_data_ptr<float>(); break;
    case at::kDouble: v = *t.const_data_ptr<double>(); break;
    case at::kHalf: v = static_cast<float>(*t.const_data_ptr<at::Half>()); break;
    case at::kBFloat16: v = static_cast<float>(*t.const_data_ptr<at::BFloat16>()); break;
    default: return 0;
  }
  return std::isfinite(v) ? 0 : 1;
}

void start_op(const at::RecordFunction& fn, Open& o);

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  if (!S || std::this_thread::get_id() != S->owner) return nullptr;
  Open o;
  try {
    start_op(fn, o);
  } catch (...) {  // a tensor we cannot describe (nested, sparse...): the op is not recorded
    if (o.visible && !o.light) {
      if (o.rec >= 0) S->recs.resize(o.rec);
      S->count--;
    }
    S->cur_inputs.clear();
    o.visible = false;
  }
  o.uncaught = std::uncaught_exceptions();
  o.t0 = now_ns();
  if (o.visible && !o.light && o.rec >= 0) S->recs[o.rec + kStart] = o.t0 - S->start_ns;
  S->open.push_back(o);
  return nullptr;
}

void start_op(const at::RecordFunction& fn, Open& o) {
  if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION ||
      std::strncmp(fn.name(), "autograd::engine::evaluate_function", 35) == 0) {
    // An autograd node, or the engine's range around it (which also checks and reduces the
    // node's output gradients: backward work too).
    o.seq = fn.seqNr();
    o.name = fn.name();
    o.engine = fn.scope() != at::RecordScope::BACKWARD_FUNCTION;
    // The engine's range has no sequence number: it takes its node's, for the gradient checks and
    // reductions it runs after the node.
    if (!o.engine && !S->open.empty() && S->open.back().engine && S->open.back().seq < 0) {
      S->open.back().seq = o.seq;
    }
    S->depth_bwd++;
    return;
  }
  o.function = true;
  if (S->paused > 0) return;  // not visible, and not composite: nothing under it is visible either
  OpInfo& info = info_for(fn);
  o.composite = info.composite || info.transparent;
  bool visible = true;
  int64_t node_seq = -1;
  const char* node_name = nullptr;
  for (auto it = S->open.rbegin(); it != S->open.rend(); ++it) {
    if (!it->function) { node_seq = it->seq; node_name = it->name; break; }
    if (!it->composite) { visible = false; break; }
  }
  if (!visible || o.composite || info.transparent) return;
  o.visible = true;
  o.view = info.view;
  o.keeps_finite = info.keeps_finite;
  if (S->detail) o.mutated = info.mutated;
  int64_t index = o.index = S->count++;
  o.name_id = info.name_id;
  int64_t phase = o.phase = S->depth_bwd > 0 ? 1 : (S->optimizer_depth > 0 ? 2 : 0);
  if (phase == 1 && S->last_phase != 1)  // a new backward() call: its first node is the root
    S->roots.emplace_back(node_name ? node_name : "");
  S->last_phase = phase;
  // Its arguments stay referenced while it runs (they are alive anyway): if it raises, they are
  // the failing op's evidence (statistics, index values) for the report.
  auto args = fn.inputs();
  S->cur_inputs.assign(args.begin(), args.end());
  if (index >= S->max_ops) {  // past the bound: counted, not recorded (end_light)
    o.light = true;
    return;
  }
  {
    size_t at = S->recs.size();
    o.rec = (int64_t)at;
    S->recs.resize(at + kWidth, 0);
    int64_t* rec = &S->recs[at];
    rec[kStackId] = S->stack_id;
    rec[0] = index; rec[1] = info.name_id; rec[2] = phase; rec[3] = node_seq;
    rec[4] = (int64_t)at::sequence_number::peek(); rec[6] = at::GradMode::is_enabled();
    rec[7] = (int64_t)S->tensors.size() / kTensorWidth;
    int64_t n_in = 0;
    for_tensors(fn.inputs(), [&](const at::Tensor& t) {
      // A Python number passed where a tensor goes: the Python mode sees the number, not a tensor.
      if (t.unsafeGetTensorImpl()->is_wrapped_number()) return;
      add_tensor(t, false, 0, 0, kOther, index);
      ++n_in;
    });
    rec[8] = n_in;
    if (!info.mutated.empty() && phase == 0) {
      const auto& inputs = args;
      for (int i : info.mutated) {
        if (i < (int)inputs.size() && inputs[i].isTensor() && inputs[i].toTensor().defined()) {
          const auto& t = inputs[i].toTensor();
          int64_t key = plain_storage(t) ? reinterpret_cast<int64_t>(t.storage().unsafeGetStorageImpl()) : 0;
          auto it = S->live.find(key);
          int64_t pos = 0;  // tensors recorded before argument i
          for (int j = 0; j < i; ++j) {
            if (inputs[j].isTensor()) pos += inputs[j].toTensor().defined() &&
                                             !inputs[j].toTensor().unsafeGetTensorImpl()->is_wrapped_number();
            else if (inputs[j].isTensorList()) pos += (int64_t)inputs[j].toTensorList().size();
          }
          // An index assignment (`h[:, 0] = 0.0`) writes a view of `h`: same storage and version counter,
          // but PyTorch's error names the base's shape, so that is kept too (_base(): the root base).
          int64_t base_off = -1, base_ndim = 0;
          if (t.is_view()) {
            auto bs = t._base().sizes();
            base_off = (int64_t)S->sizes.size();
            base_ndim = (int64_t)bs.size();
            S->sizes.insert(S->sizes.end(), bs.begin(), bs.end());
          }
          S->inplace.insert(S->inplace.end(), {index, key, (int64_t)t._version() + 1,
                                               it == S->live.end() ? -1 : it->second.producer,
                                               rec[7] + pos, base_off, base_ndim});
        }
      }
    }
    add_frames(rec);
  }
}

void end_op(const at::RecordFunction& fn, const Open& o);

void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
  if (!S || std::this_thread::get_id() != S->owner || S->open.empty()) return;
  Open o = S->open.back();
  S->open.pop_back();
  if (!o.function) {
    S->depth_bwd--;
    return;
  }
  if (!o.visible) return;
  try {
    end_op(fn, o);
  } catch (...) {
  }
}

// The op that raised: the first op (innermost) whose range ends while an exception unwinds.
void note_failure(const at::RecordFunction& fn, const Open& o) {
  if (std::uncaught_exceptions() > o.uncaught && S->failed_index < 0) {
    S->failed_index = o.index;
    S->failed_inputs = std::move(S->cur_inputs);
    S->failed_overload = fn.overload_name();
    S->failed_name = o.name_id;
    S->failed_phase = o.phase;
  }
  S->cur_inputs.clear();
}

// ----------------------------------------------------------------- detail: where NaN/Inf is born
constexpr int kMaxEvents = 200, kMetaWidth = 7, kStatsWidth = 8, kEventWidth = 6;

// The doctor's own ops (screens, statistics): not recorded, not counted against a simulated device,
// outside autograd and outside any Python dispatch mode the user has on.
struct Quiet {
  at::RecordFunctionGuard no_callbacks{false};
  at::NoGradGuard no_grad;
  c10::impl::ExcludeDispatchKeyGuard no_python{
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot})};
  Quiet() { S->paused++; }
  ~Quiet() { S->paused--; }
};

inline bool has_data(const at::Tensor& t) {
  // (a tensor subclass, a fake or functional wrapper, may carry no readable data)
  return t.defined() && t.numel() > 0 && !t.device().is_meta() && plain_storage(t) &&
         !t.key_set().has(c10::DispatchKey::Python);
}

// One reduction screens a tensor (NaN/Inf anywhere makes the sum non-finite); only then the exact
// element-wise check (a sum can also overflow), as stats.screen_nonfinite does.
// NaN/Inf anywhere in n IEEE values: some value's exponent bits are all ones (integer work only, so the
// loop vectorises and stops nothing; no op dispatched, nothing allocated).
// A large tensor is read on torch's intra-op threads, as the user's own kernels are (a single-threaded
// screen would cost a multi-threaded step relatively more).
template <typename U>
bool any_nonfinite_bits(const void* data, int64_t n, U exponent) {
  const U* p = static_cast<const U*>(data);
  auto scan = [p, exponent](int64_t a, int64_t b) {
    U hit = 0;
    for (int64_t i = a; i < b; ++i) hit |= static_cast<U>((p[i] & exponent) == exponent);
    return hit != 0;
  };
  if (n < (int64_t(1) << 18) || at::get_num_threads() == 1 || at::in_parallel_region()) return scan(0, n);
  std::atomic<bool> found{false};
  at::parallel_for(0, n, int64_t(1) << 16, [&](int64_t a, int64_t b) {
    if (scan(a, b)) found.store(true, std::memory_order_relaxed);
  });
  return found.load();
}

bool nonfinite(const at::Tensor& t) {
  if (!t.is_floating_point() || !has_data(t)) return false;
  if (t.device().is_cpu() && t.is_contiguous()) {  // the common case, read in place
    const void* d = t.const_data_ptr();
    int64_t n = t.numel();
    switch (t.scalar_type()) {
      case at::kFloat: return any_nonfinite_bits<uint32_t>(d, n, 0x7F800000u);
      case at::kDouble: return any_nonfinite_bits<uint64_t>(d, n, 0x7FF0000000000000ull);
      case at::kHalf: return any_nonfinite_bits<uint16_t>(d, n, 0x7C00u);
      case at::kBFloat16: return any_nonfinite_bits<uint16_t>(d, n, 0x7F80u);
      default: break;
    }
  }
  Quiet q;
  bool low = t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16;
  double sum = (low ? t.sum(at::kFloat) : t.sum()).item<double>();
  if (std::isfinite(sum)) return false;
  return !at::isfinite(t).all().item<bool>();
}

// min/max/mean over finite values and NaN/+Inf/-Inf counts (stats.tensor_stats); -1 when unreadable.
int64_t add_stats(const at::Tensor& t) {
  if (!has_data(t)) return -1;
  Quiet q;
  at::Tensor x = t.detach();
  if (x.is_complex()) x = x.abs();
  if (x.scalar_type() == at::kBool) x = x.to(at::kByte);
  double numel = (double)x.numel(), nan = 0, pinf = 0, ninf = 0;
  at::Tensor finite = x;
  if (x.is_floating_point()) {
    at::Tensor mask = at::isfinite(x);
    double n_finite = (double)mask.sum().item<int64_t>();
    if (n_finite != numel) {
      nan = (double)at::isnan(x).sum().item<int64_t>();
      pinf = (double)x.eq(std::numeric_limits<double>::infinity()).sum().item<int64_t>();
      ninf = numel - n_finite - nan - pinf;
      finite = x.masked_select(mask);
    }
  }
  int64_t at_ = (int64_t)S->ev_stats.size();
  double lo = 0, hi = 0, mean = 0, any = finite.numel() > 0;
  if (any) {
    auto mm = at::aminmax(finite);
    lo = std::get<0>(mm).item<double>();
    hi = std::get<1>(mm).item<double>();
    mean = finite.to(at::kDouble).mean().item<double>();
  }
  S->ev_stats.insert(S->ev_stats.end(), {numel, nan, pinf, ninf, any, lo, hi, mean});
  return at_;
}

void add_meta(const at::Tensor& t, bool with_stats) {
  auto sz = t.sizes();
  int64_t stats = with_stats ? add_stats(t) : -1;
  S->ev_metas.insert(S->ev_metas.end(), {(int64_t)t.scalar_type(), (int64_t)t.device().type(),
                                         (int64_t)t.device().index(), (int64_t)t.requires_grad(),
                                         (int64_t)sz.size(), (int64_t)S->ev_sizes.size(), stats});
  S->ev_sizes.insert(S->ev_sizes.end(), sz.begin(), sz.end());
}

inline int64_t key_of(const at::Tensor& t) {
  return plain_storage(t) ? reinterpret_cast<int64_t>(t.storage().unsafeGetStorageImpl()) : 0;
}

// The first output of op `o` that holds NaN/Inf becomes an event: made here (an origin), carried
// from an input that had it, or (an origin whose inputs were already bad) bad data or weights.
void screen(const at::RecordFunction& fn, const Open& o) {
  std::vector<at::Tensor> ins;
  for_tensors(c10::ArrayRef<const c10::IValue>(S->cur_inputs.data(), S->cur_inputs.size()), [&](const at::Tensor& t) {
    if (!t.unsafeGetTensorImpl()->is_wrapped_number()) ins.push_back(t);
  });
  if (o.keeps_finite) {  // finite in, finite out: nothing to screen unless NaN/Inf came in
    bool carried = false;
    for (const auto& t : ins) carried = carried || S->nf_origin.count(key_of(t)) > 0;
    if (!carried) return;
  }
  std::vector<at::Tensor> outs;
  const auto& fo = fn.outputs();
  for_tensors(c10::ArrayRef<const c10::IValue>(fo.data(), fo.size()), [&](const at::Tensor& t) { outs.push_back(t); });
  if (outs.empty())  // in place, returning nothing (`_foreach_mul_`, `_fused_adamw_`): what it wrote into
    for (int i : o.mutated)
      if (i < (int)S->cur_inputs.size())
        for_tensors(c10::ArrayRef<const c10::IValue>(&S->cur_inputs[i], 1), [&](const at::Tensor& t) { outs.push_back(t); });
  // The first NaN/Inf output is the event; every one carries its origin on (a list of parameters that one
  // fused step wrote: the next iteration reads them).
  const at::Tensor* first = nullptr;
  int64_t origin = -1, kind = 0, variable = 0;
  for (const auto& out : outs) {
    if (!nonfinite(out)) continue;
    if (first == nullptr) {
      first = &out;
      for (const auto& t : ins) {
        auto it = S->nf_origin.find(key_of(t));
        if (it != S->nf_origin.end()) { origin = it->second; break; }
      }
      if (origin < 0) {
        std::vector<int64_t> written;  // what the op writes into is not "bad input"
        for (int i : o.mutated)
          if (i < (int)S->cur_inputs.size())
            for_tensors(c10::ArrayRef<const c10::IValue>(&S->cur_inputs[i], 1),
                        [&](const at::Tensor& t) { written.push_back(key_of(t)); });
        for (const auto& t : ins) {
          int64_t k = key_of(t);
          if (std::find(written.begin(), written.end(), k) != written.end() || !nonfinite(t)) continue;
          auto it = S->live.find(k);
          kind = it != S->live.end() && it->second.cat == 0 ? 2 : 1;  // NaN weights are an earlier step's doing
          variable = k;
          break;
        }
        origin = o.index;
      }
    }
    int64_t k = key_of(out);
    if (!k) continue;
    // (a stale entry at this address is dropped now, not by note_storage after the origin is written: that
    // would drop the origin with it, and the next op would take the NaN/Inf for its own input's)
    drop_stale(out, k);
    S->nf_origin[k] = origin;
  }
  if (first == nullptr) return;
  S->nf_by_index.emplace(o.index, origin);
  if (origin != o.index && (int64_t)S->events.size() >= kMaxEvents * kEventWidth) return;
  bool stats = origin == o.index && S->detail_budget > 0;  // statistics for the first origins only
  S->detail_budget -= stats;
  S->events.insert(S->events.end(), {o.index, origin, kind, variable,
                                     (int64_t)S->ev_metas.size() / kMetaWidth, (int64_t)(1 + ins.size())});
  add_meta(*first, stats);
  for (const auto& t : ins) add_meta(t, stats);
}

// What an op's new outputs count as (see _record.py): forward with grad on and an input that
// requires grad: activations; optimizer step: optimizer state; else other.
int category(int64_t phase, bool activations) {
  return phase == 2 ? kOptimizerCat : (phase == 0 && activations ? kActivations : kOther);
}

// Detail: screen the op's outputs while its inputs are still at hand (before note_failure drops them).
inline void maybe_screen(const at::RecordFunction& fn, const Open& o) {
  if (!S->detail || o.view || std::uncaught_exceptions() > o.uncaught) return;
  try {
    screen(fn, o);
  } catch (...) {  // evidence, never a reason to fail the user's step
  }
}

void end_light(const at::RecordFunction& fn, const Open& o) {
  maybe_screen(fn, o);
  bool rg = false;
  if (o.phase == 0 && at::GradMode::is_enabled())
    for (const auto& v : S->cur_inputs) rg = rg || (v.isTensor() && v.toTensor().defined() && v.toTensor().requires_grad());
  note_failure(fn, o);
  int cat = category(o.phase, rg);
  for (const auto& v : fn.outputs())
    if (v.isTensor() && v.toTensor().defined()) note_storage(v.toTensor(), cat, o.index);
  auto& tot = S->light_totals[o.name_id];
  tot.first += 1;
  tot.second += now_ns() - o.t0;
  std::array<int64_t, 2 + kCategories> sample{o.index, S->total};
  std::copy(S->totals, S->totals + kCategories, sample.begin() + 2);
  if (S->total > S->light_peak) { S->light_peak = S->total; S->light_peak_rec = sample; }
  if (!S->has_best || S->total >= S->light_best[1]) { S->light_best = sample; S->has_best = true; }
  if (++S->light_in_bucket >= S->light_stride) {
    S->light_tl.insert(S->light_tl.end(), S->light_best.begin(), S->light_best.end());
    S->has_best = false;
    S->light_in_bucket = 0;
    constexpr size_t kLightCap = 8192, kSample = 2 + kCategories;
    if (S->light_tl.size() >= kLightCap * kSample) {  // halve: keep the larger of each pair
      std::vector<int64_t> kept;
      for (size_t i = 0; i < S->light_tl.size(); i += 2 * kSample) {
        size_t best = i;
        if (i + kSample < S->light_tl.size() && S->light_tl[i + kSample + 1] > S->light_tl[i + 1]) best = i + kSample;
        kept.insert(kept.end(), S->light_tl.begin() + best, S->light_tl.begin() + best + kSample);
      }
      S->light_tl.swap(kept);
      S->light_stride *= 2;
    }
  }
}

void end_op(const at::RecordFunction& fn, const Open& o) {
  S->last_end_ns = now_ns();
  if (o.light) return end_light(fn, o);
  int64_t t_end = now_ns();
  maybe_screen(fn, o);
  int64_t* rec = &S->recs[o.rec];
  note_failure(fn, o);
  rec[kDuration] = t_end - o.t0;
  rec[5] = (int64_t)at::sequence_number::peek();
  int phase = (int)rec[2];
  bool rg = false;
  for (int64_t j = 0; j < rec[8]; ++j) rg = rg || S->tensors[(rec[7] + j) * kTensorWidth + 4];
  int cat = category(phase, rec[6] && rg);
  const auto& outs = fn.outputs();
  int64_t n_out = 0;
  // Outputs follow this op's inputs unless nested ops added tensors in between: then copy the inputs
  // after them, so each op's tensors stay contiguous.
  if ((int64_t)S->tensors.size() / kTensorWidth != rec[7] + rec[8]) {
    int64_t first = rec[7];
    rec[7] = (int64_t)S->tensors.size() / kTensorWidth;
    for (int64_t j = 0; j < rec[8]; ++j)
      for (int k = 0; k < kTensorWidth; ++k) S->tensors.push_back(S->tensors[(first + j) * kTensorWidth + k]);
  }
  bool first_out = true;
  for (const auto& v : outs) {
    auto add = [&](const at::Tensor& t) {
      add_tensor(t, true, rec[7], rec[8], cat, rec[0]);
      ++n_out;
      if (first_out && phase == 0) rec[kNonfiniteScalar] = nonfinite_scalar(t);
      first_out = false;
    };
    if (v.isTensor()) {
      if (v.toTensor().defined()) add(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) if (t.defined()) add(t);
    }
  }
  rec[9] = n_out;
  rec[12] = S->total;
  for (int c = 0; c < kCategories; ++c) rec[13 + c] = S->totals[c];
}

// The allocator reports frees to whatever object holds the PROFILER_STATE debug-info slot, and
// PyTorch reads that slot as a ProfilerStateBase (profilerEnabled(), getProfilerConfig(): custom
// autograd Functions ask it on every apply). So the reporter must be one: a profiler state whose
// config says "disabled", which PyTorch then treats as no profiler at all. (A plain
// MemoryReportingInfoBase there was read as a profiler config from memory past its end: garbage
// that raised std::bad_alloc inside the user's step.)
// Bytes for people, as units.format_bytes writes them ("1.5 KiB").
std::string human(int64_t n) {
  const char* units[] = {"B", "KiB", "MiB", "GiB"};
  double v = (double)std::llabs(n);
  int u = 0;
  while (v >= 1024 && u < 3) { v /= 1024; ++u; }
  char buf[64];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%s%.0f %s" : "%s%.1f %s", n < 0 ? "-" : "", v, units[u]);
  return buf;
}

// The memory at `ptr` was freed: the recorded storage it held, if any, leaves the ledger (owner thread only).
void forget_data(void* ptr) {
  auto it = S->by_data.find(reinterpret_cast<int64_t>(ptr));
  if (it != S->by_data.end()) uncount(it->second);
}

void count_raw(void* ptr, int64_t size) {
  RawCount& r = raw();
  if (!r.on.load(std::memory_order_acquire)) return;
  std::lock_guard<SpinLock> guard(r.lock);
  if (size > 0) {
    r.blocks.insert(ptr, size);
    r.total.fetch_add(size, std::memory_order_relaxed);
    return;
  }
  r.total.fetch_sub(r.blocks.erase(ptr), std::memory_order_relaxed);
}

struct Reporter : public torch::profiler::impl::ProfilerStateBase {
  Reporter() : ProfilerStateBase(torch::profiler::impl::ProfilerConfig(torch::profiler::impl::ProfilerState::Disabled)) {}
  void reportMemoryUsage(void* ptr, int64_t size, size_t, size_t, c10::Device device) override {
    if (!S || size == 0) return;
    if (device.is_cpu() && !S->wrapped) count_raw(ptr, size);
    if (std::this_thread::get_id() != S->owner) return;
    if (size < 0) {
      if (!S->wrapped) forget_data(ptr);  // (wrapped: counted_delete tells the ledger)
      return;
    }
    if (S->limit >= 0 && S->paused == 0 && !S->oom && S->total + size > S->limit) simulated_oom(ptr, size);
  }

  // The simulated device is full: remember the moment (for the report), give the memory back (the
  // caller never sees it) and fail this allocation as a real device would.
  [[noreturn]] static void simulated_oom(void* ptr, int64_t size) {
    const Open* running = nullptr;
    for (auto it = S->open.rbegin(); it != S->open.rend(); ++it)
      if (it->visible) { running = &*it; break; }
    S->oom = true;
    S->oom_index = running ? running->index : S->count;
    S->oom_requested = size;
    // As the Python tier counts it: live bytes with the allocation that did not fit, under the category
    // the op's output would have had.
    S->oom_live = S->total + size;
    std::copy(S->totals, S->totals + kCategories, S->oom_totals.begin());
    bool rg = false;
    if (running && running->phase == 0 && at::GradMode::is_enabled())
      for (const auto& v : S->cur_inputs) rg = rg || (v.isTensor() && v.toTensor().defined() && v.toTensor().requires_grad());
    S->oom_totals[category(running ? running->phase : 0, rg)] += size;
    for (const auto& kv : S->live) S->oom_by_producer[kv.second.producer] += kv.second.nbytes;
    S->oom_by_producer[S->oom_index] += size;
    std::string op = running && running->name_id >= 0 ? S->names[running->name_id] : std::string("an op");
    int64_t free_bytes = std::max<int64_t>(0, S->limit - S->total);
    c10::free_cpu(ptr);
    TORCH_CHECK_WITH(OutOfMemoryError, false, "Simulated device out of memory (backward_doctor memory_limit=",
                     human(S->limit), "). Tried to allocate ", human(size), " in ", op, "; ", human(S->total),
                     " already live, ", human(free_bytes), " free.");
  }
  // With the CPU allocator wrapped, torch's own reports are not needed (the wrapper counts, at a fraction of
  // their cost: a mutex and a node-based map in torch at every allocation and free) except for the simulated
  // device's limit, which fails the allocation inside the op.
  bool memoryProfilingEnabled() const override { return S != nullptr && (!S->wrapped || S->limit >= 0); }
  torch::profiler::impl::ActiveProfilerType profilerType() override {
    return torch::profiler::impl::ActiveProfilerType::NONE;
  }
};

}  // namespace

// ---------------------------------------------------------------- the CPU allocator, wrapped
// While a recording runs, c10's CPU allocator (whichever is installed, the default one mostly) is wrapped: the
// same memory from the same allocator (it is called for every block), and the blocks handed to a thread that
// carries the recorder's thread-local state counted in RawCount, with a deleter that uncounts them (and tells the
// ledger a recorded storage's memory is gone) before the allocator's own deleter frees them. torch's memory
// reports (a mutex and a node-based map at each allocation and free, then the reporter) were two thirds of what
// the allocations of a small CPU loop cost always on an iteration (callgrind: ~13k instructions and ~600
// instruction-cache misses an iteration of 213 us). Not wrapped where another allocator holds a higher priority,
// where the installed one's deleter is not the one the blocks counted earlier free through, or with CUDA (the
// reports also tell the ledger of device frees): the reports count then, as before.
c10::DeleterFnPtr g_inner_delete = nullptr;      // what every counted block is freed through in the end
std::atomic<const void*> g_carrier{nullptr};     // the running recording's reporter (the thread-local mark)
std::atomic<std::thread::id> g_owner{std::thread::id()};

void counted_delete(void* ptr) {
  count_raw(ptr, -1);
  // (the owner thread alone touches S, and only it ends the recording: no other thread reads S here)
  if (std::this_thread::get_id() == g_owner.load(std::memory_order_relaxed) && S != nullptr && S->wrapped)
    forget_data(ptr);
  g_inner_delete(ptr);
}

struct CountingAllocator final : public c10::Allocator {
  c10::Allocator* inner = nullptr;
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr dp = inner->allocate(n);
    const void* carrier = g_carrier.load(std::memory_order_relaxed);
    if (carrier != nullptr && n > 0 && dp.get() != nullptr && dp.get() == dp.get_context() &&
        c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE) == carrier &&
        dp.compare_exchange_deleter(g_inner_delete, &counted_delete))
      count_raw(dp.get(), static_cast<int64_t>(n));
    return dp;
  }
  // (a block from raw_allocate is freed through raw_deleter: counted_delete passes any block on, counted or not)
  c10::DeleterFnPtr raw_deleter() const override { return &counted_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { inner->copy_data(dest, src, count); }
};

CountingAllocator& counting() {
  static CountingAllocator* a = new CountingAllocator();  // (never destroyed: blocks keep pointing at it)
  return *a;
}

bool wrap_cpu_allocator() {
  c10::Allocator* current = c10::GetCPUAllocator();
  CountingAllocator& ours = counting();
  if (current == &ours) return true;
  if (at::globalContext().hasCUDA()) return false;
  c10::DeleterFnPtr d = current == nullptr ? nullptr : current->raw_deleter();
  if (d == nullptr || (g_inner_delete != nullptr && d != g_inner_delete)) return false;
  ours.inner = current;
  g_inner_delete = d;
  c10::SetCPUAllocator(&ours, 0);  // (refused where a higher priority holds: then not wrapped)
  return c10::GetCPUAllocator() == &ours;
}

// Whether c10's CPU allocator is the recording's wrapper now (tests: wrapped while recording, put back after).
bool cpu_allocator_wrapped() { return c10::GetCPUAllocator() == &counting(); }

void unwrap_cpu_allocator() {
  CountingAllocator& ours = counting();
  if (c10::GetCPUAllocator() == &ours) c10::SetCPUAllocator(ours.inner, 0);
}

// The op observer: a thread-local RecordFunction callback. Added at start and when a loop's iteration is
// recorded again, removed while the recorder sleeps: a callback that is merely disabled still sits in the
// thread's list, and every change of thread-local state (autograd's engine sets it for each backward)
// rebuilds that list's scopes: ~5k instructions an iteration of a small loop, for nothing.
void add_observer() {
  S->handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback(on_start, on_end)
          .needsInputs(true)
          .needsOutputs(true)
          .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
}

void start(const std::string& cell_file, bool frames, int64_t max_ops, int64_t limit, bool detail) {
  TORCH_CHECK(S == nullptr, "backward_doctor: the native recorder is already running");
  S = new State();
  S->max_ops = max_ops;
  S->limit = limit;
  S->detail = detail;
  S->start_ns = S->last_end_ns = now_ns();
  S->owner = std::this_thread::get_id();
  S->cell_file = cell_file;
  S->frames_on = frames;
  S->recs.reserve(1 << 14);
  S->tensors.reserve(1 << 15);
  S->reporter = std::make_shared<Reporter>();
  raw().reset(true);
  g_owner.store(S->owner, std::memory_order_relaxed);
  S->wrapped = wrap_cpu_allocator();
  if (S->wrapped) g_carrier.store(S->reporter.get(), std::memory_order_release);
  c10::ThreadLocalDebugInfo::_push(c10::DebugInfoKind::PROFILER_STATE, S->reporter);
  S->reporting = true;
  // The CPU allocator logs a warning for memory it cannot size (allocated before we started):
  // not the user's concern. Warnings are switched off while recording, restored in stop().
  S->saved_log_level = FLAGS_caffe2_log_level;
  FLAGS_caffe2_log_level = std::max(FLAGS_caffe2_log_level, 2);
  add_observer();
}

bool running() { return S != nullptr; }

// The CPU generator's state at an iteration's start, for replaying that iteration (iteration_replay.py):
// copied in C++ (2.5 KB, no tensor allocated, nothing the live-memory count or the recorder would see),
// handed to Python as bytes only when it is kept.
struct RngMark {
  at::mt19937 engine;
  std::optional<float> next_float;
  std::optional<double> next_double;
};
RngMark rng_mark;
bool rng_marked = false;

void mark_rng() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  auto* impl = at::check_generator<at::CPUGeneratorImpl>(gen);
  rng_mark = {impl->engine(), impl->next_float_normal_sample(), impl->next_double_normal_sample()};
  rng_marked = true;
}

py::object marked_rng() {
  if (!rng_marked) return py::none();
  return py::bytes(reinterpret_cast<const char*>(&rng_mark), sizeof(RngMark));
}

void restore_rng(const py::bytes& state) {
  std::string raw = state;
  TORCH_CHECK(raw.size() == sizeof(RngMark), "backward_doctor: not a marked RNG state");
  RngMark mark;
  std::memcpy(reinterpret_cast<void*>(&mark), raw.data(), sizeof(RngMark));
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  auto* impl = at::check_generator<at::CPUGeneratorImpl>(gen);
  impl->set_engine(mark.engine);
  impl->set_next_float_normal_sample(mark.next_float);
  impl->set_next_double_normal_sample(mark.next_double);
}

int64_t allocated() { return S ? raw().total.load(std::memory_order_relaxed) : 0; }

// A loop's per-iteration watch reads values without dispatching an op (nothing observed, nothing
// allocated, no kernel the plain step would not run): CPU floating tensors read in place only.
template <typename T>
double as_double(const T& v) { return static_cast<double>(static_cast<float>(v)); }
template <>
double as_double<double>(const double& v) { return v; }

bool readable(const at::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.is_floating_point() && plain_storage(t) &&
         !t.key_set().has(c10::DispatchKey::Python) && t.is_contiguous();
}

// Calls ``f(data, n)`` with a tensor's values in their own type, read in place (a readable tensor of one of the
// four floating dtypes); false, ``f`` not called, for any other.
template <typename F>
bool read_floats(const at::Tensor& t, F&& f) {
  if (!readable(t)) return false;
  const void* d = t.const_data_ptr();
  const int64_t n = t.numel();
  switch (t.scalar_type()) {
    case at::kFloat: f(static_cast<const float*>(d), n); return true;
    case at::kDouble: f(static_cast<const double*>(d), n); return true;
    case at::kHalf: f(static_cast<const at::Half*>(d), n); return true;
    case at::kBFloat16: f(static_cast<const at::BFloat16*>(d), n); return true;
    default: return false;
  }
}

// The value of a one-element CPU floating tensor (the loss); None when it cannot be read in place.
py::object scalar_value(const at::Tensor& t) {
  double v = 0;
  if (t.numel() != 1 || !read_floats(t, [&v](const auto* p, int64_t) { v = as_double(*p); })) return py::none();
  return py::float_(v);
}

template <typename T>
double sumsq(const T* p, int64_t n) {
  // Eight independent double accumulators: the compiler may vectorise them (one chain of dependent adds
  // ran at an add's latency per element: 4 us for a small MLP's gradients, every iteration).
  auto part = [p](int64_t a, int64_t b) {
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = a;
    for (; i + 8 <= b; i += 8)
      for (int j = 0; j < 8; ++j) { double v = as_double(p[i + j]); acc[j] += v * v; }
    double total = 0;
    for (; i < b; ++i) { double v = as_double(p[i]); total += v * v; }
    for (double v : acc) total += v;
    return total;
  };
  if (n < (int64_t(1) << 18) || at::get_num_threads() == 1 || at::in_parallel_region()) return part(0, n);
  int64_t chunks = (n + (int64_t(1) << 16) - 1) >> 16;
  std::vector<double> parts(chunks, 0.0);
  at::parallel_for(0, chunks, 1, [&](int64_t a, int64_t b) {
    for (int64_t c = a; c < b; ++c) parts[c] = part(c << 16, std::min(n, (c + 1) << 16));
  });
  double acc = 0;
  for (double v : parts) acc += v;
  return acc;
}

// Adds one gradient's sum of squares to ``acc``; false when it cannot be read in place (not CPU, not
// contiguous, a subclass, an unsupported dtype). An undefined or empty gradient adds nothing.
bool add_sumsq(const at::Tensor& g, double& acc) {
  if (!g.defined() || g.numel() == 0) return true;
  return read_floats(g, [&acc](const auto* p, int64_t n) { acc += sumsq(p, n); });
}

template <typename T>
bool any_nonzero(const T* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (as_double(d[i]) != 0.0) return true;  // (NaN too, as torch's any() says)
  return false;
}

// Whether each tensor holds a value other than zero, the scan ending at the first one: a cell's start asks it of
// every gradient an earlier step consumed (context._any_each: zeroed since, or stale), and torch's any() reads
// each one whole (T5 tiny: 0.6 ms a cell; a model of 50M parameters, 200 MB) where a gradient's first element
// mostly answers. None for one not read in place (another device, layout or dtype): the caller asks torch.
py::list nonzero_each(const std::vector<at::Tensor>& ts) {
  py::list out;
  for (const auto& t : ts) {
    bool found = false;
    if (read_floats(t, [&found](const auto* p, int64_t n) { found = any_nonzero(p, n); }))
      out.append(py::bool_(found));
    else
      out.append(py::none());
  }
  return out;
}

// Sum of squares over the gradients (their global L2 norm squared; NaN/Inf in any makes it non-finite);
// None when one cannot be read in place.
py::object grad_sumsq(const std::vector<at::Tensor>& grads) {
  double acc = 0;
  for (const auto& g : grads)
    if (!add_sumsq(g, acc)) return py::none();
  return py::float_(acc);
}

// The same over the gradients of an optimizer's parameter groups (``opt.param_groups``: dicts whose
// "params" are tensors), the parameters walked here, not in Python: a loop pays this at every step, and
// the Python comprehension cost 2-10 us for four parameters and grows with every parameter. A parameter
// that is no leaf (and retains no gradient) has none, as ``grad_of`` says.
py::object groups_grad_sumsq(const py::list& groups) {
  double acc = 0;
  for (const auto& group : groups) {
    if (!PyDict_Check(group.ptr())) return py::none();
    PyObject* params = PyDict_GetItemString(group.ptr(), "params");  // (borrowed)
    if (params == nullptr || !PyList_Check(params)) return py::none();
    for (Py_ssize_t i = 0, n = PyList_GET_SIZE(params); i < n; ++i) {
      PyObject* obj = PyList_GET_ITEM(params, i);
      if (!THPVariable_Check(obj)) return py::none();
      const at::Tensor& p = THPVariable_Unpack(obj);
      if ((p.is_leaf() || p.retains_grad()) && !add_sumsq(p.grad(), acc)) return py::none();
    }
  }
  return py::float_(acc);
}

// ---------------------------------------------------------------- a loop's per-iteration watch
// capture/loop/series.py's LoopWatch for this tier: the same reads, the same numbers written into the same
// ``Iterations`` object (its lists appended to in place, as the Python class does), at every iteration of a loop,
// asleep or recorded. Its three calls were ~200 Python bytecodes an iteration in Python, about a third of what
// always on adds to an iteration it sleeps through; here they are plain C functions (``bound()``: no pybind11
// dispatch, attribute names interned once). The Python class is the definition (and the Python tier's watch);
// tests/test_native_loop_watch.py holds the two to the same record, call for call.
constexpr Py_ssize_t kMaxPoints = 4096;  // loop_watch._MAX_POINTS

struct Names {
  PyObject *steps, *stride, *loss, *grad_norm, *lr, *live_bytes, *backwards, *param_groups, *base_lr,
      *first_nonfinite, *first_nonfinite_in, *initial_lr, *get, *append;
};
const Names& names() {  // (made under the GIL, the first time a LoopSeries is; never freed: a few strings)
  static const Names n = {
      PyUnicode_InternFromString("steps"), PyUnicode_InternFromString("stride"),
      PyUnicode_InternFromString("loss"), PyUnicode_InternFromString("grad_norm"),
      PyUnicode_InternFromString("lr"), PyUnicode_InternFromString("live_bytes"),
      PyUnicode_InternFromString("backwards"), PyUnicode_InternFromString("param_groups"),
      PyUnicode_InternFromString("base_lr"), PyUnicode_InternFromString("first_nonfinite"),
      PyUnicode_InternFromString("first_nonfinite_in"), PyUnicode_InternFromString("initial_lr"),
      PyUnicode_InternFromString("get"), PyUnicode_InternFromString("append")};
  return n;
}

py::object get_attr(PyObject* o, PyObject* name) {
  PyObject* r = PyObject_GetAttr(o, name);
  if (r == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(r);
}

void set_attr(PyObject* o, PyObject* name, PyObject* v) {
  if (PyObject_SetAttr(o, name, v) < 0) throw py::error_already_set();
}

class LoopSeries {
 public:
  // its: the Iterations; live_base: bytes the ledger had at the start (live = that + allocated());
  // on_nonfinite_ref(): the callback on_nonfinite(iteration, what), or None once it is gone (a weak reference:
  // this object is no container Python's garbage collector sees into, so a strong one to the capture that owns
  // it would keep both alive for good); fallback_sumsq(groups): the Python reading for param_groups that are no
  // list
  LoopSeries(py::object its, int64_t live_base, py::object on_nonfinite_ref, py::object fallback_sumsq)
      : its(std::move(its)), on_nonfinite_ref_(std::move(on_nonfinite_ref)), fallback_(std::move(fallback_sumsq)),
        live_base_(live_base), n_(names()) {}

  // backward() was called on `loss` (a one-element CPU floating tensor is read as the loss)
  void saw_backward(PyObject* loss) {
    ++backwards_;
    ++backward_calls;
    if (!THPVariable_Check(loss)) return;
    py::object value = scalar_value(THPVariable_Unpack(loss));
    if (value.is_none()) return;
    if (std::isfinite(PyFloat_AS_DOUBLE(value.ptr()))) {
      loss_ = std::move(value);
      return;
    }
    loss_ = py::none();
    if (bad_ == nullptr) {
      bad_ = "loss";
      first(bad_);
    }
  }

  // the outermost optimizer.step() is about to run: its learning rate, its gradients' norm
  void before_step(PyObject* opt) {
    py::object groups = get_attr(opt, n_.param_groups);
    int nonempty = PyObject_IsTrue(groups.ptr());
    if (nonempty < 0) throw py::error_already_set();
    py::object group = nonempty ? py::object(groups[py::int_(0)]) : py::object(py::dict());
    py::object lr = get(group, n_.lr, py::none());
    lr_ = as_float(lr);
    PyObject* its_ = its.ptr();
    if (get_attr(its_, n_.base_lr).is_none()) set_attr(its_, n_.base_lr, as_float(get(group, n_.initial_lr, lr)).ptr());
    py::object ss = PyList_CheckExact(groups.ptr()) ? groups_grad_sumsq(py::reinterpret_borrow<py::list>(groups))
                                                   : fallback_(groups);
    if (!ss.is_none()) {
      double v = ss.cast<double>();
      if (std::isfinite(v))
        norm_ = py::float_(std::sqrt(v));
      else if (bad_ == nullptr)
        bad_ = "gradients";
    }
    if (bad_ != nullptr) first(bad_);
  }

  // iteration its.steps ended (before it is counted): its numbers join the series, every `stride`-th
  void iteration_ended() {
    PyObject* its_ = its.ptr();
    const int64_t steps = get_attr(its_, n_.steps).cast<int64_t>(), stride = get_attr(its_, n_.stride).cast<int64_t>();
    if (steps % stride == 0) {
      py::object series[5] = {get_attr(its_, n_.loss), get_attr(its_, n_.grad_norm), get_attr(its_, n_.lr),
                              get_attr(its_, n_.live_bytes), get_attr(its_, n_.backwards)};
      append(series[0], loss_);
      append(series[1], norm_);
      append(series[2], lr_);
      append(series[3], py::int_(live_base_ + allocated()));
      append(series[4], py::int_(backwards_));
      if (PyObject_Size(series[0].ptr()) > kMaxPoints) {
        py::slice odd(1, PY_SSIZE_T_MAX, 2);
        for (auto& one : series)
          if (PyObject_DelItem(one.ptr(), odd.ptr()) < 0) throw py::error_already_set();
        set_attr(its_, n_.stride, py::int_(stride * 2).ptr());
      }
    }
    loss_ = norm_ = lr_ = py::none();
    bad_ = nullptr;
    backwards_ = 0;
  }

  py::object its;
  int64_t backward_calls = 0;  // all of the run's

 private:
  // The first NaN/Inf of the run: its iteration and where it showed, once.
  void first(const char* what) {
    PyObject* its_ = its.ptr();
    if (!get_attr(its_, n_.first_nonfinite).is_none()) return;
    py::object steps = get_attr(its_, n_.steps);
    py::str word(what);
    set_attr(its_, n_.first_nonfinite, steps.ptr());
    set_attr(its_, n_.first_nonfinite_in, word.ptr());
    py::object callback = on_nonfinite_ref_();
    if (!callback.is_none()) callback(steps, word);
  }

  static void append(const py::object& seq, const py::object& v) {
    if (PyList_CheckExact(seq.ptr())) {
      if (PyList_Append(seq.ptr(), v.ptr()) < 0) throw py::error_already_set();
      return;
    }
    PyObject* r = PyObject_CallMethodOneArg(seq.ptr(), names().append, v.ptr());
    if (r == nullptr) throw py::error_already_set();
    Py_DECREF(r);
  }

  // mapping.get(key, default), a plain dict's read directly
  static py::object get(const py::object& mapping, PyObject* key, const py::object& dflt) {
    if (PyDict_CheckExact(mapping.ptr())) {
      PyObject* v = PyDict_GetItemWithError(mapping.ptr(), key);  // (borrowed)
      if (v == nullptr && PyErr_Occurred()) throw py::error_already_set();
      return v != nullptr ? py::reinterpret_borrow<py::object>(v) : dflt;
    }
    PyObject* r = PyObject_CallMethodObjArgs(mapping.ptr(), names().get, key, dflt.ptr(), nullptr);
    if (r == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(r);
  }

  // float(v) for an int or a float (a bool, numpy's float64 too), else None: as isinstance(v, (int, float))
  static py::object as_float(const py::object& v) {
    if (!PyLong_Check(v.ptr()) && !PyFloat_Check(v.ptr())) return py::none();
    PyObject* f = PyNumber_Float(v.ptr());
    if (f == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(f);
  }

  py::object on_nonfinite_ref_, fallback_;
  int64_t live_base_;
  const Names& n_;
  py::object loss_ = py::none(), norm_ = py::none(), lr_ = py::none();
  const char* bad_ = nullptr;  // "loss" / "gradients": this iteration's NaN/Inf, seen before its step
  int64_t backwards_ = 0;      // backward() calls since the last step
};

// The three per-iteration calls as C functions whose `self` is a capsule holding the LoopSeries (and a reference
// to its Python object, released with the capsule): Python calls them with no pybind11 dispatch. A C++ or Python
// error becomes the Python exception it is (a KeyboardInterrupt from the callback goes on as it came).
constexpr const char* kSeriesCapsule = "backward_doctor.LoopSeries";

template <typename F>
PyObject* series_call(PyObject* cap, F&& f) {
  auto* s = static_cast<LoopSeries*>(PyCapsule_GetPointer(cap, kSeriesCapsule));
  if (s == nullptr) return nullptr;
  try {
    f(*s);
  } catch (py::error_already_set& e) {
    e.restore();
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* series_saw_backward(PyObject* cap, PyObject* loss) {
  return series_call(cap, [loss](LoopSeries& s) { s.saw_backward(loss); });
}
PyObject* series_before_step(PyObject* cap, PyObject* opt) {
  return series_call(cap, [opt](LoopSeries& s) { s.before_step(opt); });
}
PyObject* series_iteration_ended(PyObject* cap, PyObject*) {
  return series_call(cap, [](LoopSeries& s) { s.iteration_ended(); });
}
PyObject* series_calls(PyObject* cap, PyObject*) {
  auto* s = static_cast<LoopSeries*>(PyCapsule_GetPointer(cap, kSeriesCapsule));
  return s != nullptr ? PyLong_FromLongLong(s->backward_calls) : nullptr;
}
PyMethodDef kSeriesMethods[] = {
    {"saw_backward", series_saw_backward, METH_O, "backward() was called on this loss"},
    {"before_step", series_before_step, METH_O, "the outermost optimizer.step() is about to run"},
    {"iteration_ended", series_iteration_ended, METH_NOARGS, "the iteration ended (before it is counted)"},
    {"backward_calls", series_calls, METH_NOARGS, "backward() calls seen in the run"},
};

// The functions of `defs` bound to `self` (a pybind11 object holding `obj`): their `self` is a capsule named `name`
// holding `obj` and a reference to `self`, released with the capsule, so `self` lives while one of them does.
void release_capsule_owner(PyObject* cap) { Py_XDECREF(static_cast<PyObject*>(PyCapsule_GetContext(cap))); }

template <typename T, size_t N>
py::tuple bind_functions(py::object self, const char* name, PyMethodDef (&defs)[N]) {
  PyObject* cap = PyCapsule_New(self.cast<T*>(), name, release_capsule_owner);
  if (cap == nullptr) throw py::error_already_set();
  py::object owner = py::reinterpret_steal<py::object>(cap);
  Py_INCREF(self.ptr());
  if (PyCapsule_SetContext(cap, self.ptr()) < 0) {
    Py_DECREF(self.ptr());
    throw py::error_already_set();
  }
  py::tuple out(N);
  for (size_t i = 0; i < N; ++i) {
    PyObject* fn = PyCFunction_New(&defs[i], cap);
    if (fn == nullptr) throw py::error_already_set();
    PyTuple_SET_ITEM(out.ptr(), i, fn);
  }
  return out;
}

// (saw_backward, before_step, iteration_ended, backward_calls) of `self` (the LoopSeries' Python object)
py::tuple series_bound(py::object self) {
  return bind_functions<LoopSeries>(std::move(self), kSeriesCapsule, kSeriesMethods);
}

// ---------------------------------------------------------------- gradient accumulation, counted
// capture/watches/accumulation.py's counting-only window in C. Past its detailed windows (no library's flag to read, no
// check running) the accumulation watch only counts backward() calls per optimizer step; here that count and the
// few fields a window keeps, while the watch's backward_began, zeroing, step_began and step_ended are these
// functions (instance attributes the watch sets in _count_natively and removes in _leave_counting). Anything else
// (a zero_grad() after a window's backward()) hands the window, as it stands, back to the watch's Python, which
// continues it. The watch is held weakly (its attributes hold these functions: no cycle the collector cannot see).
constexpr int64_t kBuckets = 33;  // accum_watch._BUCKETS
constexpr const char* kCounterCapsule = "backward_doctor.AccumCounter";

struct AccumCounter {
  AccumCounter(py::object watch_ref, unsigned long thread) : ref(std::move(watch_ref)), thread(thread) {}
  py::object ref;
  unsigned long thread;
  int64_t n = 0, depth = 0, n_step = 0;
  bool zeroed = false;
  py::object opt = py::none();
  std::vector<int64_t> per_step = std::vector<int64_t>(kBuckets, 0);

  bool on_thread() const { return PyThread_get_thread_ident() == thread; }

  // (n, zeroed, depth, n_step, opt, per_step counted here) for the watch taking the window back
  py::tuple state() const { return py::make_tuple(n, zeroed, depth, n_step, opt, per_step); }
};

AccumCounter* counter_of(PyObject* cap) {
  return static_cast<AccumCounter*>(PyCapsule_GetPointer(cap, kCounterCapsule));
}

// backward() begins: counted unless another thread's or nested in another backward() (reentrant checkpointing)
PyObject* counter_backward_began(PyObject* cap, PyObject*) {
  AccumCounter* c = counter_of(cap);
  if (c == nullptr) return nullptr;
  if (!c->on_thread() || torch::autograd::get_current_graph_task_id() != -1) Py_RETURN_FALSE;
  ++c->n;
  Py_RETURN_TRUE;
}

// zero_grad() begins: before the window's first backward(), or a closure evaluated again in its step; else the
// window goes back to the watch, and the watch's own zeroing() runs
PyObject* counter_zeroing(PyObject* cap, PyObject* const* args, Py_ssize_t nargs) {
  AccumCounter* c = counter_of(cap);
  if (c == nullptr) return nullptr;
  if (!c->on_thread()) Py_RETURN_NONE;
  if (c->n == 0) {
    c->zeroed = true;
    Py_RETURN_NONE;
  }
  if (c->depth > 0 && c->n > c->n_step) {
    c->n = c->n_step;
    Py_RETURN_NONE;
  }
  py::object watch = c->ref();  // (c is freed when the watch drops its functions: read nothing of it below)
  if (watch.is_none()) Py_RETURN_NONE;
  try {
    watch.attr("_leave_counting")();
    py::tuple call(nargs);
    for (Py_ssize_t i = 0; i < nargs; ++i) call[i] = py::reinterpret_borrow<py::object>(args[i]);
    return watch.attr("zeroing")(*call).release().ptr();
  } catch (py::error_already_set& e) {
    e.restore();
    return nullptr;
  }
}

// the outermost optimizer.step() begins (opt, args, kwargs)
PyObject* counter_step_began(PyObject* cap, PyObject* const* args, Py_ssize_t nargs) {
  AccumCounter* c = counter_of(cap);
  if (c == nullptr) return nullptr;
  if (nargs < 1) {
    PyErr_SetString(PyExc_TypeError, "step_began(opt, args, kwargs)");
    return nullptr;
  }
  ++c->depth;
  c->opt = py::reinterpret_borrow<py::object>(args[0]);
  c->n_step = c->n;
  Py_RETURN_NONE;
}

// the outermost step returned: its window is counted and closes
PyObject* counter_step_ended(PyObject* cap, PyObject*) {
  AccumCounter* c = counter_of(cap);
  if (c == nullptr) return nullptr;
  c->depth = c->depth > 0 ? c->depth - 1 : 0;
  c->opt = py::none();
  ++c->per_step[c->n < kBuckets ? c->n : kBuckets - 1];
  c->n = 0;
  c->zeroed = false;
  Py_RETURN_NONE;
}

PyMethodDef kCounterMethods[] = {
    {"backward_began", counter_backward_began, METH_O, "backward() begins: whether it is counted"},
    {"zeroing", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(counter_zeroing)), METH_FASTCALL,
     "zero_grad() begins"},
    {"step_began", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(counter_step_began)),
     METH_FASTCALL, "the outermost optimizer step begins"},
    {"step_ended", counter_step_ended, METH_NOARGS, "the outermost optimizer step returned"},
};

// (backward_began, zeroing, step_began, step_ended) of `self` (the AccumCounter's Python object)
py::tuple counter_bound(py::object self) {
  return bind_functions<AccumCounter>(std::move(self), kCounterCapsule, kCounterMethods);
}

// ---------------------------------------------------------------- autograd graphs after the step
// capture/end/step_state.py walks the graphs the namespace's tensors still carry after a run: for a node an earlier
// run of the cell made (its sequence number in that run's range: a graph kept across runs is a leak), and for
// the oldest node of this run behind a tensor (in a loop, a graph kept from an earlier iteration). In Python
// each node visited built its `next_functions`, a tuple of (node, index) pairs: ~2 us a node, ~1 ms at every
// cell for the 487 nodes behind a T5 tiny step's loss. Here the same walk, node for node: breadth first in
// the order of the nodes' edges, a node visited once, at most `limit` new nodes a walk; the graphs are held
// by the tensors passed in (and the nodes of `clean` by this object) while it walks.
using torch::autograd::Node;
// (an intrusive pointer from torch 2.13 on, a shared one before: whichever an edge holds)
using NodePtr = std::decay_t<decltype(torch::autograd::Edge{}.function)>;

class GraphWalk {
 public:
  // runs: (run id, first sequence number, end) of the cell's earlier runs
  GraphWalk(uint64_t start, std::vector<std::tuple<int64_t, uint64_t, uint64_t>> runs, int64_t limit)
      : start_(start), runs_(std::move(runs)), limit_(limit < 0 ? 0 : static_cast<size_t>(limit)) {}

  // The earlier run whose node the graph behind `t` reaches first (None: none). A walk that ends before its
  // limit without finding one adds its nodes to `clean`: the later walks do not enter them again (a model's
  // outputs share most of their graph).
  py::object earlier_run(const at::Tensor& t) {
    std::optional<int64_t> found;
    std::vector<NodePtr> walked;
    const bool ended = walk(t, &clean_, [&](NodePtr& node) {
      const uint64_t seq = node->sequence_nr();
      if (seq < start_)
        for (const auto& [run, lo, hi] : runs_)
          if (lo <= seq && seq < hi) {
            found = run;  // (one node of an earlier run is enough to know)
            return false;
          }
      walked.push_back(std::move(node));
      return true;
    });
    if (found) return py::int_(*found);
    if (ended) {  // walked to the end: every node behind these is clean too
      for (auto& node : walked) {
        clean_.insert(node.get());
        kept_.push_back(std::move(node));
      }
    }
    return py::none();
  }

  // The smallest sequence number >= start of the nodes behind `t` (start when there is none), a walk of its own.
  uint64_t oldest_seq(const at::Tensor& t) const {
    uint64_t oldest = std::numeric_limits<uint64_t>::max();
    walk(t, nullptr, [&](NodePtr& node) {
      const uint64_t seq = node->sequence_nr();
      if (seq >= start_ && seq < oldest) oldest = seq;
      return true;
    });
    return oldest == std::numeric_limits<uint64_t>::max() ? start_ : oldest;
  }

 private:
  // Breadth first from ``t``'s node in the order of each node's edges, each node once, none of ``skip``, at most
  // ``limit_`` nodes: ``visit(node)`` is called with each (after its edges are queued) and false stops the walk.
  // True when the walk ended before the limit (not stopped, not cut).
  template <typename Visit>
  bool walk(const at::Tensor& t, const std::unordered_set<Node*>* skip, Visit&& visit) const {
    std::unordered_set<Node*> seen;
    std::deque<NodePtr> queue{t.grad_fn()};
    while (!queue.empty() && seen.size() < limit_) {
      NodePtr node = std::move(queue.front());
      queue.pop_front();
      if (!node || (skip && skip->count(node.get())) || !seen.insert(node.get()).second) continue;
      for (const auto& edge : node->next_edges()) queue.push_back(edge.function);
      if (!visit(node)) return false;
    }
    return seen.size() < limit_;
  }

  uint64_t start_;
  std::vector<std::tuple<int64_t, uint64_t, uint64_t>> runs_;
  size_t limit_;
  std::unordered_set<Node*> clean_;
  std::vector<NodePtr> kept_;  // (clean_'s nodes alive: an address is never another node's)
};

// The allocator reports to whatever holds the PROFILER_STATE slot, and torch.profiler refuses to
// start while it is taken: a user's profiler inside a doctored cell gets the slot for its duration
// (frees it reports then are missed here; add_tensor's staleness check copes).
void pop_reporter() {
  if (!S || !S->reporting) return;
  if (c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE) == S->reporter.get()) {
    try {
      c10::ThreadLocalDebugInfo::_pop(c10::DebugInfoKind::PROFILER_STATE);
    } catch (...) {  // something else was pushed after it: leave the stack alone
      return;
    }
  }
  S->reporting = false;
}

void suspend_memory() { if (S && std::this_thread::get_id() == S->owner) pop_reporter(); }

void resume_memory() {
  if (!S || S->reporting || std::this_thread::get_id() != S->owner) return;
  if (c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE) != nullptr) return;  // still taken
  c10::ThreadLocalDebugInfo::_push(c10::DebugInfoKind::PROFILER_STATE, S->reporter);
  S->reporting = true;
}

// Calls from Python (hooks, weak-reference callbacks) count only on the recording thread: a tensor
// freed by another thread is left to the staleness check in add_tensor.
inline bool mine() { return S != nullptr && std::this_thread::get_id() == S->owner; }

void set_optimizer_depth(int64_t depth) { if (mine()) S->optimizer_depth = (int)depth; }

void set_stack(int64_t stack_id) { if (mine()) S->stack_id = stack_id; }

void pause_recording() { if (mine()) S->paused++; }

// Between two optimizer steps of a long loop: no op at all is observed until wake() (the callback is
// removed, so PyTorch does not even box the arguments). Only where no observed op is open (its end would
// be missed); returns whether it sleeps.
bool sleep_recording() {
  if (!mine() || S->asleep || !S->open.empty()) return false;
  at::removeCallback(S->handle);
  S->handle = 0;
  S->asleep = true;
  return true;
}

void wake_recording() {
  if (!mine() || !S->asleep) return;
  add_observer();
  S->asleep = false;
}

void resume_recording() { if (mine() && S->paused > 0) S->paused--; }

int64_t op_count() { return S ? S->count : 0; }

// dtype and device type of a tensor as the ints this recorder writes (Python builds its tables from them).
std::vector<int64_t> codes_of(const at::Tensor& t) {
  return {(int64_t)t.scalar_type(), (int64_t)t.device().type()};
}

void register_storage(int64_t key, int64_t nbytes, int64_t cat, int64_t data) {
  if (mine() && key && nbytes > 0 && !S->live.count(key)) count_storage(key, nbytes, (int)cat, -1, data);
}

void release(int64_t key) { if (mine()) uncount(key); }

void reclassify(int64_t key, int64_t cat) {
  if (!mine()) return;
  auto it = S->live.find(key);
  if (it == S->live.end() || it->second.cat == cat) return;
  log_storage(2, key, it->second.nbytes, cat, S->count);
  S->totals[it->second.cat] -= it->second.nbytes;
  S->totals[cat] += it->second.nbytes;
  it->second.cat = (int)cat;
}

std::vector<int64_t> totals() {
  std::vector<int64_t> out;
  if (S) out.assign(S->totals, S->totals + kCategories);
  return out;
}

// An op argument as a Python object, for the failing op's evidence (tensors, numbers, lists of them).
py::object to_py(const c10::IValue& v) {
  if (v.isTensor()) return py::cast(v.toTensor());
  if (v.isInt()) return py::int_(v.toInt());
  if (v.isDouble()) return py::float_(v.toDouble());
  if (v.isBool()) return py::bool_(v.toBool());
  if (v.isTensorList()) {
    py::list l;
    for (const at::Tensor& t : v.toTensorList().vec()) l.append(py::cast(t));
    return l;
  }
  if (v.isIntList()) return py::cast(v.toIntVector());
  if (v.isList()) {
    py::list l;
    for (const c10::IValue& x : v.toListRef()) l.append(to_py(x));
    return l;
  }
  return py::none();
}

py::dict stop() {
  TORCH_CHECK(S != nullptr, "backward_doctor: the native recorder is not running");
  if (S->handle) at::removeCallback(S->handle);  // (none while asleep)
  pop_reporter();
  g_carrier.store(nullptr, std::memory_order_release);
  if (S->wrapped) unwrap_cpu_allocator();
  raw().reset(false);
  g_owner.store(std::thread::id(), std::memory_order_relaxed);
  FLAGS_caffe2_log_level = S->saved_log_level;
  State* s = S;
  S = nullptr;
  py::dict out;
  out["failed_index"] = s->failed_index;
  out["last_op_end_s"] = (s->last_end_ns - s->start_ns) / 1e9;  // a failed step's time ends at its last op
  out["failed_overload"] = s->failed_overload;
  py::list failed;
  for (const auto& v : s->failed_inputs) failed.append(to_py(v));
  out["failed_args"] = failed;
  std::unordered_map<int64_t, int64_t> by_producer;
  for (const auto& kv : s->live) by_producer[kv.second.producer] += kv.second.nbytes;
  out["by_producer"] = by_producer;
  out["failed_name"] = s->failed_name;
  if (s->detail) {
    py::dict d;
    d["events"] = s->events;
    d["metas"] = s->ev_metas;
    d["sizes"] = s->ev_sizes;
    d["stats"] = s->ev_stats;
    d["nf_origin"] = s->nf_origin;
    d["nf_by_index"] = s->nf_by_index;
    out["detail"] = d;
  }
  if (s->oom) {
    py::dict oom;
    oom["index"] = s->oom_index;
    oom["requested"] = s->oom_requested;
    oom["live"] = s->oom_live;
    oom["totals"] = std::vector<int64_t>(s->oom_totals.begin(), s->oom_totals.end());
    oom["by_producer"] = s->oom_by_producer;
    out["oom"] = oom;
  }
  out["failed_phase"] = s->failed_phase;
  if (s->has_best) s->light_tl.insert(s->light_tl.end(), s->light_best.begin(), s->light_best.end());
  out["light_timeline"] = s->light_tl;
  out["light_peak"] = s->light_peak >= 0 ? std::vector<int64_t>(s->light_peak_rec.begin(), s->light_peak_rec.end())
                                          : std::vector<int64_t>();
  std::unordered_map<int64_t, std::vector<int64_t>> light_totals;
  for (const auto& kv : s->light_totals) light_totals[kv.first] = {kv.second.first, kv.second.second};
  out["light_totals"] = light_totals;
  int64_t held = (int64_t)((s->recs.capacity() + s->tensors.capacity() + s->sizes.capacity() +
                            s->inplace.capacity() + s->storage_log.capacity() + s->lastis.capacity() +
                            s->light_tl.capacity() +
                            s->meta_table.capacity() + s->meta_sizes.capacity()) * sizeof(int64_t) +
                           s->codes.capacity() * sizeof(PyObject*) +
                           s->live.size() * (sizeof(Entry) + 32) + s->by_data.size() * 32 +
                           (s->sites.size() + s->metas.size()) * 64);
  out["buffer_bytes"] = held;  // what the recorder held at the end of the step (for benchmarks/)
  out["recs"] = py::bytes(reinterpret_cast<const char*>(s->recs.data()), s->recs.size() * sizeof(int64_t));
  out["tensors"] = py::bytes(reinterpret_cast<const char*>(s->tensors.data()), s->tensors.size() * sizeof(int64_t));
  out["sizes"] = py::bytes(reinterpret_cast<const char*>(s->sizes.data()), s->sizes.size() * sizeof(int64_t));
  out["inplace"] = py::bytes(reinterpret_cast<const char*>(s->inplace.data()), s->inplace.size() * sizeof(int64_t));
  out["lastis"] = s->lastis;
  out["storage_log"] = py::bytes(reinterpret_cast<const char*>(s->storage_log.data()),
                                 s->storage_log.size() * sizeof(int64_t));
  out["storage_dropped"] = s->storage_dropped;
  py::list codes;
  for (PyObject* c : s->codes) codes.append(py::reinterpret_steal<py::object>(c));  // hands our references over
  out["codes"] = codes;
  out["names"] = s->names;
  out["roots"] = s->roots;
  out["count"] = s->count;
  std::vector<int64_t> tot(s->totals, s->totals + kCategories);
  out["totals"] = tot;
  out["width"] = kWidth;
  out["tensor_width"] = kTensorWidth;
  out["metas"] = py::bytes(reinterpret_cast<const char*>(s->meta_table.data()), s->meta_table.size() * sizeof(int64_t));
  out["meta_sizes"] = s->meta_sizes;
  delete s;
  return out;
}

// Module functions a loop calls at every iteration, as plain C functions (pybind11's dispatch costs a few hundred
// instructions a call: ~0.9k an iteration for these and backward_calls, callgrind): the RNG mark of an iteration's start, autograd's next sequence number.
PyObject* mark_rng_c(PyObject*, PyObject*) {
  try {
    mark_rng();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}
PyObject* sequence_nr_c(PyObject*, PyObject*) { return PyLong_FromUnsignedLongLong(at::sequence_number::peek()); }
PyMethodDef kPlainFunctions[] = {
    {"mark_rng", mark_rng_c, METH_NOARGS, "keep torch's CPU RNG state as it is now (restore_rng puts it back)"},
    {"sequence_nr", sequence_nr_c, METH_NOARGS, "autograd's next sequence number on this thread"},
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("start", &start);
  m.def("stop", &stop);
  m.def("running", &running);
  m.def("allocated", &allocated);
  m.def("cpu_allocator_wrapped", &cpu_allocator_wrapped);
  for (auto& def : kPlainFunctions) {
    PyObject* fn = PyCFunction_NewEx(&def, nullptr, m.attr("__name__").ptr());
    if (fn == nullptr) throw py::error_already_set();
    m.add_object(def.ml_name, py::reinterpret_steal<py::object>(fn));
  }
  m.def("marked_rng", &marked_rng);
  m.def("restore_rng", &restore_rng);
  m.def("scalar_value", &scalar_value);
  m.def("grad_sumsq", &grad_sumsq);
  m.def("groups_grad_sumsq", &groups_grad_sumsq);
  m.def("nonzero_each", &nonzero_each);
  m.def("suspend_memory", &suspend_memory);
  m.def("resume_memory", &resume_memory);
  m.def("set_optimizer_depth", &set_optimizer_depth);
  m.def("register_storage", &register_storage);
  m.def("release", &release);
  m.def("reclassify", &reclassify);
  m.def("totals", &totals);
  m.def("set_stack", &set_stack);
  m.def("pause", &pause_recording);
  m.def("sleep", &sleep_recording);
  m.def("wake", &wake_recording);
  m.def("resume", &resume_recording);
  m.def("op_count", &op_count);
  m.def("codes_of", &codes_of);
  py::class_<GraphWalk>(m, "GraphWalk")
      .def(py::init<uint64_t, std::vector<std::tuple<int64_t, uint64_t, uint64_t>>, int64_t>())
      .def("earlier_run", &GraphWalk::earlier_run)
      .def("oldest_seq", &GraphWalk::oldest_seq);
  py::class_<LoopSeries>(m, "LoopSeries")
      .def(py::init<py::object, int64_t, py::object, py::object>())
      .def("bound", &series_bound);
  py::class_<AccumCounter>(m, "AccumCounter")
      .def(py::init<py::object, unsigned long>())
      .def("bound", &counter_bound)
      .def("state", &AccumCounter::state);
}
