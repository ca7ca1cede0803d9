# halyard_add_model(NAME <name> GENERATOR <generator target> CONFIG <config.json>
#                   SEQ <tokens> [BATCH <n>] [SCHEDULE <preset or .json>] [TARGET <halide target>]
#                   [SP <ranks>] [EXCLUDE_FROM_ALL])
#
# SP > 1 splits the sequence over that many ranks (the schedule must split it,
# e.g. SCHEDULE ulysses); SEQ is the global length, padded when SP does not
# divide it, and the library runs only on SP ranks.
#
# Runs the model's generator (an executable calling halyard::aot_main) at build
# time and makes a static library <name> (lib<name>.a) whose header <name>.h
# declares halyard_models::<name>(), the model's kernels and step programs.
# Kernels are built with no_runtime; every model of one target links a single
# Halide runtime library (halyard_halide_runtime_<target>).
function(halyard_add_model)
  cmake_parse_arguments(M "EXCLUDE_FROM_ALL" "NAME;GENERATOR;CONFIG;SCHEDULE;BATCH;SEQ;TARGET;SP" "" ${ARGN})
  foreach(req NAME GENERATOR CONFIG SEQ)
    if(NOT M_${req})
      message(FATAL_ERROR "halyard_add_model: ${req} is required")
    endif()
  endforeach()
  if(NOT M_SCHEDULE)
    set(M_SCHEDULE default)
  endif()
  if(NOT M_BATCH)
    set(M_BATCH 1)
  endif()
  if(NOT M_TARGET)
    set(M_TARGET host)
  endif()
  if(NOT M_SP)
    set(M_SP 1)
  endif()

  string(MAKE_C_IDENTIFIER "${M_TARGET}" target_id)
  set(runtime halyard_halide_runtime_${target_id})
  if(NOT TARGET ${runtime})
    set(obj ${CMAKE_BINARY_DIR}/halide_runtime/${target_id}.o)
    add_custom_command(OUTPUT ${obj}
      COMMAND ${CMAKE_COMMAND} -E make_directory ${CMAKE_BINARY_DIR}/halide_runtime
      COMMAND ${M_GENERATOR} --runtime-only --target ${M_TARGET} --out ${obj}
      DEPENDS ${M_GENERATOR}
      COMMENT "Halyard: Halide runtime for ${M_TARGET}" VERBATIM)
    add_library(${runtime} STATIC EXCLUDE_FROM_ALL ${obj})
    set_source_files_properties(${obj} PROPERTIES EXTERNAL_OBJECT TRUE GENERATED TRUE)
    set_target_properties(${runtime} PROPERTIES LINKER_LANGUAGE CXX)
    target_link_libraries(${runtime} INTERFACE Threads::Threads ${CMAKE_DL_LIBS})
  endif()

  set(dir ${CMAKE_CURRENT_BINARY_DIR}/${M_NAME}.generated)
  set(outputs ${dir}/${M_NAME}.h ${dir}/${M_NAME}_program.cpp ${dir}/${M_NAME}_kernels.o)
  set(deps ${M_GENERATOR} ${M_CONFIG})
  if(EXISTS ${M_SCHEDULE})
    list(APPEND deps ${M_SCHEDULE})
  endif()
  add_custom_command(OUTPUT ${outputs}
    COMMAND ${CMAKE_COMMAND} -E make_directory ${dir}
    COMMAND ${M_GENERATOR} --name ${M_NAME} --config ${M_CONFIG} --schedule ${M_SCHEDULE}
            --batch ${M_BATCH} --seq ${M_SEQ} --sp ${M_SP} --target ${M_TARGET} --out ${dir}
            --plugin-dir $<TARGET_FILE_DIR:Halide::Halide>
    DEPENDS ${deps}
    COMMENT "Halyard: AOT-compiling ${M_NAME} (${M_SCHEDULE}, ${M_TARGET})" VERBATIM)
  set(exclude)
  if(M_EXCLUDE_FROM_ALL)
    set(exclude EXCLUDE_FROM_ALL)
  endif()
  add_library(${M_NAME} STATIC ${exclude} ${dir}/${M_NAME}_program.cpp ${dir}/${M_NAME}_kernels.o)
  set_source_files_properties(${dir}/${M_NAME}_kernels.o PROPERTIES EXTERNAL_OBJECT TRUE GENERATED TRUE)
  target_include_directories(${M_NAME} PUBLIC ${dir})
  target_link_libraries(${M_NAME} PUBLIC halyard_runtime ${runtime})
endfunction()
