// Options: the allocator's struct, the process's struct, and one table-driven parser for the
// `key:value,...` syntax of PYTORCH_CUDA_ALLOC_CONF. Parsed once at the edge; no global state.
#ifndef VRAMLEDGER_OPTIONS_H_
#define VRAMLEDGER_OPTIONS_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "vramledger/types.h"

namespace vramledger {

/// Number of power-of-two intervals of `roundup_power2_divisions` (1 MiB ... 64 GiB), as torch.
inline constexpr int kRoundupPower2Intervals = 16;

/// Settings of the process around the allocators (plan, forensics, step log, the LD_PRELOAD
/// shim's switches). Written in the same settings string as the allocator's keys; the routes into a
/// process read them, the device allocator never does.
struct ProcessOptions {
  /// `plan`: path of the memory plan file; empty = no plan.
  std::string plan;
  /// `dump_dir`: where OOM forensics go.
  std::string dump_dir = "./vramledger-dumps";
  /// `max_dumps`: at most this many forensic dumps are kept.
  int max_dumps = 8;
  /// `step_log`: directory of the per-step peak logs written by vramledger.step()
  /// (<dir>/vramledger-steps-rank<R>.jsonl); empty = no log.
  std::string step_log;
  /// `preload_quiet` (environment VRAMLEDGER_PRELOAD_QUIET): the shim prints no summary.
  bool preload_quiet = false;
  /// `preload_no_exit_dump` (VRAMLEDGER_PRELOAD_NO_EXIT_DUMP): no dump at the process's exit.
  bool preload_no_exit_dump = false;
  /// `preload_disable` (VRAMLEDGER_PRELOAD_DISABLE): the shim forwards every call to CUDA.
  bool preload_disable = false;
};

/// Every setting of one device allocator. Torch's keys keep torch's meaning (the same names,
/// units and accepted values as PYTORCH_CUDA_ALLOC_CONF).
struct Options {
  /// `max_split_size_mb`: blocks of this size or more are never split; SIZE_MAX = unlimited.
  std::size_t max_split_size = SIZE_MAX;
  /// `max_non_split_rounding_mb`: an oversize request may take a cached oversize block only if
  /// the block is smaller than request + this.
  std::size_t max_non_split_rounding = 20 * kMiB;
  /// `garbage_collection_threshold` in (0, 1); 0 = off. Only active with a memory fraction:
  /// before a new plain segment, above threshold x the cap, the large pool's oldest whole cached
  /// segments are returned (torch's garbage_collect_cached_blocks; not expandable memory).
  double garbage_collection_threshold = 0.0;
  /// `expandable_segments` (torch's key).
  bool expandable_segments = false;
  /// `large_segment_size_mb`: the segment size for 1-10 MiB requests (the request rounded up to
  /// 2 MiB when that is larger).
  std::size_t large_segment_size = 20 * kMiB;
  /// `roundup_power2_divisions`: divisions per power-of-two interval starting at 1 MiB.
  std::array<std::size_t, kRoundupPower2Intervals> roundup_power2_divisions{};
  /// `release_lock_on_cudamalloc` (accepted for compatibility; see docs/design/locking.md).
  bool release_lock_on_cudamalloc = false;
  /// `per_process_memory_fraction` in [0, 1]; 0 = no cap. Cap on reserved = fraction x total.
  double per_process_memory_fraction = 0.0;
  /// `page_recycling` (vramledger): move whole free pages of expandable segments before growing.
  bool page_recycling = true;
  /// `expandable_page_mb` (vramledger): physical page (handle) size of large-pool expandable
  /// segments, a multiple of 2 MiB; the small pool always uses 2 MiB pages.
  /// Chosen by measurement: docs/design/expandable-segments.md.
  std::size_t expandable_page_size = 6 * kMiB;
  /// `recycle_slack` (vramledger): pages are recycled only when growing would take reserved past
  /// (1 + slack) x the peak of allocated bytes. Larger: fewer page moves per step, lower
  /// utilization (docs/design/page-recycling.md, "Recycling"; 0.006 since
  /// keep_old_mappings: under a lagging GPU it kept the replay at 1.01 or less, "Old mappings
  /// kept").
  double recycle_slack = 0.006;
  /// `recycle_tails_first` (vramledger): when pages are recycled, take each segment's free tail
  /// (highest pages first) before the holes (smallest first). Fewer page moves where the same
  /// small holes are emptied and refilled every step (checkpointed training: -25% driver calls
  /// on the H200), more where steps set new peaks (Llama-1B: +25%), and a looser fit on the
  /// H200 (page-recycling.md, "Recycling").
  bool recycle_tails_first = false;
  /// `grow_under_cap` (vramledger): under a per-process memory fraction, reserved grows into the
  /// room below the cap before pages move: pages are recycled only when growing would take
  /// reserved past (1 - recycle_slack) x the cap (and past the slack over peak allocated). The
  /// cap is the memory the process was granted; moving pages while it has room costs driver
  /// calls in every step and buys nothing (Llama-1B with checkpointing, 80 GiB cap, batch 51 of
  /// the 60 that fit: 5,423 page moves and 13% longer steps on the H200; page-recycling.md,
  /// "Under a cap"). False: recycle as without a cap, keeping reserved at its tightest.
  bool grow_under_cap = true;
  /// `keep_old_mappings` (vramledger): a handle that moved keeps its old mapping after the work
  /// queued there has finished, until that address is needed for another handle (or empty_cache);
  /// a later allocation over the old address while the handle lies free takes it back with no
  /// driver call (page-recycling.md, "Old mappings kept").
  bool keep_old_mappings = true;
  /// `host_timing` (vramledger): time every Malloc and Free on the host (DeviceAllocator::
  /// host_time, fragmentation()["host_time"]; the LD_PRELOAD shim also times its interposed
  /// calls). Off by default: two clock reads and two atomic adds per call, 60-90 ns on a 2-core
  /// VM (replay_bench, ~25% of the allocator's own time there).
  bool host_timing = false;
  /// `expandable_handle_mb` (vramledger): the largest physical handle created for one run of
  /// missing pages of an expandable segment, in bytes (a multiple of the page size, checked when
  /// the options are parsed; 0 = one handle per page). A run of k new pages takes
  /// ceil(k x page / this) handles instead of k, which cuts
  /// cuMemCreate and the per-handle cuMemSetAccess cost (docs/design/expandable-segments.md).
  std::size_t expandable_handle_size = 0;
  /// Process settings given in the same settings string (ProcessOptions); the allocator never
  /// reads them, the routes into a process do.
  ProcessOptions process;
  /// The settings string this struct was parsed from (reported in snapshots, as torch does).
  std::string conf_string;
};

/// Which struct an option sets: the device allocator's Options, or the process's ProcessOptions.
enum class OptionScope { kAllocator, kProcess };

/// One documented option, as `vramledger options` and docs/options.md show it.
struct OptionDoc {
  std::string name;
  OptionScope scope = OptionScope::kAllocator;
  std::string type;           // bool, MiB, fraction, int, path, divisions, choice
  std::string default_value;  // as written in a settings string ("" = empty)
  std::string accepted;       // the accepted values, as errors name them
  std::string doc;            // meaning, one line
  std::string env;            // environment variable that also sets it ("" = none)
};

/// Every accepted key: the allocator's in the order shown in errors, then the process's.
const std::vector<OptionDoc>& OptionTable();

/// "allocator" or "process".
std::string_view OptionScopeName(OptionScope scope);

/// docs/options.md: the tables of both scopes and the environment variables, as Markdown.
std::string OptionsMarkdown();

/// Parses `conf` (`key:value,key:value`, whitespace ignored, lists in [...]) on top of `base`;
/// each key goes to the table that owns it (allocator keys to `Options`, process keys to
/// `Options::process`). Booleans must be `True` or `False`, as torch requires.
/// Errors: InvalidArgument naming the key and the accepted values, e.g.
///   "unknown option 'foo' in 'foo:1'; accepted keys: max_split_size_mb, ..."
absl::StatusOr<Options> ParseOptions(std::string_view conf, const Options& base = Options());

/// Writes options back as a settings string that ParseOptions accepts (every key, sorted).
std::string OptionsToString(const Options& options);

/// Defaults, then each process option's own environment variable (OptionDoc::env; a switch is
/// True when its variable is set, whatever its value), then VRAMLEDGER_CONF (if set), then
/// `explicit_conf` (which wins). conf_string holds VRAMLEDGER_CONF and `explicit_conf` only.
/// `defaults` are the options before any of them: torch's (Options()) for the replay and the
/// planner, RuntimeDefaults() for a process that vramledger serves.
absl::StatusOr<Options> OptionsFromEnvAndString(std::string_view explicit_conf,
                                                const Options& defaults = Options());

/// The defaults of a process served by vramledger (install(), the LD_PRELOAD shim): torch's,
/// with expandable segments on (page recycling is on by default). Memory then grows by pages
/// that free ones are recycled into, which is where vramledger's utilization comes from;
/// `expandable_segments:False` gives torch's plain policy. The replay and the planner keep
/// torch's defaults, so that their figures compare against torch's allocator as it ships.
Options RuntimeDefaults();

}  // namespace vramledger

#endif  // VRAMLEDGER_OPTIONS_H_
