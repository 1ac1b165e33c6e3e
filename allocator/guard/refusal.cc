// Formatting of refusal messages and category breakdowns (see refusal.h for the layout).
#include "guard/refusal.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "guard/size_spec.h"
#include "vramledger/device_allocator.h"

namespace vramledger::guard {

std::string FormatCategories(const std::vector<CategoryUsage>& categories) {
  std::vector<const CategoryUsage*> shown;
  for (const CategoryUsage& c : categories) {
    if (c.current > 0 || c.has_limit) shown.push_back(&c);
  }
  std::stable_sort(shown.begin(), shown.end(), [](const CategoryUsage* a, const CategoryUsage* b) {
    return a->current > b->current;
  });
  std::string out;
  for (const CategoryUsage* c : shown) {
    std::string plan = "-";
    std::string note;
    if (c->has_limit) {
      plan = FormatSize(c->limit);
      note = absl::StrCat("  (plan line ", c->line, ")");
      if (c->current > c->limit) absl::StrAppend(&note, "  OVER");
    }
    absl::StrAppend(&out, absl::StrFormat("    %-16s %12s / %-12s%s\n", c->name,
                                          FormatSize(c->current), plan, note));
  }
  if (out.empty()) out = "    (nothing live)\n";
  return out;
}

std::string FormatRefusal(const Refusal& r) {
  std::string out = absl::StrCat("vramledger plan violation: ", r.plan_path, ":", r.line, ": ",
                                 r.field, ": ", r.reason, "\n");
  absl::StrAppend(&out, "  request: ", FormatBytes(r.request_bytes), " on device ", r.device,
                  absl::StrFormat(", stream 0x%x", r.stream), ", tag '", r.tag, "'\n");
  absl::StrAppend(&out, "  live bytes by category (current / plan):\n",
                  FormatCategories(r.categories));
  absl::StrAppend(&out, "  allocated ", FormatBytes(r.allocated), ", reserved ",
                  FormatBytes(r.reserved));
  if (r.cap > 0) absl::StrAppend(&out, " (plan limit ", FormatSize(r.cap), ")");
  if (!r.complete) return out;
  absl::StrAppend(&out, ", largest free block ",
                  r.largest_free_block ? FormatBytes(*r.largest_free_block) : "unknown", "\n");
  absl::StrAppend(&out, "  stack (innermost first)",
                  r.stack_note.empty() ? "" : absl::StrCat(", ", r.stack_note), ":\n");
  if (r.frames.empty()) absl::StrAppend(&out, "    (no frames)\n");
  for (const StackFrame& f : r.frames) {
    absl::StrAppend(&out, "    ", f.python ? "" : "[native] ", FormatFrame(f), "\n");
  }
  if (!r.snapshot_path.empty()) {
    absl::StrAppend(&out, "  forensic snapshot: ", r.snapshot_path);
  } else {
    absl::StrAppend(&out, "  forensic snapshot: none",
                    r.snapshot_note.empty() ? "" : absl::StrCat(" (", r.snapshot_note, ")"));
  }
  return out;
}

}  // namespace vramledger::guard
