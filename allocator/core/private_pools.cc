// Private pools: begin/end/release with use counts, routing by stream filter, failed-capture
// pruning and the release of unused pools (private_pools.h). Not locked: the owner's mutex
// guards it.
#include "core/private_pools.h"

#include <algorithm>
#include <optional>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

namespace vramledger::core {

namespace {

std::string PoolName(MempoolId id) { return absl::StrFormat("(%d, %d)", id.first, id.second); }

}  // namespace

PrivatePools::Pool::Pool(MempoolId id, std::shared_ptr<SegmentSource> segment_source,
                         std::size_t large_page)
    : small(true, large_page > 0, large_page > 0 ? 2 * kMiB : 0),
      large(false, large_page > 0, large_page),
      source(std::move(segment_source)) {
  for (BlockPool* blocks : {&small, &large}) {
    blocks->owner = id;
    blocks->source = source.get();
  }
}

std::unique_ptr<PrivatePools::Pool> PrivatePools::MakePool(MempoolId id,
                                                           std::shared_ptr<SegmentSource> source,
                                                           std::size_t large_page) {
  auto pool = std::make_unique<Pool>(id, std::move(source), large_page);
  pool->incarnation = ++pools_made_;
  return pool;
}

absl::Status PrivatePools::CreateOrIncref(MempoolId id, std::shared_ptr<SegmentSource> source) {
  if (id == MempoolId{0, 0}) {
    return absl::InvalidArgumentError(
        "vramledger: (0, 0) is the default pool, not a private pool to create");
  }
  auto [it, created] = pools_.try_emplace(id);
  if (created) {
    it->second = MakePool(id, std::move(source));
    return absl::OkStatus();
  }
  if (source != nullptr) {  // torch: only the creation names the allocator
    return absl::InvalidArgumentError(
        absl::StrCat("vramledger: private pool ", PoolName(id),
                     " exists already; an allocator can only be given when it is created"));
  }
  ++it->second->use_count;
  return absl::OkStatus();
}

absl::Status PrivatePools::SetUseOnOOM(MempoolId id, bool use_on_oom) {
  auto it = pools_.find(id);
  if (it == pools_.end()) {
    return absl::NotFoundError(
        absl::StrCat("vramledger: set_use_on_oom of unknown private pool ", PoolName(id)));
  }
  it->second->use_on_oom = use_on_oom;
  return absl::OkStatus();
}

absl::Status PrivatePools::SetNoSplit(MempoolId id) {
  auto it = pools_.find(id);
  if (it == pools_.end()) {
    return absl::NotFoundError(
        absl::StrCat("vramledger: set_no_split of unknown private pool ", PoolName(id)));
  }
  it->second->small.no_split = true;
  it->second->large.no_split = true;
  return absl::OkStatus();
}

std::vector<PrivatePools::Pool*> PrivatePools::UseOnOomPools() {
  std::vector<Pool*> out;
  for (auto& [id, pool] : pools_) {
    if (pool->use_on_oom && pool->use_count > 0) out.push_back(pool.get());
  }
  return out;
}

absl::Status PrivatePools::CreateExpandable(MempoolId id, std::size_t large_page, int uses) {
  if (id == MempoolId{0, 0} || pools_.contains(id)) {
    return absl::InvalidArgumentError(
        absl::StrCat("vramledger: private pool ", PoolName(id), " exists, or is the default pool"));
  }
  auto pool = MakePool(id, nullptr, large_page);
  pool->use_count = uses;
  pools_.emplace(id, std::move(pool));
  return absl::OkStatus();
}

absl::Status PrivatePools::Begin(MempoolId id, StreamFilter filter, bool fallback) {
  PruneFailedCaptures();
  const std::thread::id self = std::this_thread::get_id();
  // As torch: a pool may be allocated to by several entries at once (use_mem_pool on two
  // threads or nested on one, a capture into the pool inside use_mem_pool of it); each entry
  // has its own filter and owner, and routing takes the first entry that accepts a stream.
  pruned_.erase(std::remove_if(pruned_.begin(), pruned_.end(),
                               [&](const Pruned& p) { return p.id == id && p.owner == self; }),
                pruned_.end());
  auto [it, created] = pools_.try_emplace(id);
  if (created) {
    it->second = MakePool(id);
  } else {
    ++it->second->use_count;  // shared: another graph or use_mem_pool allocates to it
  }
  Active active;
  active.id = id;
  active.filter = std::move(filter);
  active.owner = self;
  active.fallback = fallback;
  active_.push_back(std::move(active));
  return absl::OkStatus();
}

absl::Status PrivatePools::End(MempoolId id) {
  const std::thread::id self = std::this_thread::get_id();
  // The calling thread's own entry first (the innermost when nested), so one thread's end never
  // removes another thread's filter; then any entry of the pool, as torch does. Among its own,
  // one that served streams none of which captures any more: torch ends a stream's capture
  // before the pool's, so with two captures into one pool the entry of the one still capturing
  // stays (an entry that served nothing cannot tell, and is taken innermost first after these).
  // Only a capture's entry can be ended so: one that served capturing streams only, whose
  // filter no longer accepts them. A use_mem_pool entry (it served a stream that was not
  // capturing, or its filter still accepts) stays for its own end.
  auto ended = [&](const Active& a) {
    if (!a.saw_capture || a.served_plain || a.streams.empty()) return false;
    if (std::any_of(a.streams.begin(), a.streams.end(),
                    [&](StreamId s) { return backend_->IsCapturing(s); })) {
      return false;
    }
    return !(a.filter && a.owner == self && a.filter(a.streams.front()));
  };
  auto mine = std::find_if(active_.rbegin(), active_.rend(), [&](const Active& a) {
    return a.id == id && a.owner == self && ended(a);
  });
  if (mine == active_.rend()) {
    mine = std::find_if(active_.rbegin(), active_.rend(),
                        [&](const Active& a) { return a.id == id && a.owner == self; });
  }
  if (mine != active_.rend()) {
    // A region's entry is never a capture's (its EndRegion always comes).
    const bool served_nothing =
        !mine->fallback && (mine->streams.empty() || mine->may_hold_capture);
    active_.erase(std::next(mine).base());
    if (served_nothing) KeepCaptureCaution(id);
    return absl::OkStatus();
  }
  // Pruned as failed by a call of its own thread between the end of its capture and this one
  // (not torch's order, which makes no call in between): undo the lost use.
  auto pruned = std::find_if(pruned_.begin(), pruned_.end(),
                             [&](const Pruned& p) { return p.id == id && p.owner == self; });
  auto pool = pools_.find(id);
  if (pruned != pruned_.end() && pool != pools_.end()) {
    pruned_.erase(pruned);
    ++pool->second->use_count;
    return absl::OkStatus();
  }
  auto any =
      std::find_if(active_.begin(), active_.end(), [&](const Active& a) { return a.id == id; });
  if (any != active_.end()) {
    active_.erase(any);
    return absl::OkStatus();
  }
  return absl::NotFoundError(
      absl::StrCat("vramledger: private pool ", PoolName(id), " is not being allocated to"));
}

absl::StatusOr<int> PrivatePools::Release(MempoolId id) {
  auto it = pools_.find(id);
  if (it == pools_.end() || it->second->use_count <= 0) {
    return absl::NotFoundError(
        absl::StrCat("vramledger: release of unknown private pool ", PoolName(id)));
  }
  // Each allocation to the pool under way (a capture, use_mem_pool) holds a use until its End:
  // releasing that use would let the pool's memory go while blocks are still routed to it.
  const auto entries =
      std::count_if(active_.begin(), active_.end(), [&](const Active& a) { return a.id == id; });
  if (it->second->use_count <= entries) {
    return absl::FailedPreconditionError(absl::StrCat(
        "vramledger: release of private pool ", PoolName(id), " while ", entries,
        " allocation(s) to it (a capture or use_mem_pool) have not ended; end them first"));
  }
  return --it->second->use_count;
}

int PrivatePools::UseCount(MempoolId id) const {
  auto it = pools_.find(id);
  return it == pools_.end() ? 0 : it->second->use_count;
}

BlockPool* PrivatePools::Route(StreamId stream, std::size_t rounded) {
  // Every other entry before a region's (fallback), so a pool created inside a region (a
  // capture's) takes what it accepts.
  for (const bool fallback : {false, true}) {
    if (BlockPool* pool = RouteAmong(stream, rounded, fallback); pool != nullptr) return pool;
  }
  return nullptr;
}

BlockPool* PrivatePools::RouteAmong(StreamId stream, std::size_t rounded, bool fallback) {
  auto serves = [&](Active& active) {
    if (active.fallback != fallback || !active.filter || !active.filter(stream)) return false;
    if (std::find(active.streams.begin(), active.streams.end(), stream) == active.streams.end()) {
      active.streams.push_back(stream);
    }
    if (backend_->IsCapturing(stream)) {
      active.saw_capture = true;
    } else {
      active.served_plain = true;  // a capture's filter accepts capturing streams only
    }
    return true;
  };
  Active* found = nullptr;
  if (!fallback) {
    // torch's entries: the first whose filter accepts (torch's get_pool).
    for (Active& active : active_) {
      if (serves(active)) {
        found = &active;
        break;
      }
    }
  } else {
    // Regions' entries: the innermost, the region a pool created here joins.
    for (auto it = active_.rbegin(); it != active_.rend(); ++it) {
      if (serves(*it)) {
        found = &*it;
        break;
      }
    }
  }
  if (found == nullptr) return nullptr;
  Pool& pool = *pools_.at(found->id);
  return rounded <= 1 * kMiB ? &pool.small : &pool.large;
}

void PrivatePools::PruneFailedCaptures() {
  for (auto it = active_.begin(); it != active_.end();) {
    if (it->fallback) {  // a region's entry is no capture's: its EndRegion always comes
      ++it;
      continue;
    }
    bool over = it->saw_capture && !it->served_plain &&
                std::none_of(it->streams.begin(), it->streams.end(),
                             [&](StreamId s) { return backend_->IsCapturing(s); });
    // A use_mem_pool entry that has served only a capture so far looks like one; on its own
    // thread its filter still accepts a stream that no longer captures, a capture's does not.
    if (over && it->owner == std::this_thread::get_id() && it->filter &&
        it->filter(it->streams.front())) {
      it->served_plain = true;
      over = false;
    }
    if (!over) {
      it->ended_seen = absl::InfiniteFuture();
      ++it;
      continue;
    }
    if (it->owner != std::this_thread::get_id()) {  // maybe between EndCapture and End
      const absl::Time now = absl::Now();
      if (it->ended_seen == absl::InfiniteFuture()) it->ended_seen = now;
      if (now - it->ended_seen < kFailedCaptureGrace) {
        ++it;
        continue;
      }
    }
    if (auto pool = pools_.find(it->id); pool != pools_.end()) {
      --pool->second->use_count;  // no End and no Release will come for this capture
    }
    pruned_.push_back({it->id, it->owner});
    it = active_.erase(it);
  }
}

void PrivatePools::KeepCaptureCaution(MempoolId id) {
  // Even when an entry of the thread routed a capture that has ended, the End may have been
  // that entry's while the removed one was a second capture into the pool, still under way (two
  // captures into one pool on two streams, the first ended). torch counts every open entry as a
  // capture under way (its free defers events while captures_underway is not empty): the kept
  // entry does so too until its own End.
  const std::thread::id self = std::this_thread::get_id();
  Active* kept = nullptr;  // the thread's innermost entry of `id` left
  for (Active& a : active_) {
    if (a.id == id && a.owner == self && !a.fallback) kept = &a;
  }
  if (kept != nullptr) kept->may_hold_capture = true;
}

const PrivatePools::Active* PrivatePools::FindCapture(std::optional<StreamId>* stream) const {
  for (const Active& active : active_) {
    if (active.fallback) continue;  // a region's entry: never a capture's
    for (StreamId s : active.streams) {
      if (backend_->IsCapturing(s)) {
        if (stream != nullptr) *stream = s;
        return &active;
      }
    }
  }
  for (const Active& active : active_) {
    // May be capturing without having allocated, or kept for a capture that may go on.
    if (!active.fallback && (active.streams.empty() || active.may_hold_capture)) return &active;
  }
  return nullptr;
}

bool PrivatePools::CaptureUnderway() {
  if (active_.empty()) return false;
  PruneFailedCaptures();
  return FindCapture(nullptr) != nullptr;
}

std::string PrivatePools::DescribeCapture() const {
  std::optional<StreamId> stream;
  const Active* active = FindCapture(&stream);
  if (active == nullptr) return "none seen";
  if (stream.has_value()) {
    return absl::StrCat("stream ", *stream, " captures into private pool ", PoolName(active->id));
  }
  return absl::StrCat("a capture into private pool ", PoolName(active->id),
                      " may be under way: it has begun and not ended");
}

absl::Status PrivatePools::ReleaseUnused(absl::FunctionRef<absl::Status(BlockPool*)> release,
                                         absl::FunctionRef<bool(const Pool&)> has_segments,
                                         const MempoolId* only) {
  for (auto it = pools_.begin(); it != pools_.end();) {
    Pool& pool = *it->second;
    if (pool.use_count > 0 || (only != nullptr && it->first != *only)) {
      ++it;
      continue;
    }
    for (BlockPool* blocks : {&pool.large, &pool.small}) {
      if (absl::Status s = release(blocks); !s.ok()) return s;
    }
    if (has_segments(pool)) {
      ++it;
    } else {
      it = pools_.erase(it);
    }
  }
  return absl::OkStatus();
}

std::int64_t PrivatePools::FreeBlocks() const {
  std::int64_t n = 0;
  for (const auto& [id, pool] : pools_) {
    n += static_cast<std::int64_t>(pool->small.blocks.size() + pool->large.blocks.size());
  }
  return n;
}

absl::Status PrivatePools::CheckInvariants() const {
  auto fail = [](MempoolId id, auto&&... parts) {
    return absl::InternalError(absl::StrCat("private pool ", PoolName(id), ": ", parts...));
  };
  absl::flat_hash_map<MempoolId, int> entries;  // active entries per pool
  for (const Active& a : active_) {
    if (!pools_.contains(a.id)) return fail(a.id, "active but unknown");
    ++entries[a.id];
  }
  for (const auto& [id, pool] : pools_) {
    if (pool->use_count < 0) return fail(id, "use count ", pool->use_count);
    // Each entry took a use that only a Release after its End gives back.
    if (auto n = entries.find(id); n != entries.end() && pool->use_count < n->second) {
      return fail(id, n->second, " active entries but a use count of ", pool->use_count);
    }
    for (const BlockPool* blocks : {&pool->small, &pool->large}) {
      if (blocks->owner != id) return fail(id, "a block pool names another owner");
      if (blocks->source != pool->source.get()) return fail(id, "a block pool's source differs");
      if (blocks->expandable != pool->small.expandable) return fail(id, "half expandable");
      if (blocks->expandable && blocks->source != nullptr) {
        return fail(id, "expandable with a segment source");
      }
    }
    if (pool->small.no_split != pool->large.no_split) return fail(id, "no_split set on one half");
    for (const BlockPool* blocks : {&pool->small, &pool->large}) {
      if (absl::Status s = blocks->blocks.CheckInvariants(); !s.ok()) {
        return fail(id, s.message());
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace vramledger::core
