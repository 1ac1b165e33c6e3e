# Copies every Abseil shared library LIBRARY needs (transitively) into DESTINATION, each as a plain
# file named by its SONAME, so that LIBRARY (RPATH $ORIGIN) loads on machines without Abseil.
# Usage: cmake -DLIBRARY=path/libvramledger_plugin.so -DDESTINATION=dir -P bundle_deps.cmake
cmake_minimum_required(VERSION 3.25)
if(NOT LIBRARY OR NOT DESTINATION)
  message(FATAL_ERROR "bundle_deps.cmake: pass -DLIBRARY=... -DDESTINATION=...")
endif()

file(GET_RUNTIME_DEPENDENCIES
  LIBRARIES "${LIBRARY}"
  RESOLVED_DEPENDENCIES_VAR resolved
  UNRESOLVED_DEPENDENCIES_VAR unresolved
  # Only Abseil is bundled: libc10/libcudart come from torch, libstdc++/glibc from the system.
  PRE_INCLUDE_REGEXES "^libabsl_"
  PRE_EXCLUDE_REGEXES ".*")
if(unresolved)
  message(FATAL_ERROR "bundle_deps.cmake: cannot find ${unresolved} needed by ${LIBRARY}")
endif()

get_filename_component(dest "${DESTINATION}" REALPATH)
set(count 0)
foreach(dep IN LISTS resolved)
  get_filename_component(dep_dir "${dep}" DIRECTORY)
  get_filename_component(dep_dir "${dep_dir}" REALPATH)
  if(dep_dir STREQUAL dest)
    continue()  # found through $ORIGIN: already bundled by an earlier build
  endif()
  # `dep` is the path of the NEEDED name (a symlink to the versioned file); copy its content.
  get_filename_component(name "${dep}" NAME)
  file(COPY_FILE "${dep}" "${dest}/${name}" ONLY_IF_DIFFERENT)
  math(EXPR count "${count} + 1")
endforeach()
list(LENGTH resolved total)
message(STATUS "vramledger: ${total} Abseil libraries beside ${LIBRARY} (${count} copied now)")
