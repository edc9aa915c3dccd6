// The data plane: plain TCP beside gRPC for the bulk bytes of remote clients. A client writes hidden
// states into, and reads d_hidden out of, server-memory regions of its session (RegionRegistry::
// RegisterServerMemory) over several sockets at once, at the socket's speed; its gRPC requests
// then name slices of those regions, as co-located clients do, and carry no hidden bytes.
//
// Wire format: proto/lce/v1/data_plane_wire.h.
// Every transfer is checked as a request's slice is (owner, bounds; server memory only). A refused
// write's payload is read and dropped before the reply, and the connection goes on; one longer than
// any region may be (the per-session limit) is answered at once and the connection closed, as is a
// header without the magic. Connections beyond `max_connections` (each holds a thread, and on a GPU
// server two pinned buffers) get a RESOURCE_EXHAUSTED reply at once and are closed, as are those of a
// session that holds `max_connections_per_session` already. Between transfers a connection may idle
// for `idle_timeout`; once a transfer has begun, a peer that sends or takes nothing for
// `stall_timeout` loses the connection.
// Every transfer carries its session's id and secret (RegionRegistry::CheckSecret): the secret goes
// only to the session's authenticated OpenSession. Optionally TLS (options.tls; data_plane_link.h);
// without it the bytes and the secret cross the network in the clear.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "data_plane_link.h"
#include "lce/device_memory.h"
#include "lce/v1/data_plane_wire.h"
#include "region_registry.h"
#include "accept_backoff.h"
#include "service_metrics.h"

namespace lce::server {

struct RegionDataPlaneOptions {
  int64_t max_write_bytes = int64_t{4} << 30;  // the largest region a session may hold (longer refused writes are not drained)
  int max_connections = 512;                   // authenticated connections served at once
  // ... of them one session's: one session cannot take the whole pool (issue 35, item 5). The
  // clients open 2 x data_plane_sockets (at most 16) a stream.
  int max_connections_per_session = 64;
  absl::Duration stall_timeout = absl::Seconds(60);
  // An authenticated connection silent between transfers for this long ends (the clients reconnect
  // on their next request): idle connections cannot hold the pool for ever.
  absl::Duration idle_timeout = absl::Seconds(600);
  // A connection is authenticated by its first transfer, which must arrive within auth_timeout and
  // resolve (its session owns the region); until then it counts against max_unauthenticated, and
  // against max_unauthenticated_per_peer for its peer address, never against max_connections.
  // Anything else ends it: connections that present nothing cannot lock out real sessions.
  // 60 s: the clients open their sockets ahead of use (a download socket first carries the first
  // answer's d_hidden); a hello at connect would allow seconds.
  absl::Duration auth_timeout = absl::Seconds(60);
  int max_unauthenticated = 256;
  int max_unauthenticated_per_peer = 128;  // a client opens 2 x sockets x streams at once
  // TLS on every connection (PEM files; the gRPC server's own certificate and key by default).
  bool tls = false;
  std::string tls_cert_file, tls_key_file;
  // May be null: the bytes moved count in lce_bytes_{received,sent}_total, as those of gRPC messages
  // do; refused connections in lce_admission_rejections_total{reason="data_plane_connections"}.
  ServiceMetrics* metrics = nullptr;
};

class RegionDataPlane {
 public:
  // Listens on host:port (port 0: any free port).
  static absl::StatusOr<std::unique_ptr<RegionDataPlane>> Start(RegionRegistry& regions, const std::string& host,
                                                                int port, const RegionDataPlaneOptions& options);
  ~RegionDataPlane();  // stops accepting, ends every connection, joins the threads
  int port() const { return port_; }

 private:
  RegionDataPlane(RegionRegistry& regions, const RegionDataPlaneOptions& options)
      : regions_(regions),
        max_write_bytes_(options.max_write_bytes),
        max_connections_(options.max_connections),
        max_per_session_(options.max_connections_per_session),
        stall_timeout_(options.stall_timeout),
        idle_timeout_(options.idle_timeout),
        auth_timeout_(options.auth_timeout),
        max_unauthenticated_(options.max_unauthenticated),
        max_unauthenticated_per_peer_(options.max_unauthenticated_per_peer),
        metrics_(options.metrics),
        backoff_("data_plane", options.metrics) {}
  void AcceptLoop();
  // Why a new connection from `peer` is refused at once: {metric reason, message}, or an empty
  // reason. Hold mu_.
  std::pair<std::string, std::string> RefusalLocked(uint32_t peer) const;
  // The refusal when the authenticated connections fill the pool. Hold mu_.
  std::pair<std::string, std::string> PoolFullLocked() const;
  // Moves a connection from unauthenticated to authenticated as one of `session`'s: the refusal
  // ({metric reason, message}) when the pool or the session's share of it is full.
  std::pair<std::string, std::string> Authenticate(uint32_t peer, const std::string& session);
  void Serve(uint64_t id, int fd, uint32_t peer);
  // The slice a transfer names, checked: its session's secret, owner, bounds, server memory.
  absl::StatusOr<RegionRegistry::Slice> Check(const v1::data_plane::TransferHeader& h) const;
  // One transfer whose header is `head`: false when the connection must end. `session`: the session
  // the connection is authenticated as (empty: not yet).
  bool Transfer(DataPlaneLink& link, const uint8_t* head, uint32_t peer, std::string& session,
                std::unique_ptr<DeviceTransfer>& transfer);
  // The bytes of an accepted transfer and its reply (before a read's bytes, after a write's).
  bool Move(DataPlaneLink& link, bool write, const RegionRegistry::Slice& s, std::unique_ptr<DeviceTransfer>& transfer);

  RegionRegistry& regions_;
  std::unique_ptr<TlsServerContext> tls_;  // null: plain TCP
  const int64_t max_write_bytes_;
  const int max_connections_;
  const int max_per_session_;
  const absl::Duration stall_timeout_;
  const absl::Duration idle_timeout_;
  const absl::Duration auth_timeout_;
  const int max_unauthenticated_;
  const int max_unauthenticated_per_peer_;
  ServiceMetrics* const metrics_;
  AcceptBackoff backoff_;  // what a failed accept does (a descriptor shortage passes)
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::mutex mu_;
  std::vector<int> conns_;                       // every open connection (to wake them at stop)
  int authenticated_ = 0;
  std::map<std::string, int> by_session_;        // authenticated connections by session
  std::map<uint32_t, int> unauthenticated_;      // by peer IPv4 address
  std::map<uint64_t, std::thread> threads_;  // by connection
  std::vector<uint64_t> finished_;           // connections whose thread is done: joined on the next accept
  uint64_t next_id_ = 0;
  std::thread acceptor_;
};

}  // namespace lce::server
