// The shm socket (lce_server --shm-socket): a Unix-domain stream socket on which co-located clients
// hand their shared memory to the server as a file descriptor (SCM_RIGHTS; a memfd), so that no
// memory of theirs is reachable by a name another client could guess (issue 22). Each connection
// carries one registration: the session's id and secret (RegionRegistry::CheckSecret), the region's
// offset, size and name, and the descriptor; the sender's uid (SO_PEERCRED) must be the session's.
// Wire format: proto/lce/v1/shm_socket_wire.h.
//
// A connection must send its whole request within 5 s (however it trickles it: the time is the
// request's, not each recv's) and read the reply within 5 s more; at most 32 are served at once (more
// are closed at once): a silent or slow local client holds only its own connection, for 10 s at most.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "accept_backoff.h"
#include "region_registry.h"

namespace lce::server {

class ShmSocket {
 public:
  static constexpr int kMaxConnections = 32;
  // Listens at `path` (a stale socket file there is replaced; any other file is left alone:
  // FAILED_PRECONDITION). The file is made connectable by every user (0666): what admits a
  // registration is the session's secret and uid, not the file's mode.
  // `on_register` (may be empty) runs after each registration that succeeded (the regions' metrics);
  // `metrics` (may be null) counts the accept errors it survives.
  // `request_timeout`: the time a connection has to send its whole request (tests shorten it).
  static absl::StatusOr<std::unique_ptr<ShmSocket>> Start(RegionRegistry& regions, const std::string& path,
                                                         std::function<void()> on_register = {},
                                                         ServiceMetrics* metrics = nullptr,
                                                         absl::Duration request_timeout = absl::Seconds(5));
  ~ShmSocket();  // stops accepting, ends the connections, joins the threads, removes the file
  const std::string& path() const { return path_; }

 private:
  ShmSocket(RegionRegistry& regions, std::string path, std::function<void()> on_register, ServiceMetrics* metrics,
            absl::Duration request_timeout)
      : regions_(regions),
        path_(std::move(path)),
        on_register_(std::move(on_register)),
        request_timeout_(request_timeout),
        backoff_("shm_socket", metrics) {}
  void AcceptLoop();
  void Serve(uint64_t id, int fd);
  // Reads one request and its descriptor from `fd`, all of it before `deadline`, and registers it:
  // the region id or why not.
  absl::StatusOr<uint64_t> Register(int fd, absl::Time deadline);

  RegionRegistry& regions_;
  const std::string path_;
  const std::function<void()> on_register_;
  const absl::Duration request_timeout_;
  AcceptBackoff backoff_;
  int listen_fd_ = -1;
  std::atomic<bool> stopping_{false};
  std::mutex mu_;
  std::map<uint64_t, std::pair<int, std::thread>> conns_;  // by connection: its socket and thread
  std::vector<uint64_t> finished_;                         // joined on the next accept
  uint64_t next_id_ = 0;
  std::thread acceptor_;
};

}  // namespace lce::server
