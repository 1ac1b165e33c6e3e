// Blocks and segments, and the set type under a pool's free index (free_block_index.h). Plain
// data; the owning DeviceAllocatorImpl guards every instance with its mutex
// (docs/design/locking.md).
#ifndef VRAMLEDGER_CORE_BLOCK_H_
#define VRAMLEDGER_CORE_BLOCK_H_

#include <cstddef>
#include <cstdint>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "vramledger/types.h"

namespace vramledger::core {

struct Block;
struct BlockPool;
struct Segment;

/// Best-fit order: (stream, size, address). lower_bound({stream, size, 0}) is the smallest
/// free block of that stream that fits, the lowest address among equals.
struct BlockBestFitLess {
  bool operator()(const Block* a, const Block* b) const;
};

/// Free list of tree nodes shared by the copies of one NodeRecycler. Guarded by the owner's mutex.
struct NodeFreeList {
  std::vector<void*> nodes;
  ~NodeFreeList() {
    for (void* n : nodes) ::operator delete(n);
  }
};

/// An allocator for std::set nodes that keeps freed nodes for reuse, so inserting and erasing
/// free blocks on the hot path makes no heap call. (Measured with callgrind, instructions per
/// alloc+free pair: absl::btree_set 2500, std::pmr pool resource 2680, this ~1700.)
template <typename T>
struct NodeRecycler {
  using value_type = T;
  explicit NodeRecycler(NodeFreeList* list) : list(list) {}
  template <typename U>
  NodeRecycler(const NodeRecycler<U>& other) : list(other.list) {}  // NOLINT: rebinding
  T* allocate(std::size_t n) {
    if (n == 1 && !list->nodes.empty()) {
      void* p = list->nodes.back();
      list->nodes.pop_back();
      return static_cast<T*>(p);
    }
    return static_cast<T*>(::operator new(n * sizeof(T)));
  }
  void deallocate(T* p, std::size_t n) {
    if (n == 1) {
      list->nodes.push_back(p);
    } else {
      ::operator delete(p);
    }
  }
  template <typename U>
  bool operator==(const NodeRecycler<U>& other) const {
    return list == other.list;
  }
  NodeFreeList* list;
};

/// The set type under a pool's free index (FreeBlockIndex, free_block_index.h).
using FreeIndexSet = std::set<Block*, BlockBestFitLess, NodeRecycler<Block*>>;

/// A contiguous piece of a segment: allocated, pending free (waiting on events) or free.
/// Blocks of one segment form a doubly linked list in address order.
struct Block {
  DevicePtr ptr = 0;
  std::size_t size = 0;            // bytes, a multiple of 512
  std::size_t requested_size = 0;  // the caller's size while allocated or pending free
  StreamId stream = 0;             // the allocation stream; the block is reused only by it
  BlockPool* pool = nullptr;
  Segment* segment = nullptr;
  Block* prev = nullptr;
  Block* next = nullptr;
  bool allocated = false;
  int event_count = 0;                // outstanding record_stream events
  std::uint32_t tag = 0;              // AllocatorHooks::CurrentTag at allocation
  std::uint64_t context = 0;          // AllocatorHooks::CaptureContext at allocation
  std::uint64_t free_context = 0;     // ... at the free request
  std::vector<StreamId> stream_uses;  // other streams that used it (record_stream)
  // garbage_collection_threshold: the pool's free-block lookups (BlockPool::free_lookups) when it
  // was last freed; its age is the lookups since.
  std::uint64_t gc_base = 0;
  // Its node in the pool's FreeBlockIndex while indexed (set by FreeBlockIndex::insert; stale
  // otherwise): coalescing reaches a free neighbour's node without a search.
  FreeIndexSet::iterator index_pos;

  /// Back to a default-constructed block, keeping stream_uses' capacity (NewBlock's reuse).
  void Reset() {
    ptr = 0;
    size = requested_size = 0;
    stream = 0;
    pool = nullptr;
    segment = nullptr;
    prev = next = nullptr;
    allocated = false;
    event_count = 0;
    tag = 0;
    context = free_context = 0;
    stream_uses.clear();
    gc_base = 0;
  }

  bool is_split() const { return prev != nullptr || next != nullptr; }
  bool is_free() const { return !allocated && event_count == 0; }
};

/// One cudaMalloc'd range, or one expandable segment (a reserved virtual range whose pages are
/// mapped on demand; docs/design/expandable-segments.md). `head` is the block at its first byte.
struct Segment {
  DevicePtr ptr = 0;
  std::size_t size = 0;  // bytes of the cudaMalloc, or of the virtual reservation
  StreamId stream = 0;
  BlockPool* pool = nullptr;
  Block* head = nullptr;
  // Expandable segments only: page size and the physical handle mapped at each page (0 = none).
  bool expandable = false;
  std::size_t page_size = 0;
  std::vector<PhysicalHandle> pages;
  // Pages whose address still maps a handle that moved away (an old mapping: core/old_mappings.h);
  // pages[i] is 0 there. kOldMappingInUse until its fence completes; kOldMappingIdle after, when
  // keep_old_mappings keeps it.
  static constexpr std::uint8_t kOldMappingInUse = 1;
  static constexpr std::uint8_t kOldMappingIdle = 2;
  std::vector<std::uint8_t> old_mapping;
  // The handle of the old mapping at each page (0 = none), and the allocated or pending-free
  // blocks touching each page (0: the page is free; PageTable::CountUse).
  std::vector<PhysicalHandle> old_handle;
  std::vector<std::uint32_t> use;
  // Per page with an old mapping: the first page where its handle was last found mapped in this
  // segment, or kNoHomeHint. A cache for OldMappings::Reusable, which checks it against
  // `pages` on every use (a stale hint costs only the page-table home lookup it saves).
  static constexpr std::uint32_t kNoHomeHint = UINT32_MAX;
  mutable std::vector<std::uint32_t> old_home_hint;
  std::size_t mapped_pages = 0;
  std::size_t page_limit = 0;  // 1 + the highest page index ever mapped (bounds page walks)

  std::size_t PageOf(DevicePtr p) const { return (p - ptr) / page_size; }
  // One past the last page of the handle mapped at page i (a handle's pages are consecutive and
  // carry its id; two neighbouring handles never share one).
  std::size_t HandleEnd(std::size_t i) const {
    const PhysicalHandle h = pages[i];
    std::size_t j = i + 1;
    while (j < page_limit && pages[j] == h) ++j;
    return j;
  }
  DevicePtr PageAddress(std::size_t i) const { return ptr + i * page_size; }
};

inline bool BlockBestFitLess::operator()(const Block* a, const Block* b) const {
  return std::tie(a->stream, a->size, a->ptr) < std::tie(b->stream, b->size, b->ptr);
}

}  // namespace vramledger::core

#endif  // VRAMLEDGER_CORE_BLOCK_H_
