// The environment read of process_env.h.
#include "torch_plugin/runtime/process_env.h"

#include <cstdlib>

#include "guard/step_log.h"

namespace vramledger {

ProcessEnv ReadProcessEnv() {
  ProcessEnv env;
  env.preload_disable = std::getenv("VRAMLEDGER_PRELOAD_DISABLE") != nullptr;
  env.rank = guard::RankFromEnvironment();
  return env;
}

}  // namespace vramledger
