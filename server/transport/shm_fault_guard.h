// Survives a client that shrinks a shared-memory object the server has mapped (issue 16 item 2).
//
// A POSIX shm object cannot be sealed against shrinking (only a memfd can), and its owner may
// ftruncate it at any time; the server's next touch of a page past the new end raises SIGBUS, which
// would kill the process and every client's service. So a process-wide SIGBUS handler looks the
// faulting address up among the watched mappings; when it falls in one, the handler maps anonymous
// zero pages over that whole mapping (MAP_FIXED: the faulting access then completes) and marks the
// mapping lost, and the request that used it is answered with an error instead of those zeros.
// Wayland compositors guard their clients' wl_shm pools the same way. A fault anywhere else goes on
// to the handler that was there before (by default: the process dies, as it would have).
#pragma once

#include <atomic>
#include <cstddef>

namespace lce::server {

// Watches [base, base + len) (page-aligned, from mmap) until Unwatch(base): a SIGBUS inside it
// replaces the mapping with zero pages and sets `*lost`, which must outlive the watch. Installs the
// handler on first use. Thread-safe.
void WatchSharedMapping(void* base, size_t len, std::atomic<bool>* lost);
// Stops watching the mapping at `base`; call before unmapping it.
void UnwatchSharedMapping(void* base);

}  // namespace lce::server
