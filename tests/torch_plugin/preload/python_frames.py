"""Run by preload_test under LD_PRELOAD=libvramledger_preload.so with a plan too small for its
request: asks the fake CUDA runtime for 256 MiB through the interposed cudaMalloc (found in the
global scope, as a program linked to libcudart would) and prints one RESULT line.

Usage: python python_frames.py FAKE_CUDART_SO MODE
MODE: "gil" (the call holds the GIL: ctypes.PyDLL), "released" (the main thread released the GIL
for the call, as torch's operators do: ctypes.CDLL), "thread" (a second Python thread that
released the GIL: the shim must not take it there).
"""
import ctypes
import sys
import threading

ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)  # the "real" runtime, after the shim
MODE = sys.argv[2]


def ask_for_memory(api):
    ptr = ctypes.c_void_p()
    return api.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(256 << 20))


def small_one(api):
    ptr = ctypes.c_void_p()
    return api.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(1 << 20))


def main():
    api = ctypes.PyDLL(None) if MODE == "gil" else ctypes.CDLL(None)
    small_one(api)
    if MODE == "thread":
        result = []
        worker = threading.Thread(target=lambda: result.append(ask_for_memory(api)))
        worker.start()
        worker.join()
        err = result[0]
    else:
        err = ask_for_memory(api)
    print(f"RESULT mode={MODE} error={err}", flush=True)


main()
