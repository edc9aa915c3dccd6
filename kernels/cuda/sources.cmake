# The CUDA backend's sources (included by kernels/CMakeLists.txt when LCE_WITH_CUDA).
set(LCE_CUDA_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/cuda_engine.cc
  ${CMAKE_CURRENT_LIST_DIR}/call_plan.cc
  ${CMAKE_CURRENT_LIST_DIR}/workspace.cc
  ${CMAKE_CURRENT_LIST_DIR}/engine_forward.cc
  ${CMAKE_CURRENT_LIST_DIR}/engine_backward.cc
  ${CMAKE_CURRENT_LIST_DIR}/engine_rankings.cc
  ${CMAKE_CURRENT_LIST_DIR}/gemm.cc
  ${CMAKE_CURRENT_LIST_DIR}/swizzle_fit.cc
  ${CMAKE_CURRENT_LIST_DIR}/tile_stats.cu
  ${CMAKE_CURRENT_LIST_DIR}/row_finalize.cu
  ${CMAKE_CURRENT_LIST_DIR}/write_grad.cu
  ${CMAKE_CURRENT_LIST_DIR}/fast_grad.cu
  ${CMAKE_CURRENT_LIST_DIR}/bias_grad.cu
  ${CMAKE_CURRENT_LIST_DIR}/convert.cu
  ${CMAKE_CURRENT_LIST_DIR}/tree_sum.cu
  ${CMAKE_CURRENT_LIST_DIR}/exact_sum.cu
  ${CMAKE_CURRENT_LIST_DIR}/weighted_smoothing.cu
  ${CMAKE_CURRENT_LIST_DIR}/validate.cu
  ${CMAKE_CURRENT_LIST_DIR}/head_trainer.cc
  ${CMAKE_CURRENT_LIST_DIR}/adamw.cu
  ${CMAKE_CURRENT_LIST_DIR}/grad_commit.cu
  ${CMAKE_CURRENT_LIST_DIR}/grad_norm.cu
  ${CMAKE_CURRENT_LIST_DIR}/rankings.cu)
# CMake 3.25 knows no C++20 flag for nvcc and would fall back on CXX_STANDARD (20) for the .cu files:
# compile them as C++17 (they need nothing newer).
if(TARGET lce_kernels)
  set_target_properties(lce_kernels PROPERTIES CUDA_STANDARD 17 CUDA_STANDARD_REQUIRED ON CUDA_EXTENSIONS OFF)
endif()

# The sm_90a GEMM with the softmax statistics in its epilogue (epilogue_stats_gemm.cu) needs CUTLASS's
# headers: PyPI's nvidia-cutlass ships them under cutlass_library/source/include. Give the folder in
# LCE_CUTLASS_INCLUDE_DIR, or let CMake ask the Python interpreter (Python3_EXECUTABLE) where the
# package is. Without them the engine keeps its cuBLASLt path alone (LCE_WITH_CUTLASS undefined).
set(LCE_CUTLASS_INCLUDE_DIR "" CACHE PATH "CUTLASS include folder (holds cutlass/ and cute/); empty: ask Python's cutlass_library")
set(_lce_cutlass_dir "${LCE_CUTLASS_INCLUDE_DIR}")
if(NOT _lce_cutlass_dir)
  find_package(Python3 COMPONENTS Interpreter QUIET)
  if(Python3_Interpreter_FOUND)
    execute_process(
      COMMAND ${Python3_EXECUTABLE} -c
        "import importlib.util as u, os; s = u.find_spec('cutlass_library'); print(os.path.join(list(s.submodule_search_locations)[0], 'source', 'include') if s else '')"
      OUTPUT_VARIABLE _lce_cutlass_dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  endif()
endif()
if(TARGET lce_kernels AND _lce_cutlass_dir AND EXISTS "${_lce_cutlass_dir}/cutlass/cutlass.h"
   AND EXISTS "${_lce_cutlass_dir}/cute/tensor.hpp")
  message(STATUS "lce-serve: CUTLASS headers at ${_lce_cutlass_dir}: epilogue-statistics GEMM on")
  set(_lce_epi ${CMAKE_CURRENT_LIST_DIR}/epilogue_stats_gemm.cu)
  target_sources(lce_kernels PRIVATE ${_lce_epi})
  target_compile_definitions(lce_kernels PRIVATE LCE_WITH_CUTLASS=1)
  # -isystem: CUTLASS's own warnings are not ours.
  set_source_files_properties(${_lce_epi} PROPERTIES COMPILE_OPTIONS "-isystem;${_lce_cutlass_dir}")
else()
  message(STATUS "lce-serve: no CUTLASS headers: epilogue-statistics GEMM off")
endif()
