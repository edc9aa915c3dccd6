// Shared-memory regions of co-located clients (OpenSession): POSIX shm objects that a client
// creates and the server maps read-write (MAP_SHARED), or CUDA allocations of the client's that the
// server opens through CUDA IPC, so that requests read hidden states and write d_hidden in place
// instead of carrying them as bytes. Every region belongs to the session that
// registered it; only requests of that session may use it, and every use is bounds-checked. Ending a
// session unmaps its regions (a request still using one keeps its mapping until it finishes).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "lce/device_memory.h"
#include "lce/v1/lce.pb.h"

namespace lce::server {

class RegionRegistry {
  struct Region;

 public:
  // A resolved slice: its bytes, valid while `hold` (the region's mapping) is alive.
  struct Slice {
    absl::Span<uint8_t> bytes;
    std::shared_ptr<const void> hold;
    bool device = false;         // bytes are device memory on the server's GPU (CUDA IPC, or server memory there)
    bool server_memory = false;  // the server's own memory (RegisterServerMemory)
    const Region* region = nullptr;  // kept alive by `hold`
  };

  // Most regions one session may hold at once (RESOURCE_EXHAUSTED beyond).
  static constexpr size_t kMaxRegionsPerSession = 256;

  // `cuda_device`: the GPU that CUDA IPC regions are opened on; -1 when the server's engine is not
  // on a GPU (such registrations are then UNIMPLEMENTED).
  explicit RegionRegistry(int cuda_device = -1) : cuda_device_(cuda_device) {}
  // The GPU whose memory device regions are (-1: none).
  int cuda_device() const { return cuda_device_; }

  // A new session id: 128 random bits as 32 lowercase hex digits.
  static std::string NewSessionId();

  // A session's id and its secret (128 random bits more, as 32 hex digits): the id names the
  // session in requests; the secret, sent only in the authenticated OpenSession's first answer,
  // proves that a data-plane or shm-socket connection belongs to it (the id alone does not: it
  // travels in metadata and in every data-plane header).
  struct SessionKeys {
    std::string id, secret;
  };
  // Opens a session: regions may be registered for it until ReleaseSession. `uid`: the uid of the
  // client that opened it where the kernel names it (Peer::uid), else -1; file descriptors handed
  // over the shm socket must come from that uid (or the server's own where it is unknown).
  SessionKeys OpenSession(int64_t uid = -1);
  // OK when `session` is open and `secret` is its secret (compared in constant time);
  // PERMISSION_DENIED otherwise, an unknown session included (the message does not say which).
  absl::Status CheckSecret(const std::string& session, const std::string& secret) const;

  // Who opened a session, for name-based shared memory: a peer on this host, and its uid where the
  // kernel's socket table names it (loopback TCP: /proc/net/tcp); -1: unknown.
  struct Peer {
    bool local = false;
    int64_t uid = -1;
    std::string description;  // gRPC's peer string, for messages
  };
  // From a gRPC peer string ("ipv4:127.0.0.1:40000").
  static Peer IdentifyPeer(const std::string& grpc_peer);

  // Opens and maps [offset, offset + byte_size) of the shm object `shm_name` for `session`, opened by
  // `peer`. NOT_FOUND: no such object; PERMISSION_DENIED: the server may not open it, the peer is not
  // on this host, its uid is unknown or does not own the object, or another session registered the
  // object; INVALID_ARGUMENT: a bad name, offset or size (beyond the object's size).
  absl::StatusOr<uint64_t> Register(const std::string& session, const Peer& peer, const std::string& name,
                                    const std::string& shm_name, int64_t offset, int64_t byte_size);
  // Opens the CUDA allocation of `ipc_handle` (cudaIpcGetMemHandle, 64 bytes) and registers
  // [offset, offset + byte_size) of it for `session`. INVALID_ARGUMENT: a bad handle, offset or size
  // (beyond the allocation); UNIMPLEMENTED: no GPU engine here.
  absl::StatusOr<uint64_t> RegisterCudaIpc(const std::string& session, const std::string& name,
                                           const std::string& ipc_handle, int64_t offset, int64_t byte_size);
  // Allocates `byte_size` bytes of server memory for `session` (on the GPU when the server has one
  // and it has room, else on the host), filled and drained over the data plane. FAILED_PRECONDITION: server memory is not enabled;
  // RESOURCE_EXHAUSTED: beyond the session's limit.
  absl::StatusOr<uint64_t> RegisterServerMemory(const std::string& session, const std::string& name, int64_t byte_size);
  // Lets sessions allocate server memory, up to `max_bytes_per_session` each (the data plane's) and
  // `max_total_bytes` over all sessions together (0: no total limit).
  void EnableServerMemory(int64_t max_bytes_per_session, int64_t max_total_bytes = 0) {
    max_server_bytes_ = max_bytes_per_session;
    max_total_server_bytes_ = max_total_bytes;
  }
  bool server_memory_enabled() const { return max_server_bytes_ > 0; }
  // Caps the bytes of client files (shm objects, memfds) the server maps, per session and over all
  // sessions. This is address space, not memory: a sparse memfd costs its client nothing, and 68 of
  // them once took the server's 128 TiB (issue 35, item 2). Checked before every mmap.
  static constexpr int64_t kDefaultMappedBytesPerSession = int64_t{64} << 30;
  static constexpr int64_t kDefaultMappedBytesTotal = int64_t{4} << 40;
  void LimitMappedBytes(int64_t per_session, int64_t total) {
    max_mapped_bytes_ = per_session;
    max_total_mapped_bytes_ = total;
  }
  // Maps [offset, offset + byte_size) of the file `fd` (a memfd or shm object the client handed over
  // the shm socket, SCM_RIGHTS; not closed here) for `session`, whose secret the connection showed.
  // `peer_uid`: the sending process's uid (SO_PEERCRED). PERMISSION_DENIED: a wrong secret, or a
  // uid other than the session's (the server's own for sessions of unknown uid), or the object is
  // another session's; INVALID_ARGUMENT: not a regular file opened read-write, or bad bounds.
  absl::StatusOr<uint64_t> RegisterFd(const std::string& session, const std::string& secret, int64_t peer_uid,
                                      const std::string& name, int fd, int64_t offset, int64_t byte_size);
  // Registration by shm name (RegisterRegion.shm_name): off unless the server allows it
  // (--allow-shm-by-name), since a name can be guessed by another client with the scoring token.
  void AllowShmByName(bool allow) { allow_shm_by_name_ = allow; }
  // Any of the above, as the RegisterRegion message says.
  absl::StatusOr<uint64_t> Register(const std::string& session, const Peer& peer, const v1::RegisterRegion& r);
  // NOT_FOUND: no such region; PERMISSION_DENIED: it belongs to another session.
  absl::Status Unregister(const std::string& session, uint64_t region_id);
  // Drops every region of the session and closes it (no registration for it succeeds after);
  // returns how many regions.
  int ReleaseSession(const std::string& session);

  // The bytes of `slice` for a request of `session`, which shows the session's `secret` (compared in
  // constant time: the id alone travels in metadata and opens nothing), that needs exactly
  // `bytes_needed` bytes there. PERMISSION_DENIED: no session, or a secret that is not the open
  // session's (first, before anything about the region is told), or the region belongs to another
  // session; NOT_FOUND: unknown region; FAILED_PRECONDITION: its shm object was shrunk under it
  // (CheckIntact); INVALID_ARGUMENT: the slice is out of the region's bounds or not `bytes_needed`
  // long. `what` ("hidden_region", ...) names the field in messages.
  absl::StatusOr<Slice> Resolve(const std::string& session, const std::string& secret, const v1::RegionSlice& slice,
                                int64_t bytes_needed, const char* what) const;

  // After a request has used `slice`: FAILED_PRECONDITION when its client shrank the shm object
  // meanwhile (the server read zeros and must not answer with them; the region stays unusable).
  static absl::Status CheckIntact(const Slice& slice, const char* what);

  // Regions registered now (all sessions), and of those in device memory.
  size_t size() const;
  // Regions held now, by kind.
  struct Counts {
    size_t shm = 0, device = 0, server = 0;
  };
  Counts counts() const;

 private:
  static absl::Status LostError(const Region& r, const char* what);
  // Maps the file `fd` (checked by the caller) as a region of `session`; `what` names it in messages.
  absl::StatusOr<uint64_t> MapFile(const std::string& session, const std::string& name, const std::string& what,
                                   int fd, int64_t offset, int64_t byte_size);
  // FAILED_PRECONDITION unless `session` is open (OpenSession, not yet released). Under mu_.
  absl::Status CheckOpenLocked(const std::string& session) const;
  // CheckSecret's comparison against the session's secret `want` (empty: no such session).
  static absl::Status SecretMatches(const std::string& want, const std::string& secret);
  absl::StatusOr<uint64_t> Add(const std::string& session, std::shared_ptr<Region> region);
  // RESOURCE_EXHAUSTED when `session` may not hold one more region with `server_bytes` more bytes
  // of server memory and `mapped_bytes` more of mapped client files. Under mu_.
  absl::Status CheckRoomLocked(const std::string& session, int64_t server_bytes, int64_t mapped_bytes = 0) const;
  // The mapping of an IPC handle, opened once: CUDA refuses to open one handle twice in a process,
  // and two tensors of a client often share one allocation (PyTorch's caching allocator).
  absl::StatusOr<std::shared_ptr<ImportedDeviceMemory>> OpenIpc(const std::string& ipc_handle);
  int cuda_device_;
  bool allow_shm_by_name_ = false;
  int64_t max_server_bytes_ = 0;  // per session; 0: no server memory
  int64_t max_total_server_bytes_ = 0;  // over all sessions (0: no limit)
  int64_t max_mapped_bytes_ = kDefaultMappedBytesPerSession;  // client files mapped, per session
  int64_t max_total_mapped_bytes_ = kDefaultMappedBytesTotal;  // ... and over all sessions
  std::mutex ipc_mu_;
  std::map<std::string, std::weak_ptr<ImportedDeviceMemory>> ipc_open_;  // by handle bytes
  mutable std::mutex mu_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, std::shared_ptr<const Region>> regions_;
  struct Session {
    std::string secret;
    int64_t uid = -1;
  };
  std::map<std::string, Session> sessions_;  // open sessions, by id
};

}  // namespace lce::server
