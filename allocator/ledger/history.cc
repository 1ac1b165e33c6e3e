// The history's ring buffers, record modes and stack interning (hash of the raw frames -> id).
// Thread-safety: see history.h; lock order is device lock -> ring lock, and mu_ -> nothing.
#include "ledger/history.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace vramledger {
namespace {

std::uint64_t Mix(std::uint64_t h, std::uint64_t v) {
  // A 64-bit multiply-xorshift step (as in splitmix64); good enough to spread stack contents.
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  h *= 0xbf58476d1ce4e5b9ULL;
  return h ^ (h >> 31);
}

std::uint64_t HashStack(const PythonFrameRef* python, int num_python,
                        const std::uintptr_t* native, int num_native) {
  std::uint64_t h = Mix(static_cast<std::uint64_t>(num_python), num_native);
  for (int i = 0; i < num_python; ++i) {
    h = Mix(h, python[i].code);
    h = Mix(h, static_cast<std::uint64_t>(static_cast<std::uint32_t>(python[i].line)));
  }
  for (int i = 0; i < num_native; ++i) h = Mix(h, native[i]);
  return h == 0 ? 1 : h;
}

bool IsSegmentGrowth(TraceAction a) {
  return a == TraceAction::kSegmentAlloc || a == TraceAction::kSegmentMap;
}
bool IsSegmentRelease(TraceAction a) {
  return a == TraceAction::kSegmentFree || a == TraceAction::kSegmentUnmap;
}

}  // namespace

absl::StatusOr<HistorySettings> ParseHistorySettings(std::optional<std::string_view> enabled,
                                                     std::optional<std::string_view> context,
                                                     std::string_view stacks,
                                                     std::uint64_t max_entries) {
  HistorySettings s;
  if (!enabled.has_value()) {
    s.enabled = HistoryEnabled::kNone;
  } else if (*enabled == "state") {
    s.enabled = HistoryEnabled::kState;
  } else if (*enabled == "all") {
    s.enabled = HistoryEnabled::kAll;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "record_memory_history: enabled='", std::string(*enabled),
        "' is not accepted; expected None, 'state' or 'all'"));
  }
  if (!context.has_value()) {
    s.context = HistoryContext::kNone;
  } else if (*context == "state") {
    s.context = HistoryContext::kState;
  } else if (*context == "alloc") {
    s.context = HistoryContext::kAlloc;
  } else if (*context == "all") {
    s.context = HistoryContext::kAll;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "record_memory_history: context='", std::string(*context),
        "' is not accepted; expected None, 'state', 'alloc' or 'all'"));
  }
  if (stacks == "python") {
    s.stacks = HistoryStacks::kPython;
  } else if (stacks == "all") {
    s.stacks = HistoryStacks::kAll;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("record_memory_history: stacks='",
                                                   std::string(stacks),
                                                   "' is not accepted; expected 'python' or 'all'"));
  }
  if (max_entries < 1) {
    return absl::InvalidArgumentError(
        "record_memory_history: max_entries must be at least 1 (got 0)");
  }
  s.max_entries = static_cast<std::size_t>(std::min<std::uint64_t>(max_entries, SIZE_MAX));
  return s;
}

std::string_view HistoryEnabledName(HistoryEnabled enabled) {
  switch (enabled) {
    case HistoryEnabled::kState: return "state";
    case HistoryEnabled::kAll: return "all";
    case HistoryEnabled::kNone: break;
  }
  return "None";
}

std::string_view HistoryContextName(HistoryContext context) {
  switch (context) {
    case HistoryContext::kState: return "state";
    case HistoryContext::kAlloc: return "alloc";
    case HistoryContext::kAll: return "all";
    case HistoryContext::kNone: break;
  }
  return "None";
}

std::string_view HistoryStacksName(HistoryStacks stacks) {
  return stacks == HistoryStacks::kAll ? "all" : "python";
}

History::History(const HistorySettings& settings)
    : enabled_(settings.enabled),
      context_(settings.context),
      stacks_(settings.stacks),
      max_entries_(std::max<std::size_t>(settings.max_entries, 1)) {}

void History::Configure(const HistorySettings& settings, bool clear) {
  absl::MutexLock config_lock(&config_mu_);
  const std::size_t max_entries = std::max<std::size_t>(settings.max_entries, 1);
  const bool off = settings.enabled == HistoryEnabled::kNone;
  // Off first, so that no event is recorded half-way through the change.
  if (off) enabled_.store(HistoryEnabled::kNone, std::memory_order_release);
  context_.store(settings.context, std::memory_order_relaxed);
  stacks_.store(settings.stacks, std::memory_order_relaxed);
  max_entries_.store(max_entries, std::memory_order_relaxed);
  for (Ring& ring : rings_) {
    absl::MutexLock lock(&ring.mu);
    if (off || clear || settings.enabled != HistoryEnabled::kAll) {
      ring.slots.clear();
      ring.slots.shrink_to_fit();
      ring.head = 0;
    } else {
      Resize(ring, max_entries);
    }
    if (off || clear) ring.segment_stacks.clear();
  }
  enabled_.store(settings.enabled, std::memory_order_release);
}

HistorySettings History::settings() const {
  HistorySettings s;
  s.enabled = enabled_.load(std::memory_order_acquire);
  s.context = context_.load(std::memory_order_relaxed);
  s.stacks = stacks_.load(std::memory_order_relaxed);
  s.max_entries = max_entries_.load(std::memory_order_relaxed);
  return s;
}

void History::Resize(Ring& ring, std::size_t max_entries) {
  // Linearise (oldest first), then keep the most recent max_entries.
  if (ring.head != 0) {
    std::rotate(ring.slots.begin(), ring.slots.begin() + static_cast<std::ptrdiff_t>(ring.head),
                ring.slots.end());
    ring.head = 0;
  }
  if (ring.slots.size() > max_entries) {
    ring.slots.erase(ring.slots.begin(),
                     ring.slots.end() - static_cast<std::ptrdiff_t>(max_entries));
  }
}

void History::Push(Ring& ring, const RecordedEntry& entry, std::size_t max_entries,
                   std::atomic<std::uint64_t>& dropped) {
  if (ring.slots.size() < max_entries) {
    ring.slots.push_back(entry);  // filling: head stays 0
    return;
  }
  if (ring.slots.size() > max_entries) Resize(ring, max_entries);  // a Configure race
  ring.slots[ring.head] = entry;
  ring.head = ring.head + 1 == ring.slots.size() ? 0 : ring.head + 1;
  dropped.fetch_add(1, std::memory_order_relaxed);
}

std::uint64_t History::CaptureContext(TraceAction action) {
  const HistoryEnabled enabled = enabled_.load(std::memory_order_acquire);
  const HistoryContext context = context_.load(std::memory_order_relaxed);
  if (enabled == HistoryEnabled::kNone || context == HistoryContext::kNone) return 0;
  // Free-side stacks only in "all" mode (torch's RecordContext::ALL).
  const bool free_side =
      action == TraceAction::kFreeRequested || action == TraceAction::kFreeCompleted;
  if (free_side && context != HistoryContext::kAll) return 0;
  PythonFrameRef python[kMaxPythonFrames];
  std::uintptr_t native[kMaxNativeFrames];
  const int num_python = CapturePythonFrames(python, kMaxPythonFrames);
  int num_native = 0;
  if (stacks_.load(std::memory_order_relaxed) == HistoryStacks::kAll) {
    // Skip this function and DeviceAllocatorImpl::Malloc/Free: start at the public entry point.
    num_native = CaptureNativeFrames(native, kMaxNativeFrames, /*skip=*/2);
  }
  return Intern(python, num_python, native, num_native, /*retain_python=*/true, nullptr);
}

std::uint64_t History::InternForTesting(const std::vector<PythonFrameRef>& python,
                                        const std::vector<Frame>& python_names,
                                        const std::vector<std::uintptr_t>& native) {
  return Intern(python.data(), static_cast<int>(python.size()), native.data(),
                static_cast<int>(native.size()), /*retain_python=*/false, &python_names);
}

bool History::SameStack(const StoredStack& s, const PythonFrameRef* python, int num_python,
                        const std::uintptr_t* native, int num_native) const {
  if (s.python_count != static_cast<std::uint32_t>(num_python) ||
      s.native_count != static_cast<std::uint32_t>(num_native)) {
    return false;
  }
  for (int i = 0; i < num_python; ++i) {
    const PythonFrameRef& f = python_frames_[s.python_begin + i];
    if (f.code != python[i].code || f.line != python[i].line) return false;
  }
  return std::equal(native, native + num_native, native_frames_.begin() + s.native_begin);
}

std::uint64_t History::Intern(const PythonFrameRef* python, int num_python,
                              const std::uintptr_t* native, int num_native, bool retain_python,
                              const std::vector<Frame>* python_names) {
  if (num_python == 0 && num_native == 0) return 0;
  const std::uint64_t hash = HashStack(python, num_python, native, num_native);
  absl::MutexLock lock(&mu_);
  std::uint64_t chain = 0;
  if (auto it = by_hash_.find(hash); it != by_hash_.end()) {
    chain = it->second;
    for (std::uint64_t id = chain; id != 0; id = stacks_table_[id - 1].next_same_hash) {
      if (SameStack(stacks_table_[id - 1], python, num_python, native, num_native)) return id;
    }
  }
  // A new stack: retain its new code objects (the GIL is held by the capturing thread).
  for (int i = 0; i < num_python; ++i) {
    if (code_names_.contains(python[i].code)) continue;
    CodeName names;
    if (retain_python) {
      RetainPythonCode(python[i].code, &names.filename, &names.name);
    } else if (python_names != nullptr && static_cast<std::size_t>(i) < python_names->size()) {
      names.filename = (*python_names)[i].filename;
      names.name = (*python_names)[i].name;
    }
    code_names_.emplace(python[i].code, std::move(names));
  }
  StoredStack s;
  s.hash = hash;
  s.python_begin = static_cast<std::uint32_t>(python_frames_.size());
  s.python_count = static_cast<std::uint32_t>(num_python);
  s.native_begin = static_cast<std::uint32_t>(native_frames_.size());
  s.native_count = static_cast<std::uint32_t>(num_native);
  s.next_same_hash = chain;
  python_frames_.insert(python_frames_.end(), python, python + num_python);
  native_frames_.insert(native_frames_.end(), native, native + num_native);
  stacks_table_.push_back(s);
  const std::uint64_t id = stacks_table_.size();
  by_hash_[hash] = id;  // the newest stack heads its chain
  return id;
}

std::size_t History::num_stacks() const {
  absl::MutexLock lock(&mu_);
  return stacks_table_.size();
}

void History::OnEvent(const TraceEntry& event) {
  const HistoryEnabled enabled = enabled_.load(std::memory_order_acquire);
  if (enabled == HistoryEnabled::kNone) return;
  if (event.device < 0 || event.device >= kMaxDevices) {
    dropped_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  const HistoryContext context = context_.load(std::memory_order_relaxed);
  RecordedEntry entry;
  entry.action = event.action;
  entry.addr = event.addr;
  entry.size = event.size;
  entry.stream = event.stream;
  entry.tag = event.tag;
  // "state" keeps stacks for blocks only; "alloc" and "all" also put them on trace entries
  // (free-side ids are 0 unless context is "all": see CaptureContext).
  entry.stack = context == HistoryContext::kAlloc || context == HistoryContext::kAll
                    ? event.context
                    : 0;
  Ring& ring = rings_[event.device];
  const bool segment_growth = IsSegmentGrowth(event.action);
  const bool segment_release = IsSegmentRelease(event.action);
  if (enabled != HistoryEnabled::kAll && !segment_growth && !segment_release) return;
  entry.time_us = absl::GetCurrentTimeNanos() / 1000;
  absl::MutexLock lock(&ring.mu);
  if (segment_growth && event.context != 0) {
    ring.segment_stacks[event.addr] = event.context;
  } else if (segment_release && !ring.segment_stacks.empty()) {
    ring.segment_stacks.erase(event.addr);
  }
  if (enabled == HistoryEnabled::kAll) {
    Push(ring, entry, max_entries_.load(std::memory_order_relaxed), dropped_);
  }
}

void History::RecordSnapshot(int device, std::size_t active_bytes) {
  if (enabled_.load(std::memory_order_acquire) != HistoryEnabled::kAll) return;
  if (device < 0 || device >= kMaxDevices) return;
  RecordedEntry entry;
  entry.action = TraceAction::kSnapshot;
  entry.size = active_bytes;
  entry.time_us = absl::GetCurrentTimeNanos() / 1000;
  Ring& ring = rings_[device];
  absl::MutexLock lock(&ring.mu);
  Push(ring, entry, max_entries_.load(std::memory_order_relaxed), dropped_);
}

std::vector<RecordedEntry> History::Entries(int device) const {
  std::vector<RecordedEntry> out;
  if (device < 0 || device >= kMaxDevices) return out;
  const Ring& ring = rings_[device];
  absl::MutexLock lock(&ring.mu);
  out.reserve(ring.slots.size());
  const auto head = ring.slots.begin() + static_cast<std::ptrdiff_t>(ring.head);
  out.insert(out.end(), head, ring.slots.end());
  out.insert(out.end(), ring.slots.begin(), head);
  return out;
}

std::vector<int> History::DevicesWithEntries() const {
  std::vector<int> out;
  for (int d = 0; d < kMaxDevices; ++d) {
    absl::MutexLock lock(&rings_[d].mu);
    if (!rings_[d].slots.empty()) out.push_back(d);
  }
  return out;
}

std::uint64_t History::SegmentStack(int device, DevicePtr address) const {
  if (device < 0 || device >= kMaxDevices) return 0;
  const Ring& ring = rings_[device];
  absl::MutexLock lock(&ring.mu);
  auto it = ring.segment_stacks.find(address);
  return it == ring.segment_stacks.end() ? 0 : it->second;
}

std::vector<Frame> History::Frames(std::uint64_t id) const {
  std::vector<Frame> frames;
  std::vector<std::uintptr_t> native;
  {
    absl::MutexLock lock(&mu_);
    if (id == 0 || id > stacks_table_.size()) return frames;
    const StoredStack& s = stacks_table_[id - 1];
    native.assign(native_frames_.begin() + s.native_begin,
                  native_frames_.begin() + s.native_begin + s.native_count);
    frames.resize(s.native_count);  // filled below, outside this lock
    for (std::uint32_t i = 0; i < s.python_count; ++i) {
      const PythonFrameRef& f = python_frames_[s.python_begin + i];
      const CodeName& names = code_names_.at(f.code);
      frames.push_back(Frame{names.filename, f.line, names.name});
    }
  }
  // Native frames are innermost; torch puts them before the Python frames they ran under.
  absl::MutexLock lock(&symbol_mu_);
  for (std::size_t i = 0; i < native.size(); ++i) {
    auto it = symbols_.find(native[i]);
    if (it == symbols_.end()) it = symbols_.emplace(native[i], SymbolizeNativeFrame(native[i])).first;
    frames[i] = it->second;
  }
  return frames;
}

}  // namespace vramledger
