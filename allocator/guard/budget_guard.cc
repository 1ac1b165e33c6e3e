// The budget guard's checks, accounting and refusal reports. Hooks run under the device
// allocator's lock; counters are relaxed atomics so that readers on other threads need no lock.
#include "guard/budget_guard.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "guard/size_spec.h"

namespace vramledger::guard {
namespace {

// The calling thread's most recent refusal, so CompleteRefusal can finish its message after the
// allocator lock is released. `pending` until the allocator reports the failure (kOom) or the
// request goes through after all.
struct LastRefusal {
  const BudgetGuard* guard = nullptr;
  bool pending = false;
  bool failed = false;  // the allocator failed the request with this refusal (kOom seen)
  Refusal refusal;
  std::string message;
};
thread_local LastRefusal t_last;

template <typename T>
void AtomicMax(std::atomic<T>& a, T value) {
  T old = a.load(std::memory_order_relaxed);
  while (value > old && !a.compare_exchange_weak(old, value, std::memory_order_relaxed)) {
  }
}

void ToStderr(const std::string& text) { std::fprintf(stderr, "%s\n", text.c_str()); }

constexpr int kNativeFrames = 16;

}  // namespace

absl::StatusOr<std::unique_ptr<BudgetGuard>> BudgetGuard::Create(
    int device, TagRegistry* tags, std::optional<DeviceBudget> budget) {
  if (budget) {
    for (const CategoryBudget& c : budget->categories) {
      if (absl::StatusOr<std::uint32_t> id = tags->Intern(c.name); !id.ok()) return id.status();
    }
  }
  return std::unique_ptr<BudgetGuard>(new BudgetGuard(device, tags, std::move(budget)));
}

BudgetGuard::BudgetGuard(int device, TagRegistry* tags, std::optional<DeviceBudget> budget)
    : device_(device),
      tags_(tags),
      budget_(std::move(budget)),
      cap_(budget_ && budget_->enforces_limit ? budget_->cap() : 0),
      warn_bytes_(budget_ ? budget_->warn_bytes : 0),
      counters_(new TagCounter[kMaxTags]),
      tag_limit_(new std::uint64_t[kMaxTags]),
      tag_limit_line_(new int[kMaxTags]()) {
  std::fill(tag_limit_.get(), tag_limit_.get() + kMaxTags, kNoLimit);
  if (budget_) {
    for (const CategoryBudget& c : budget_->categories) {
      const absl::StatusOr<std::uint32_t> id = tags_->Intern(c.name);  // interned by Create
      if (!id.ok()) continue;
      tag_limit_[*id] = c.bytes;
      tag_limit_line_[*id] = c.line;
      has_category_limits_ = true;
    }
  }
  absl::MutexLock lock(&config_mu_);
  warning_sink_ = ToStderr;
}

BudgetGuard::~BudgetGuard() {
  if (t_last.guard == this) t_last = LastRefusal();
}

absl::Status BudgetGuard::CheckAllocation(const AllocationRequest& request,
                                          const HookStats& stats) {
  const auto allocated = static_cast<std::uint64_t>(stats.allocated_bytes);
  reserved_now_ = static_cast<std::uint64_t>(stats.reserved_bytes);
  pending_allocated_after_ = allocated + request.rounded;
  if (has_category_limits_ && request.tag < kMaxTags) {
    const std::uint64_t limit = tag_limit_[request.tag];
    if (limit != kNoLimit) {
      const auto current = static_cast<std::uint64_t>(std::max<std::int64_t>(
          0, counters_[request.tag].current.load(std::memory_order_relaxed)));
      if (current + request.size > limit) {
        Refusal r = Base(request, stats);
        const std::string name = tags_->Name(request.tag);
        r.line = tag_limit_line_[request.tag];
        for (const CategoryBudget& c : budget_->categories) {
          if (c.name == name) r.field = c.field;
        }
        r.reason = absl::StrCat("live '", name, "' bytes would reach ",
                                FormatBytes(current + request.size), " (", FormatSize(current),
                                " live + this request), past the plan's category limit of ",
                                FormatBytes(limit));
        return Refuse(std::move(r));
      }
    }
  }
  if (warn_bytes_ != 0 && reserved_now_ > warn_bytes_) MaybeWarn(reserved_now_, allocated);
  return absl::OkStatus();
}

absl::Status BudgetGuard::CheckGrowth(const AllocationRequest& request, std::size_t reserved_after,
                                      const HookStats& stats) {
  if (cap_ != 0 && reserved_after > cap_) {
    Refusal r = Base(request, stats);
    const DeviceBudget& b = *budget_;
    const bool by_limit = b.limit_line != 0;
    r.line = by_limit ? b.limit_line : b.headroom_line;
    r.field = by_limit ? b.limit_field : b.headroom_field;
    r.reason = absl::StrCat("reserved memory would grow to ", FormatBytes(reserved_after),
                            ", past the plan's limit of ", FormatBytes(cap_));
    if (b.headroom > 0) {
      absl::StrAppend(&r.reason, " (limit ", FormatSize(b.limit),
                      by_limit ? absl::StrCat(" at line ", b.limit_line) : " = the card",
                      " minus headroom ", FormatSize(b.headroom), " at line ", b.headroom_line,
                      ")");
    }
    absl::StrAppend(&r.reason, " (checked again after releasing the cache)");
    return Refuse(std::move(r));
  }
  if (t_last.guard == this) t_last.pending = false;  // an earlier refusal of this Malloc passed
  if (warn_bytes_ != 0 && reserved_after > warn_bytes_) {
    MaybeWarn(reserved_after, static_cast<std::uint64_t>(stats.allocated_bytes));
  }
  return absl::OkStatus();
}

void BudgetGuard::OnEvent(const TraceEntry& event) {
  switch (event.action) {
    case TraceAction::kAlloc: {
      if (event.tag < kMaxTags) {
        TagCounter& c = counters_[event.tag];
        const std::int64_t now =
            c.current.load(std::memory_order_relaxed) + static_cast<std::int64_t>(event.size);
        c.current.store(now, std::memory_order_relaxed);
        AtomicMax(c.peak, now);
        AtomicMax(c.step_peak, now);
      }
      AtomicMax(step_peak_allocated_, pending_allocated_after_);
      break;
    }
    case TraceAction::kFreeCompleted:
      if (event.tag < kMaxTags) {
        TagCounter& c = counters_[event.tag];
        c.current.store(
            c.current.load(std::memory_order_relaxed) - static_cast<std::int64_t>(event.size),
            std::memory_order_relaxed);
      }
      break;
    case TraceAction::kSegmentAlloc:
    case TraceAction::kSegmentMap:
      reserved_now_ += event.size;
      AtomicMax(step_peak_reserved_, reserved_now_);
      break;
    case TraceAction::kSegmentFree:
    case TraceAction::kSegmentUnmap:
      reserved_now_ -= std::min<std::uint64_t>(reserved_now_, event.size);
      break;
    case TraceAction::kOom:
      if (t_last.guard == this && t_last.pending) {
        t_last.pending = false;
        t_last.failed = true;
        refusals_.fetch_add(1, std::memory_order_relaxed);
      }
      break;
    default:
      break;
  }
}

Refusal BudgetGuard::Base(const AllocationRequest& request, const HookStats& stats) const {
  Refusal r;
  r.plan_path = budget_->path;
  r.device = device_;
  r.request_bytes = request.size;
  r.rounded_bytes = request.rounded;
  r.stream = request.stream;
  r.tag = tags_->Name(request.tag);
  r.context = request.context;
  r.allocated = static_cast<std::uint64_t>(stats.allocated_bytes);
  r.reserved = static_cast<std::uint64_t>(stats.reserved_bytes);
  r.cap = cap_;
  r.categories = Categories();
  return r;
}

absl::Status BudgetGuard::Refuse(Refusal refusal) {
  refusal.complete = false;
  t_last.guard = this;
  t_last.pending = true;
  t_last.failed = false;
  t_last.message = FormatRefusal(refusal);
  t_last.refusal = std::move(refusal);
  return absl::ResourceExhaustedError(t_last.message);
}

std::vector<CategoryUsage> BudgetGuard::Categories() const {
  std::vector<CategoryUsage> out;
  const std::uint32_t n = std::min(tags_->size(), kMaxTags);
  for (std::uint32_t id = 0; id < n; ++id) {
    const std::int64_t current = counters_[id].current.load(std::memory_order_relaxed);
    if (current <= 0 && tag_limit_[id] == kNoLimit) continue;
    CategoryUsage c;
    c.name = tags_->Name(id);
    c.current = static_cast<std::uint64_t>(std::max<std::int64_t>(current, 0));
    c.has_limit = tag_limit_[id] != kNoLimit;
    c.limit = c.has_limit ? tag_limit_[id] : 0;
    c.line = tag_limit_line_[id];
    out.push_back(std::move(c));
  }
  return out;
}

void BudgetGuard::MaybeWarn(std::uint64_t reserved, std::uint64_t allocated) {
  const std::int64_t step = step_.load(std::memory_order_relaxed);
  if (warned_step_.load(std::memory_order_relaxed) == step) return;
  if (warned_step_.exchange(step, std::memory_order_relaxed) == step) return;
  warnings_.fetch_add(1, std::memory_order_relaxed);
  step_warnings_.fetch_add(1, std::memory_order_relaxed);
  const DeviceBudget& b = *budget_;
  std::string text = absl::StrCat(
      "vramledger plan warning: device ", device_, " reserved ", FormatBytes(reserved),
      " passed warn_at ", FormatBytes(warn_bytes_), " (", b.path, ":", b.warn_line, ", field '",
      b.warn_field, "') in step ", step, "\n  live bytes by category (current / plan):\n",
      FormatCategories(Categories()), "  allocated ", FormatBytes(allocated));
  if (cap_ != 0) absl::StrAppend(&text, ", plan limit ", FormatBytes(cap_));
  WarningSink sink;
  {
    absl::MutexLock lock(&config_mu_);
    sink = warning_sink_;
  }
  if (sink) sink(text);
}

absl::Status BudgetGuard::CompleteRefusal(const absl::Status& status,
                                          const DeviceAllocator& allocator) {
  // Only a refusal that failed the request: a growth refused once and then allowed after the
  // cache was released leaves a stale record behind.
  if (!absl::IsResourceExhausted(status) || t_last.guard != this || !t_last.failed ||
      status.message() != absl::string_view(t_last.message)) {
    return status;
  }
  Refusal r = std::move(t_last.refusal);
  t_last = LastRefusal();
  r.complete = true;
  r.largest_free_block = static_cast<std::uint64_t>(
      std::max<std::int64_t>(0, allocator.GetStats().largest_free_block_bytes));
  StackSymbolizer* symbolizer = nullptr;
  PythonStackProvider python;
  ForensicDumpFn dump;
  {
    absl::MutexLock lock(&config_mu_);
    symbolizer = symbolizer_;
    python = python_stack_;
    dump = forensic_dump_;
  }
  if (symbolizer != nullptr && r.context != 0) {
    r.frames = symbolizer->Symbolize(r.context);
    if (!r.frames.empty()) r.stack_note = "as recorded when the allocation was requested";
  }
  // A recorded stack without a Python frame (the history kept native frames only) names no
  // line of the model code: capture the live frames instead.
  if (std::none_of(r.frames.begin(), r.frames.end(),
                   [](const StackFrame& f) { return f.python; })) {
    r.frames.clear();
    if (python) r.frames = python();
    std::vector<StackFrame> native = CaptureNativeFrames(/*skip=*/1, kNativeFrames);
    r.frames.insert(r.frames.end(), native.begin(), native.end());
    r.stack_note = "captured at the refusal";
  }
  if (dump) {
    absl::StatusOr<std::string> path = dump(device_, FormatRefusal(r));
    if (path.ok()) {
      r.snapshot_path = *path;
    } else {
      r.snapshot_note = std::string(path.status().message());
    }
  } else {
    r.snapshot_note = "no snapshot writer is installed";
  }
  return absl::ResourceExhaustedError(FormatRefusal(r));
}

std::vector<TagUsage> BudgetGuard::TagUsages() const {
  std::vector<TagUsage> out;
  const std::uint32_t n = std::min(tags_->size(), kMaxTags);
  for (std::uint32_t id = 0; id < n; ++id) {
    const TagCounter& c = counters_[id];
    TagUsage u;
    u.id = id;
    u.current = c.current.load(std::memory_order_relaxed);
    u.peak = c.peak.load(std::memory_order_relaxed);
    u.step_peak = c.step_peak.load(std::memory_order_relaxed);
    if (id != kUntaggedTag && u.peak == 0 && u.current == 0 && tag_limit_[id] == kNoLimit) continue;
    u.name = tags_->Name(id);
    out.push_back(std::move(u));
  }
  return out;
}

void BudgetGuard::ResetTagPeaks() {
  for (std::uint32_t id = 0; id < kMaxTags; ++id) {
    counters_[id].peak.store(counters_[id].current.load(std::memory_order_relaxed),
                             std::memory_order_relaxed);
  }
}

StepRecord BudgetGuard::EndStep(const DeviceStats& now) {
  absl::MutexLock lock(&step_mu_);
  StepRecord r;
  r.step = step_.load(std::memory_order_relaxed);
  r.device = device_;
  r.allocated = static_cast<std::uint64_t>(now.allocated_bytes[kAggregate].current);
  r.reserved = static_cast<std::uint64_t>(now.reserved_bytes[kAggregate].current);
  r.peak_allocated = std::max(step_peak_allocated_.exchange(r.allocated), r.allocated);
  r.peak_reserved = std::max(step_peak_reserved_.exchange(r.reserved), r.reserved);
  const std::uint32_t n = std::min(tags_->size(), kMaxTags);
  for (std::uint32_t id = 0; id < n; ++id) {
    TagCounter& c = counters_[id];
    const std::int64_t current = c.current.load(std::memory_order_relaxed);
    const std::int64_t peak = std::max(c.step_peak.exchange(current), current);
    if (peak > 0) r.tag_peaks.emplace_back(tags_->Name(id), peak);
  }
  r.warnings = step_warnings_.exchange(0);
  step_.fetch_add(1, std::memory_order_relaxed);
  return r;
}

void BudgetGuard::SetWarningSink(WarningSink sink) {
  absl::MutexLock lock(&config_mu_);
  warning_sink_ = std::move(sink);
}

void BudgetGuard::SetSymbolizer(StackSymbolizer* symbolizer) {
  absl::MutexLock lock(&config_mu_);
  symbolizer_ = symbolizer;
}

void BudgetGuard::SetPythonStackProvider(PythonStackProvider provider) {
  absl::MutexLock lock(&config_mu_);
  python_stack_ = std::move(provider);
}

void BudgetGuard::SetForensicDump(ForensicDumpFn dump) {
  absl::MutexLock lock(&config_mu_);
  forensic_dump_ = std::move(dump);
}

}  // namespace vramledger::guard
