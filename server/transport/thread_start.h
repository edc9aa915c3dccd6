// Starting a thread where the process may be out of tasks (a container's pids.max, systemd's
// TasksMax, RLIMIT_NPROC) or of address space: std::thread throws std::system_error there, and an
// uncaught one aborts the whole server (issue 35, item 4). StartThread returns the failure, for the
// caller to refuse that one request or connection, or to do the work on its own thread instead.
#pragma once

#include <functional>
#include <thread>

#include "absl/status/statusor.h"

namespace lce::server {

// A thread running `body`, or RESOURCE_EXHAUSTED naming `what` ("the data plane's acceptor").
absl::StatusOr<std::thread> StartThread(const char* what, std::function<void()> body);

// Tests: after the next `after` StartThread calls, `n` fail as under a task limit (thread creation
// cannot be made to fail for one process alone otherwise: RLIMIT_NPROC spares root and counts the
// whole uid). n = 0: none fail.
void FailThreadStartsForTest(int n, int after = 0);

}  // namespace lce::server
