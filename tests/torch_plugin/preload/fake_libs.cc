// Libraries the shim's route tests load: FAKE_C10_CUDA builds a stand-in for torch's
// libc10_cuda.so (the file name the shim watches for); FAKE_SIBLING the library that FAKE_CALLER
// dlopens by bare name, found only through the caller's RUNPATH.
#include <dlfcn.h>

extern "C" {

#if defined(FAKE_C10_CUDA)
/// Loaded: 1.
__attribute__((visibility("default"))) int probe() { return 1; }
#elif defined(FAKE_SIBLING)
/// The sibling's answer.
__attribute__((visibility("default"))) int sibling_answer() { return 42; }
#elif defined(FAKE_CALLER)
/// dlopens "libvl_fake_sibling.so" by bare name (as cuDNN opens its parts) and returns its
/// answer, or -1 when it cannot be found.
__attribute__((visibility("default"))) int probe() {
  void* sibling = dlopen("libvl_fake_sibling.so", RTLD_NOW | RTLD_LOCAL);
  if (sibling == nullptr) return -1;
  auto answer = reinterpret_cast<int (*)()>(dlsym(sibling, "sibling_answer"));
  return answer != nullptr ? answer() : -1;
}
#endif

}  // extern "C"
