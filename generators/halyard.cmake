# halyard_add_model(NAME <name> GENERATOR <generator target> CONFIG <config.json>
#                   SEQ <tokens> [BATCH <n>] [SCHEDULE <preset or .json>] [TARGET <halide target>]
#                   [SP <ranks>] [CLUSTER <preset or .json>] [EXCLUDE_FROM_ALL]
#                   [MEMORY_PER_RANK <bytes>] [RANKS <n>] [BF16 store contract reduce]
#                   [STRATEGIES ulysses ring hybrid])
#
# SCHEDULE autosp lets the AutoSP search (schedules/autosp.h) choose the
# schedule for RANKS ranks (default: SP, else the cluster's) with
# MEMORY_PER_RANK bytes each (default: the cluster's): the fastest plan that
# fits. The build prints it, the header states it, and it is written next to
# the library as <name>.schedule.json (pin it: SCHEDULE that file). A request
# that nothing fits is a build error naming the least memory per rank, or
# the fewest ranks, that would fit. With SP, the search keeps that degree.
# BF16 lists what the search may hold or compute in bf16 (default: nothing):
# store (saved values' copies for the backward), contract (contractions'
# operands; clusters with a bf16 peak, i.e. GPUs), reduce (the gradients'
# sum over the ranks). f32 stays a candidate. STRATEGIES keeps the search to
# the head redistributions named (default: every one; ring in both layouts).
#
# SP > 1 splits the sequence over that many ranks (the schedule must split it,
# e.g. SCHEDULE ulysses; a schedule's own "mesh" may say it instead); SEQ is
# the global length, padded when SP does not divide it, and the library runs
# only on SP ranks. CLUSTER (HALYARD_CLUSTER, local-cpu by default) is what the plan's predictions, stated
# in the header and the library, are made for; the generator writes the whole
# plan next to the library as <name>.plan.json.
#
# Runs the model's generator (an executable calling halyard::aot_main) at build
# time and makes a static library <name> (lib<name>.a) whose header <name>.h
# declares halyard_models::<name>(), the model's kernels and step programs.
# Kernels are built with no_runtime; every model of one target links a single
# Halide runtime library (halyard_halide_runtime_<target>).
# The cluster every model's plan predicts for unless it names one: a preset or
# a machine profile written by halyard-calibrate.
set(HALYARD_CLUSTER local-cpu CACHE STRING "cluster preset or profile .json that halyard_add_model plans for")

function(halyard_add_model)
  cmake_parse_arguments(M "EXCLUDE_FROM_ALL" "NAME;GENERATOR;CONFIG;SCHEDULE;BATCH;SEQ;TARGET;SP;CLUSTER;MEMORY_PER_RANK;RANKS"
                        "BF16;STRATEGIES" ${ARGN})
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
  set(sp_args)
  if(M_SP)
    set(sp_args --sp ${M_SP})
  endif()
  if(NOT M_CLUSTER)
    set(M_CLUSTER ${HALYARD_CLUSTER})
  endif()
  set(autosp_args)
  if(M_SCHEDULE STREQUAL "autosp")
    if(M_RANKS)
      list(APPEND autosp_args --ranks ${M_RANKS})
    endif()
    if(M_MEMORY_PER_RANK)
      list(APPEND autosp_args --memory-per-rank ${M_MEMORY_PER_RANK})
    endif()
    if(M_BF16)
      string(REPLACE ";" "," bf16 "${M_BF16}")
      list(APPEND autosp_args --bf16 ${bf16})
    endif()
    if(M_STRATEGIES)
      string(REPLACE ";" "," strategies "${M_STRATEGIES}")
      list(APPEND autosp_args --strategies ${strategies})
    endif()
  elseif(M_RANKS OR M_MEMORY_PER_RANK OR M_BF16 OR M_STRATEGIES)
    message(FATAL_ERROR "halyard_add_model(${M_NAME}): RANKS, MEMORY_PER_RANK, BF16 and STRATEGIES are what SCHEDULE autosp searches "
                        "with; SCHEDULE is ${M_SCHEDULE}. Use SCHEDULE autosp, or drop them (a schedule file states "
                        "its own precision).")
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
  foreach(file ${M_SCHEDULE} ${M_CLUSTER})
    if(EXISTS ${file})
      list(APPEND deps ${file})
    endif()
  endforeach()
  add_custom_command(OUTPUT ${outputs}
    COMMAND ${CMAKE_COMMAND} -E make_directory ${dir}
    COMMAND ${M_GENERATOR} --name ${M_NAME} --config ${M_CONFIG} --schedule ${M_SCHEDULE}
            --batch ${M_BATCH} --seq ${M_SEQ} ${sp_args} --target ${M_TARGET} --out ${dir}
            --cluster ${M_CLUSTER} --plan-json ${dir}/${M_NAME}.plan.json ${autosp_args}
            --schedule-out ${dir}/${M_NAME}.schedule.json
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
  if(TARGET Halyard::halyard_runtime)  # an installed Halyard (find_package)
    target_link_libraries(${M_NAME} PUBLIC Halyard::halyard_runtime ${runtime})
  else()
    target_link_libraries(${M_NAME} PUBLIC halyard_runtime ${runtime})
  endif()
endfunction()
