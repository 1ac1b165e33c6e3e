// A C++ program linked to torch's libc10_cuda (loaded, and torch's backend picked, before the
// LD_PRELOAD shim's constructor runs): prints the name of torch's current CUDA allocator, which
// the shim's direct route makes vramledger's.
#include <c10/cuda/CUDACachingAllocator.h>

#include <cstdio>

int main() {
  std::printf("ALLOCATOR %s\n", c10::cuda::CUDACachingAllocator::get()->name().c_str());
  return 0;
}
