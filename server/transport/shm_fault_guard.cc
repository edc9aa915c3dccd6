#include "shm_fault_guard.h"

#include <signal.h>
#include <sys/mman.h>

#include <cstdint>
#include <mutex>
#include <vector>

namespace lce::server {
namespace {

struct WatchedMapping {
  uintptr_t begin = 0, end = 0;
  std::atomic<bool>* lost = nullptr;
};

// The table the handler reads. A spin lock, not a mutex: the handler may take it (a mutex is not
// async-signal-safe), and no thread faults while holding it (nothing under it touches a mapping),
// so the handler only ever waits for another thread's short edit.
std::atomic_flag table_lock = ATOMIC_FLAG_INIT;
std::vector<WatchedMapping>* table = nullptr;
struct sigaction previous_action;

class TableLock {
 public:
  TableLock() {
    while (table_lock.test_and_set(std::memory_order_acquire)) {
    }
  }
  ~TableLock() { table_lock.clear(std::memory_order_release); }
};

// Whether the fault at `addr` was in a watched mapping, now replaced by zero pages.
bool Rescue(uintptr_t addr) {
  TableLock lock;
  for (const WatchedMapping& m : *table) {
    if (addr < m.begin || addr >= m.end) continue;
    // mmap is a plain system call on Linux, safe here in practice (Wayland's wl_shm does the same).
    void* p = mmap(reinterpret_cast<void*>(m.begin), m.end - m.begin, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_FIXED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return false;
    m.lost->store(true, std::memory_order_release);
    return true;
  }
  return false;
}

void OnSigbus(int sig, siginfo_t* info, void* context) {
  if (Rescue(reinterpret_cast<uintptr_t>(info->si_addr))) return;  // the access is retried, on zeros
  if ((previous_action.sa_flags & SA_SIGINFO) != 0) {
    previous_action.sa_sigaction(sig, info, context);
  } else if (previous_action.sa_handler != SIG_DFL && previous_action.sa_handler != SIG_IGN) {
    previous_action.sa_handler(sig);
  } else {
    // Not ours: put the default back; the access faults again and the signal takes its usual course.
    sigaction(SIGBUS, &previous_action, nullptr);
  }
}

void InstallHandler() {
  table = new std::vector<WatchedMapping>();  // never freed: the handler may run until exit
  struct sigaction action {};
  action.sa_sigaction = OnSigbus;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  sigaction(SIGBUS, &action, &previous_action);
}

}  // namespace

void WatchSharedMapping(void* base, size_t len, std::atomic<bool>* lost) {
  static std::once_flag installed;
  std::call_once(installed, InstallHandler);
  const auto begin = reinterpret_cast<uintptr_t>(base);
  TableLock lock;
  table->push_back({begin, begin + len, lost});
}

void UnwatchSharedMapping(void* base) {
  const auto begin = reinterpret_cast<uintptr_t>(base);
  TableLock lock;
  for (size_t i = 0; i < table->size(); ++i) {
    if ((*table)[i].begin != begin) continue;
    (*table)[i] = table->back();
    table->pop_back();
    return;
  }
}

}  // namespace lce::server
