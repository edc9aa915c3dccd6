// GPU timeline recorder: a CUPTI injection library. Load it into any CUDA process with
//   CUDA_INJECTION64_PATH=/path/liblce_gpu_timeline.so LCE_GPU_TIMELINE_DIR=/some/dir <command>
// and at the process's exit it writes <dir>/timeline.<pid>.csv: one line a kernel, memcpy or memset
// with its device start and end (ns), stream and name. bench/gpu_timeline_summary.py reads it.
// Why: the request log times engine calls from the host; this shows what the GPU did in between
// (idle gaps, per-GEMM durations) without a profiler on the device machine.
#include <cupti.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

namespace {

constexpr size_t kBufferBytes = 8 << 20;

std::mutex g_mu;
std::vector<std::string> g_lines;

void CUPTIAPI BufferRequested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void CUPTIAPI BufferCompleted(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  std::vector<std::string> lines;
  char line[512];
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    switch (record->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
      case CUPTI_ACTIVITY_KIND_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
        std::snprintf(line, sizeof(line), "kernel,%llu,%llu,%u,%d,%s\n", static_cast<unsigned long long>(k->start),
                      static_cast<unsigned long long>(k->end), k->streamId, k->gridX * k->gridY * k->gridZ,
                      k->name != nullptr ? k->name : "?");
        lines.emplace_back(line);
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
        std::snprintf(line, sizeof(line), "memcpy,%llu,%llu,%u,%llu,kind%d\n", static_cast<unsigned long long>(m->start),
                      static_cast<unsigned long long>(m->end), m->streamId, static_cast<unsigned long long>(m->bytes),
                      static_cast<int>(m->copyKind));
        lines.emplace_back(line);
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
        std::snprintf(line, sizeof(line), "memset,%llu,%llu,%u,%llu,memset\n", static_cast<unsigned long long>(m->start),
                      static_cast<unsigned long long>(m->end), m->streamId, static_cast<unsigned long long>(m->bytes));
        lines.emplace_back(line);
        break;
      }
      default:
        break;
    }
  }
  std::free(buffer);
  std::lock_guard<std::mutex> lock(g_mu);
  for (auto& l : lines) g_lines.push_back(std::move(l));
}

void WriteAtExit() {
  cuptiActivityFlushAll(1);
  const char* dir = std::getenv("LCE_GPU_TIMELINE_DIR");
  const std::string path = std::string(dir != nullptr ? dir : "/tmp") + "/timeline." + std::to_string(getpid()) + ".csv";
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return;
  std::fputs("what,start_ns,end_ns,stream,size,name\n", f);
  std::lock_guard<std::mutex> lock(g_mu);
  for (const auto& l : g_lines) std::fputs(l.c_str(), f);
  std::fclose(f);
}

}  // namespace

extern "C" int InitializeInjection(void) {
  if (cuptiActivityRegisterCallbacks(BufferRequested, BufferCompleted) != CUPTI_SUCCESS) return 0;
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET);
  std::atexit(WriteAtExit);
  return 1;
}
