# Copies every Abseil shared library LIBRARY needs (transitively) into DESTINATION, each as a plain
# file named by its SONAME, so that LIBRARY (RPATH $ORIGIN) loads on machines without Abseil.
# Usage: cmake -DLIBRARY=path/libvramledger_plugin.so -DDESTINATION=dir [-DSEARCH_DIRS=dir;...]
#              -P bundle_deps.cmake
# SEARCH_DIRS: where to look for Abseil after the loader's own paths (ld.so.conf, default dirs),
# e.g. the folder of an Abseil found through CMAKE_PREFIX_PATH (benchmarks/gpu/checks/wheel_check.sh);
# CMake does not read LD_LIBRARY_PATH here.
cmake_minimum_required(VERSION 3.25)
if(NOT LIBRARY OR NOT DESTINATION)
  message(FATAL_ERROR "bundle_deps.cmake: pass -DLIBRARY=... -DDESTINATION=...")
endif()

# Resolve a copy that sits alone in a scratch folder, so that its $ORIGIN finds no bundled copies
# from an earlier build and every dependency resolves to the system's file. The folder is the
# library's own: the build bundles several libraries into one DESTINATION in parallel.
get_filename_component(dest "${DESTINATION}" REALPATH)
get_filename_component(library_name "${LIBRARY}" NAME)
set(scratch "${dest}/.bundle_scratch-${library_name}")
file(REMOVE_RECURSE "${scratch}")
file(MAKE_DIRECTORY "${scratch}")
file(COPY_FILE "${LIBRARY}" "${scratch}/${library_name}")
file(GET_RUNTIME_DEPENDENCIES
  LIBRARIES "${scratch}/${library_name}"
  RESOLVED_DEPENDENCIES_VAR resolved
  UNRESOLVED_DEPENDENCIES_VAR unresolved
  # Only Abseil is bundled: libc10/libcudart come from torch, libstdc++/glibc from the system.
  PRE_INCLUDE_REGEXES "^libabsl_"
  PRE_EXCLUDE_REGEXES ".*"
  DIRECTORIES ${SEARCH_DIRS})
file(REMOVE_RECURSE "${scratch}")
if(unresolved)
  message(FATAL_ERROR "bundle_deps.cmake: cannot find ${unresolved} needed by ${LIBRARY}")
endif()

set(count 0)
foreach(dep IN LISTS resolved)
  # `dep` is the path of the NEEDED name (a symlink to the versioned file); copy its content.
  get_filename_component(name "${dep}" NAME)
  # Copied under a name of this library's, then renamed over: a library bundled at the same time
  # never sees a half-written file.
  file(COPY_FILE "${dep}" "${dest}/${name}.tmp-${library_name}")
  file(RENAME "${dest}/${name}.tmp-${library_name}" "${dest}/${name}")
  math(EXPR count "${count} + 1")
endforeach()
message(STATUS "vramledger: ${count} Abseil libraries bundled beside ${LIBRARY}")
