# The CUDA backend's sources (included by kernels/CMakeLists.txt when LCE_WITH_CUDA).
set(LCE_CUDA_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/cuda_engine.cc
  ${CMAKE_CURRENT_LIST_DIR}/gemm.cc
  ${CMAKE_CURRENT_LIST_DIR}/tile_stats.cu
  ${CMAKE_CURRENT_LIST_DIR}/row_finalize.cu
  ${CMAKE_CURRENT_LIST_DIR}/write_grad.cu
  ${CMAKE_CURRENT_LIST_DIR}/fast_grad.cu
  ${CMAKE_CURRENT_LIST_DIR}/convert.cu
  ${CMAKE_CURRENT_LIST_DIR}/tree_sum.cu
  ${CMAKE_CURRENT_LIST_DIR}/validate.cu
  ${CMAKE_CURRENT_LIST_DIR}/head_trainer.cc
  ${CMAKE_CURRENT_LIST_DIR}/adamw.cu
  ${CMAKE_CURRENT_LIST_DIR}/grad_norm.cu)
# CMake 3.25 knows no C++20 flag for nvcc and would fall back on CXX_STANDARD (20) for the .cu files:
# compile them as C++17 (they need nothing newer).
if(TARGET lce_kernels)
  set_target_properties(lce_kernels PROPERTIES CUDA_STANDARD 17 CUDA_STANDARD_REQUIRED ON CUDA_EXTENSIONS OFF)
endif()
