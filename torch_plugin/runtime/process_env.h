// The process settings read from the environment outside the options: the shim's off switch
// (checked before VRAMLEDGER_CONF is parsed) and the rank that names the step log.
#ifndef VRAMLEDGER_TORCH_PLUGIN_RUNTIME_PROCESS_ENV_H_
#define VRAMLEDGER_TORCH_PLUGIN_RUNTIME_PROCESS_ENV_H_

namespace vramledger {

struct ProcessEnv {
  bool preload_disable = false;  // VRAMLEDGER_PRELOAD_DISABLE set: the shim does nothing
  int rank = 0;  // RANK, else LOCAL_RANK, else 0: names the step log (guard/step_log.h)
};

/// Reads the settings from the environment now (each call reads it again: a program may set a
/// variable after the shim loaded). Thread-safe as far as getenv is.
ProcessEnv ReadProcessEnv();

}  // namespace vramledger

#endif  // VRAMLEDGER_TORCH_PLUGIN_RUNTIME_PROCESS_ENV_H_
