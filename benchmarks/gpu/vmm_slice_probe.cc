// Measures what a cuMemSetAccess costs when the pages it covers are slices of one physical
// handle (cuMemMap with an offset) rather than one handle each, and whether a slice can be
// unmapped and mapped elsewhere on its own (if the driver maps at an offset at all). Why:
// the replay's driver time is ~70% cuMemSetAccess, charged per mapping from
// h200-vmm-latency.txt, which measured separate handles only. On the H200 (CUDA 13 driver) an
// offset mapping is CUDA_ERROR_NOT_SUPPORTED (docs/design/expandable-segments.md). Prints one line
// per layout (medians of kReps) and exits 0; any driver error exits 1.
//
//   build: ninja vramledger_vmm_slice_probe (benchmarks/CMakeLists.txt), or
//          g++ -O2 -std=c++17 -I$CUDA/include vmm_slice_probe.cc -L$CUDA/lib64/stubs -lcuda
//   run:   vmm_slice_probe [page_mib=6] [pages=64]
#include <cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

constexpr int kReps = 9;

void Check(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return;
  const char* name = nullptr;
  cuGetErrorName(r, &name);
  std::fprintf(stderr, "vmm_slice_probe: %s failed: %s\n", what, name ? name : "?");
  std::exit(1);
}

double Micros(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Env {
  CUmemAllocationProp prop{};
  CUmemAccessDesc access{};
};

CUmemGenericAllocationHandle Create(const Env& env, size_t bytes) {
  CUmemGenericAllocationHandle h;
  Check(cuMemCreate(&h, bytes, &env.prop, 0), "cuMemCreate");
  return h;
}

}  // namespace

int main(int argc, char** argv) {
  const size_t page = (argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 6) << 20;
  const int pages = argc > 2 ? std::atoi(argv[2]) : 64;
  const size_t span = page * pages;
  Check(cuInit(0), "cuInit");
  CUdevice dev;
  Check(cuDeviceGet(&dev, 0), "cuDeviceGet");
  CUcontext ctx;
  Check(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  Check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
  Env env;
  env.prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  env.prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  env.prop.location.id = 0;
  env.access.location = env.prop.location;
  env.access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUdeviceptr va;
  Check(cuMemAddressReserve(&va, 2 * span, 0, 0, 0), "cuMemAddressReserve");

  std::vector<double> create_each, create_one, access_handles, access_slices, access_one;
  std::vector<double> unmap_slices, move_slice, map_slices;
  bool offsets_supported = true;
  for (int rep = 0; rep < kReps; ++rep) {
    // (a) one handle per page, each its own mapping; one cuMemSetAccess over the range.
    std::vector<CUmemGenericAllocationHandle> hs(pages);
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < pages; ++i) hs[i] = Create(env, page);
    auto t1 = std::chrono::steady_clock::now();
    for (int i = 0; i < pages; ++i) Check(cuMemMap(va + i * page, page, 0, hs[i], 0), "map a");
    auto t2 = std::chrono::steady_clock::now();
    Check(cuMemSetAccess(va, span, &env.access, 1), "access a");
    auto t3 = std::chrono::steady_clock::now();
    create_each.push_back(Micros(t0, t1));
    access_handles.push_back(Micros(t2, t3));
    for (int i = 0; i < pages; ++i) Check(cuMemUnmap(va + i * page, page), "unmap a");
    for (auto h : hs) Check(cuMemRelease(h), "release a");

    // (b) one handle for the whole span, mapped page by page at offsets; one cuMemSetAccess.
    t0 = std::chrono::steady_clock::now();
    CUmemGenericAllocationHandle big = Create(env, span);
    t1 = std::chrono::steady_clock::now();
    if (!offsets_supported) {
      Check(cuMemRelease(big), "release b");
    } else if (CUresult r = cuMemMap(va + page, page, page, big, 0); r != CUDA_SUCCESS) {
      // The driver may refuse any offset but 0 (the docs of older releases: "must be zero").
      const char* name = nullptr;
      cuGetErrorName(r, &name);
      std::printf("  (b) cuMemMap at offset %zu MiB into a %zu MiB handle: %s\n", page >> 20,
                  span >> 20, name ? name : "?");
      offsets_supported = false;
      Check(cuMemRelease(big), "release b");
    } else {
      Check(cuMemUnmap(va + page, page), "unmap b probe");
    }
    if (offsets_supported) {
      for (int i = 0; i < pages; ++i) {
        Check(cuMemMap(va + i * page, page, i * page, big, 0), "map b (offset)");
      }
      t2 = std::chrono::steady_clock::now();
      Check(cuMemSetAccess(va, span, &env.access, 1), "access b");
      t3 = std::chrono::steady_clock::now();
      create_one.push_back(Micros(t0, t1));
      map_slices.push_back(Micros(t1, t2));
      access_slices.push_back(Micros(t2, t3));
      // A move: unmap one slice and map it in the second half of the range, with its access.
      t0 = std::chrono::steady_clock::now();
      Check(cuMemUnmap(va + 3 * page, page), "unmap one slice");
      Check(cuMemMap(va + span + 3 * page, page, 3 * page, big, 0), "map slice elsewhere");
      Check(cuMemSetAccess(va + span + 3 * page, page, &env.access, 1), "access moved slice");
      t1 = std::chrono::steady_clock::now();
      move_slice.push_back(Micros(t0, t1));
      Check(cuMemUnmap(va + span + 3 * page, page), "unmap moved");
      t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < pages; ++i) {
        if (i != 3) Check(cuMemUnmap(va + i * page, page), "unmap b");
      }
      t1 = std::chrono::steady_clock::now();
      unmap_slices.push_back(Micros(t0, t1));
      Check(cuMemRelease(big), "release b");
    }

    // (c) one handle, one mapping.
    big = Create(env, span);
    Check(cuMemMap(va, span, 0, big, 0), "map c");
    t0 = std::chrono::steady_clock::now();
    Check(cuMemSetAccess(va, span, &env.access, 1), "access c");
    t1 = std::chrono::steady_clock::now();
    access_one.push_back(Micros(t0, t1));
    Check(cuMemUnmap(va, span), "unmap c");
    Check(cuMemRelease(big), "release c");
  }
  std::printf("vmm_slice_probe: %d pages of %zu MiB (%zu MiB), medians of %d\n", pages, page >> 20,
              span >> 20, kReps);
  std::printf(
      "  (a) %d handles: cuMemCreate all %.0f us; cuMemSetAccess over %d mappings %.0f us"
      " (%.1f us per mapping)\n",
      pages, Median(create_each), pages, Median(access_handles), Median(access_handles) / pages);
  if (offsets_supported)
    std::printf(
        "  (b) 1 handle, %d slice mappings: cuMemCreate %.0f us; cuMemMap all %.0f us; "
        "cuMemSetAccess %.0f us (%.1f us per slice); unmap %d slices %.0f us; move one slice"
        " (unmap + map + access) %.1f us\n",
        pages, Median(create_one), Median(map_slices), Median(access_slices),
        Median(access_slices) / pages, pages - 1, Median(unmap_slices), Median(move_slice));
  std::printf("  (c) 1 handle, 1 mapping: cuMemSetAccess %.0f us\n", Median(access_one));
  std::printf(
      "RESULT offsets_supported=%d setaccess_per_handle_us=%.1f "
      "setaccess_one_mapping_us=%.1f setaccess_per_slice_us=%.1f move_slice_us=%.1f\n",
      offsets_supported ? 1 : 0, Median(access_handles) / pages, Median(access_one),
      offsets_supported ? Median(access_slices) / pages : -1.0,
      offsets_supported ? Median(move_slice) : -1.0);
  Check(cuMemAddressFree(va, 2 * span), "cuMemAddressFree");
  return 0;
}
