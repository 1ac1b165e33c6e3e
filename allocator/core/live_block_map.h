// The live-block map: device address -> Block* of every allocated or pending-free block, the one
// lookup Free needs. Open addressing with linear probing and backward-shift deletion (no
// tombstones), so a find, insert or erase on the hot path is a multiply and a short probe
// (docs/design/locking.md, "Hot path"). Plain data: the owner's mutex guards every instance.
#ifndef VRAMLEDGER_CORE_LIVE_BLOCK_MAP_H_
#define VRAMLEDGER_CORE_LIVE_BLOCK_MAP_H_

#include <bit>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "vramledger/types.h"

namespace vramledger::core {

struct Block;

/// A hash map from a nonzero address to a block. Address 0 is never a key (it marks empty slots;
/// Malloc never stores the null pointer of a size-0 request).
class LiveBlockMap {
 public:
  LiveBlockMap() { Resize(kInitialSlots); }

  /// The block at `ptr`, or nullptr when none is live there.
  Block* Find(DevicePtr ptr) const {
    if (ptr == 0) return nullptr;
    for (std::size_t i = Home(ptr);; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.key == ptr) return s.value;
      if (s.key == 0) return nullptr;
    }
  }

  /// Maps `ptr` (nonzero) to `block`, replacing any previous block there.
  void Insert(DevicePtr ptr, Block* block) {
    if ((size_ + 1) * 4 > slots_.size() * 3) Resize(slots_.size() * 2);  // load <= 3/4
    for (std::size_t i = Home(ptr);; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.key == ptr) {
        s.value = block;
        return;
      }
      if (s.key == 0) {
        s = Slot{ptr, block};
        ++size_;
        return;
      }
    }
  }

  /// Find that also returns, in `*slot`, where the block is, for EraseAt (one probe for a
  /// lookup followed by an erase, as Free does).
  Block* Find(DevicePtr ptr, std::size_t* slot) const {
    if (ptr == 0) return nullptr;
    for (std::size_t i = Home(ptr);; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.key == ptr) {
        *slot = i;
        return s.value;
      }
      if (s.key == 0) return nullptr;
    }
  }

  /// Removes `ptr`; false if it was not there.
  bool Erase(DevicePtr ptr) {
    std::size_t i = 0;
    if (Find(ptr, &i) == nullptr) return false;
    EraseAt(i);
    return true;
  }

  /// Removes the entry at `slot`, as returned by Find(ptr, &slot) with no change in between.
  void EraseAt(std::size_t slot) {
    std::size_t i = slot;
    // Backward shift: pull later entries of the probe run into the hole, so no tombstone is left
    // and a probe still stops at the first empty slot.
    for (std::size_t j = (i + 1) & mask_;; j = (j + 1) & mask_) {
      const DevicePtr key = slots_[j].key;
      if (key == 0) break;
      const std::size_t home = Home(key);
      // The entry at j may move to the hole at i unless its home lies cyclically in (i, j].
      if (((j - home) & mask_) >= ((j - i) & mask_)) {
        slots_[i] = slots_[j];
        i = j;
      }
    }
    slots_[i] = Slot{};
    --size_;
  }

  /// Number of live blocks.
  std::size_t size() const { return size_; }

 private:
  struct Slot {
    DevicePtr key = 0;
    Block* value = nullptr;
  };
  static constexpr std::size_t kInitialSlots = 1024;

  // Fibonacci hashing on the address without its 9 always-zero bits (blocks are 512-aligned).
  std::size_t Home(DevicePtr ptr) const {
    return static_cast<std::size_t>(((ptr >> 9) * 0x9E3779B97F4A7C15ull) >> shift_);
  }

  void Resize(std::size_t slots) {  // `slots`: a power of two
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(slots, Slot{});
    mask_ = slots - 1;
    shift_ = 64 - std::countr_zero(slots);
    size_ = 0;
    for (const Slot& s : old) {
      if (s.key != 0) Insert(s.key, s.value);
    }
  }

  std::vector<Slot> slots_;
  std::size_t mask_ = 0;
  int shift_ = 64;
  std::size_t size_ = 0;
};

}  // namespace vramledger::core

#endif  // VRAMLEDGER_CORE_LIVE_BLOCK_MAP_H_
