// The page tables of one device's expandable segments (page_table.h): ranges, mapped handles and
// their homes, per-page use counts, and what driver errors left behind.
#include "core/page_table.h"
#include "core/free_block_index.h"

#include <algorithm>

#include "absl/algorithm/container.h"
#include "absl/strings/str_cat.h"

namespace vramledger::core {

Segment* PageTable::AddSegment(DevicePtr va, std::size_t pages, std::size_t page_size,
                               StreamId stream, BlockPool* pool) {
  auto segment = std::make_unique<Segment>();
  segment->ptr = va;
  segment->size = pages * page_size;
  segment->stream = stream;
  segment->pool = pool;
  segment->expandable = true;
  segment->page_size = page_size;
  segment->pages.assign(pages, 0);
  segment->old_mapping.assign(pages, 0);
  segment->old_handle.assign(pages, 0);
  segment->use.assign(pages, 0);
  segment->old_home_hint.assign(pages, Segment::kNoHomeHint);
  segments_.push_back(std::move(segment));
  return segments_.back().get();
}

std::size_t PageTable::RangeBytes(std::size_t page_size) const {
  if (device_total_bytes_ == 0) return SIZE_MAX;
  return (device_total_bytes_ + device_total_bytes_ / 8 + page_size - 1) / page_size * page_size;
}

void PageTable::Map(Segment* seg, std::size_t first, std::size_t pages, PhysicalHandle handle) {
  std::fill_n(seg->pages.begin() + static_cast<std::ptrdiff_t>(first), pages, handle);
  homes_[handle] = {seg, first};
  seg->mapped_pages += pages;
  seg->page_limit = std::max(seg->page_limit, first + pages);
}

PhysicalHandle PageTable::Unmap(Segment* seg, std::size_t page, std::size_t* pages) {
  const std::size_t k = seg->HandleEnd(page) - page;
  const PhysicalHandle handle = seg->pages[page];
  std::fill_n(seg->pages.begin() + static_cast<std::ptrdiff_t>(page), k, PhysicalHandle{0});
  homes_.erase(handle);
  seg->mapped_pages -= k;
  *pages = k;
  return handle;
}

void PageTable::MarkInaccessible(const Segment* seg, std::size_t page, absl::Status error) {
  inaccessible_pages_.insert({seg, page});
  if (inaccessible_.ok()) inaccessible_ = std::move(error);
}

bool PageTable::ForgetUnreleased(PhysicalHandle handle) {
  const auto it = absl::c_find(unreleased_, handle);
  if (it == unreleased_.end()) return false;
  unreleased_.erase(it);
  return true;
}

absl::Status PageTable::CheckInvariants() const {
  auto fail = [](auto&&... parts) { return absl::InternalError(absl::StrCat(parts...)); };
  std::size_t handles = 0;
  for (const auto& seg : segments_) {
    // Segment::use: the blocks not free (allocated or pending free) touching each page.
    std::vector<std::uint32_t> use(seg->pages.size(), 0);
    for (const Block* b = seg->head; b != nullptr; b = b->next) {
      if (b->is_free()) continue;
      for (std::size_t i = seg->PageOf(b->ptr); i <= seg->PageOf(b->ptr + b->size - 1); ++i) {
        ++use[i];
      }
    }
    for (std::size_t i = 0; i < use.size(); ++i) {
      if (use[i] != seg->use[i]) {
        return fail("page ", i, " of the segment at 0x", absl::Hex(seg->ptr), " is used by ",
                    use[i], " blocks but counted ", seg->use[i]);
      }
    }
    std::size_t mapped = 0;
    for (std::size_t i = 0; i < seg->page_limit; ++i) {
      const PhysicalHandle h = seg->pages[i];
      if (h != 0) ++mapped;
      if (h == 0 || (i > 0 && seg->pages[i - 1] == h)) continue;
      ++handles;
      const Home* home = HomeOf(h);
      if (home == nullptr || home->first != seg.get() || home->second != i) {
        return fail("handle mapped at page ", i, " has no or another home");
      }
    }
    for (std::size_t i = seg->page_limit; i < seg->pages.size(); ++i) {
      if (seg->pages[i] != 0) return fail("page ", i, " mapped past the page limit");
    }
    if (mapped != seg->mapped_pages) {
      return fail("the segment at 0x", absl::Hex(seg->ptr), " counts ", seg->mapped_pages,
                  " mapped pages, its table holds ", mapped);
    }
  }
  if (handles != homes_.size()) {
    return fail(homes_.size(), " homes for ", handles, " mapped handles");
  }
  return absl::OkStatus();
}

}  // namespace vramledger::core
