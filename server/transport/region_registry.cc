#include "region_registry.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client_shares.h"
#include "lce/device_memory.h"
#include "request_authenticator.h"
#include "shm_fault_guard.h"
#include "status_macros.h"

#ifdef LCE_WITH_CUDA
#include "cuda/cuda_check.h"
#endif

namespace lce::server {

// One mapping; unmapped when the last holder (registry or in-flight request) lets go.
struct RegionRegistry::Region {
  std::string session, name, shm_name;
  dev_t shm_dev = 0;  // the shm object's identity (st_dev, st_ino): one session's at a time
  ino_t shm_ino = 0;
  void* map_base = nullptr;
  size_t map_len = 0;
  uint8_t* data = nullptr;  // map_base + (offset - page-aligned offset), or into device_memory
  int64_t byte_size = 0;
  std::shared_ptr<ImportedDeviceMemory> device_memory;  // CUDA IPC regions (shared by handle)
  std::unique_ptr<PinnedHostRange> pinned;              // shm and server regions of a GPU server
  void* owned = nullptr;                                // server memory (RegisterServerMemory) on the host
  size_t owned_len = 0;                                 // its anonymous mapping's length
  std::unique_ptr<DeviceBuffer> owned_device;           // ... or on the server's GPU
  // The client shrank the shm object under the mapping, which now holds zeros (shm_fault_guard.h).
  std::atomic<bool> lost{false};
  bool server_memory() const { return owned != nullptr || owned_device != nullptr; }
  ~Region() {
    pinned.reset();  // before the mapping goes
    if (map_base != nullptr) {
      UnwatchSharedMapping(map_base);
      munmap(map_base, map_len);
    }
    if (owned != nullptr) munmap(owned, owned_len);
  }
};

RegionRegistry::SessionKeys RegionRegistry::OpenSession(int64_t uid) {
  SessionKeys keys{NewSessionId(), NewSessionId()};
  std::lock_guard<std::mutex> lock(mu_);
  sessions_[keys.id] = Session{keys.secret, uid};
  return keys;
}

absl::Status RegionRegistry::CheckSecret(const std::string& session, const std::string& secret) const {
  std::string want;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sessions_.find(session);
    if (it != sessions_.end()) want = it->second.secret;
  }
  return SecretMatches(want, secret);
}

absl::Status RegionRegistry::SecretMatches(const std::string& want, const std::string& secret) {
  // An unknown session (want empty) is compared against a string of the same length, so that timing
  // tells neither which sessions exist nor how much of a secret was right.
  const bool known = !want.empty();
  const bool match = ConstantTimeEquals(known ? want : std::string(secret.size(), '\0'), secret);
  if (known && match) return absl::OkStatus();
  return absl::PermissionDeniedError("the session id and secret do not name an open session");
}

absl::Status RegionRegistry::CheckOpenLocked(const std::string& session) const {
  if (sessions_.count(session) != 0) return absl::OkStatus();
  return absl::FailedPreconditionError("the session has ended (or was never opened)");
}

std::string RegionRegistry::NewSessionId() {
  uint8_t raw[16];
  size_t got = 0;
  while (got < sizeof(raw)) {
    const ssize_t r = getrandom(raw + got, sizeof(raw) - got, 0);
    if (r > 0) got += static_cast<size_t>(r);
  }
  static const char kHex[] = "0123456789abcdef";
  std::string id(32, '0');
  for (int i = 0; i < 16; ++i) {
    id[2 * i] = kHex[raw[i] >> 4];
    id[2 * i + 1] = kHex[raw[i] & 15];
  }
  return id;
}

namespace {

// Server memory is handed to a client, which may read it before writing it: it must hold none of
// the bytes its allocator last gave someone else (issue 35, item 1). cudaMalloc does not clear.
absl::Status ZeroDeviceMemory(uint8_t* data, int64_t bytes, int device) {
#ifdef LCE_WITH_CUDA
  int prev = 0;
  LCE_CUDA_CHECK(cudaGetDevice(&prev));
  LCE_CUDA_CHECK(cudaSetDevice(device));
  const cudaError_t e = cudaMemset(data, 0, static_cast<size_t>(bytes));
  const cudaError_t back = cudaSetDevice(prev);
  LCE_CUDA_CHECK(e);
  LCE_CUDA_CHECK(back);
  return absl::OkStatus();
#else
  (void)data, (void)bytes, (void)device;
  return absl::UnimplementedError("this build has no CUDA backend");
#endif
}

}  // namespace

RegionRegistry::Peer RegionRegistry::IdentifyPeer(const std::string& grpc_peer) {
  Peer p;
  p.description = grpc_peer;
  if (grpc_peer.rfind("unix:", 0) == 0 || grpc_peer.rfind("ipv6:[::1]:", 0) == 0) {
    p.local = true;
    return p;
  }
  if (grpc_peer.rfind("ipv4:127.", 0) != 0) return p;
  p.local = true;
  p.uid = SocketOwners::Read().Uid(grpc_peer);
  return p;
}

absl::StatusOr<uint64_t> RegionRegistry::Register(const std::string& session, const Peer& peer, const std::string& name,
                                                  const std::string& shm_name, int64_t offset, int64_t byte_size) {
  const std::string what = absl::StrCat("region '", name, "' (", shm_name, ")");
  // A name can be guessed: another client with the scoring token could map this one's object
  // (issue 22). Off unless the operator says every co-located client is trusted.
  if (!allow_shm_by_name_) {
    return absl::PermissionDeniedError(absl::StrCat(
        what, ": registration by shm name is off on this server (--allow-shm-by-name); hand the object over as a "
              "file descriptor on the shm socket (SessionResponse.shm_socket)"));
  }
  // Shared memory by name is for clients on this host that own the object (issue 16 item 3: a second
  // session could otherwise map any object the server's user can open).
  if (!peer.local) {
    return absl::PermissionDeniedError(absl::StrCat(what, ": shared memory by name is only for clients on the server's host"));
  }
  if (peer.uid < 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        what, ": the client's uid is unknown (connect over IPv4 loopback), so its ownership of the object cannot be checked",
        peer.description.empty() ? "" : absl::StrCat(" (peer ", peer.description, ")")));
  }
  if (shm_name.size() < 2 || shm_name[0] != '/' || shm_name.find('/', 1) != std::string::npos ||
      shm_name.size() > 255) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": shm_name must be \"/\" followed by a name without \"/\""));
  }
  const int fd = shm_open(shm_name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    const int e = errno;
    const std::string msg = absl::StrCat(what, ": shm_open failed: ", std::strerror(e));
    if (e == ENOENT) return absl::NotFoundError(msg);
    if (e == EACCES || e == EPERM) return absl::PermissionDeniedError(msg);
    return absl::InvalidArgumentError(msg);
  }
  struct stat st {};
  absl::StatusOr<uint64_t> id = absl::InternalError(absl::StrCat(what, ": fstat failed: ", std::strerror(errno)));
  if (fstat(fd, &st) == 0) {
    id = static_cast<int64_t>(st.st_uid) == peer.uid
             ? MapFile(session, name, what, fd, offset, byte_size)
             : absl::PermissionDeniedError(absl::StrCat(what, ": the object belongs to uid ", st.st_uid,
                                                        ", the client runs as uid ", peer.uid));
  }
  close(fd);
  return id;
}

absl::StatusOr<uint64_t> RegionRegistry::RegisterFd(const std::string& session, const std::string& secret,
                                                    int64_t peer_uid, const std::string& name, int fd,
                                                    int64_t offset, int64_t byte_size) {
  const std::string what = absl::StrCat("region '", name, "' (file descriptor)");
  if (absl::Status s = CheckSecret(session, secret); !s.ok()) return absl::PermissionDeniedError(absl::StrCat(what, ": ", s.message()));
  int64_t session_uid = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sessions_.find(session);
    if (it != sessions_.end()) session_uid = it->second.uid;
  }
  // Defence in depth behind the secret: the fd must come from the user who opened the session (or,
  // where the kernel did not name that user, from the server's own).
  const int64_t want = session_uid >= 0 ? session_uid : static_cast<int64_t>(geteuid());
  if (peer_uid != want) {
    return absl::PermissionDeniedError(absl::StrCat(what, ": the sending process runs as uid ", peer_uid, ", the session's ",
                                                    session_uid >= 0 ? "client" : "server (the client's uid is unknown)",
                                                    " as uid ", want));
  }
  struct stat st {};
  const int mode = fcntl(fd, F_GETFL);
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || mode < 0 || (mode & O_ACCMODE) != O_RDWR) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": the descriptor must be a regular file opened read-write (memfd_create, or shm_open with O_RDWR)"));
  }
  return MapFile(session, name, what, fd, offset, byte_size);
}

absl::StatusOr<uint64_t> RegionRegistry::MapFile(const std::string& session, const std::string& name,
                                                 const std::string& what, int fd, int64_t offset, int64_t byte_size) {
  if (offset < 0 || byte_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": offset must be >= 0 and byte_size > 0, got offset ", offset, ", byte_size ", byte_size));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) return absl::InternalError(absl::StrCat(what, ": fstat failed: ", std::strerror(errno)));
  if (offset > st.st_size || byte_size > st.st_size - offset) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": offset ", offset, " + byte_size ", byte_size,
                                                   " exceeds the object's size of ", st.st_size, " bytes"));
  }
  const int64_t page = sysconf(_SC_PAGESIZE);
  const int64_t aligned = offset / page * page;
  auto region = std::make_shared<Region>();
  region->session = session;
  region->name = name;
  region->shm_name = what;
  region->shm_dev = st.st_dev;
  region->shm_ino = st.st_ino;
  region->map_len = static_cast<size_t>(byte_size + (offset - aligned));
  {  // before mmap: the address space is the server's, the file's size the client's choice
    std::lock_guard<std::mutex> lock(mu_);
    if (absl::Status s = CheckRoomLocked(session, 0, static_cast<int64_t>(region->map_len)); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
    }
  }
  void* p = mmap(nullptr, region->map_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, aligned);
  if (p == MAP_FAILED) return absl::InternalError(absl::StrCat(what, ": mmap failed: ", std::strerror(errno)));
  region->map_base = p;
  WatchSharedMapping(p, region->map_len, &region->lost);
  region->data = static_cast<uint8_t*>(p) + (offset - aligned);
  region->byte_size = byte_size;
  // A GPU server copies chunks between the region and the device: page-locked, they move at the
  // bus's speed instead of through the driver's bounce buffers. Best effort (locked-memory limits).
  if (cuda_device_ >= 0) {
    absl::StatusOr<std::unique_ptr<PinnedHostRange>> pinned = PinHostMemory(p, static_cast<int64_t>(region->map_len), cuda_device_);
    if (pinned.ok()) region->pinned = *std::move(pinned);
  }
  return Add(session, std::move(region));
}

absl::StatusOr<uint64_t> RegionRegistry::RegisterCudaIpc(const std::string& session, const std::string& name,
                                                         const std::string& ipc_handle, int64_t offset,
                                                         int64_t byte_size) {
  const std::string what = absl::StrCat("region '", name, "' (CUDA IPC)");
  if (cuda_device_ < 0) {
    return absl::UnimplementedError(absl::StrCat(
        what, ": this server's engine is not on a GPU (start it with --backend=cuda and --tp-size=1 for device regions)"));
  }
  if (offset < 0 || byte_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": offset must be >= 0 and byte_size > 0, got offset ", offset, ", byte_size ", byte_size));
  }
  absl::StatusOr<std::shared_ptr<ImportedDeviceMemory>> mem = OpenIpc(ipc_handle);
  if (!mem.ok()) return absl::Status(mem.status().code(), absl::StrCat(what, ": ", mem.status().message()));
  if (offset > (*mem)->size() || byte_size > (*mem)->size() - offset) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": offset ", offset, " + byte_size ", byte_size,
                                                   " exceeds the allocation's size of ", (*mem)->size(), " bytes"));
  }
  auto region = std::make_shared<Region>();
  region->session = session;
  region->name = name;
  region->data = (*mem)->data() + offset;
  region->byte_size = byte_size;
  region->device_memory = *std::move(mem);
  return Add(session, std::move(region));
}

absl::StatusOr<std::shared_ptr<ImportedDeviceMemory>> RegionRegistry::OpenIpc(const std::string& ipc_handle) {
  std::lock_guard<std::mutex> lock(ipc_mu_);
  auto it = ipc_open_.find(ipc_handle);
  if (it != ipc_open_.end()) {
    if (std::shared_ptr<ImportedDeviceMemory> open = it->second.lock()) return open;
  }
  absl::StatusOr<std::unique_ptr<ImportedDeviceMemory>> mem = ImportCudaIpcMemory(ipc_handle, cuda_device_);
  if (!mem.ok()) return mem.status();
  std::shared_ptr<ImportedDeviceMemory> open(std::move(*mem));
  ipc_open_[ipc_handle] = open;
  // Forget handles whose mappings are gone (the client may free and reuse allocations).
  for (auto j = ipc_open_.begin(); j != ipc_open_.end();) j = j->second.expired() ? ipc_open_.erase(j) : std::next(j);
  return open;
}

absl::StatusOr<uint64_t> RegionRegistry::RegisterServerMemory(const std::string& session, const std::string& name,
                                                              int64_t byte_size) {
  const std::string what = absl::StrCat("region '", name, "' (server memory)");
  if (max_server_bytes_ <= 0) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": this server has no data plane (--data-port)"));
  }
  if (byte_size <= 0) return absl::InvalidArgumentError(absl::StrCat(what, ": byte_size must be > 0"));
  {  // checked before allocating; Add checks again under the same lock as it inserts
    std::lock_guard<std::mutex> lock(mu_);
    if (absl::Status s = CheckRoomLocked(session, byte_size); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
    }
  }
  auto region = std::make_shared<Region>();
  region->session = session;
  region->name = name;
  region->byte_size = byte_size;
  // On a GPU server the memory is the GPU's: the data plane copies each piece on as it arrives
  // (and off as it leaves), overlapped with the socket, and the engine reads and writes it in
  // place, as it does a CUDA IPC region. Host memory where the GPU has no room.
  if (cuda_device_ >= 0) {
    absl::StatusOr<std::unique_ptr<DeviceBuffer>> d = AllocateDeviceBuffer(byte_size, cuda_device_);
    if (d.ok() && ZeroDeviceMemory((*d)->data(), byte_size, cuda_device_).ok()) {
      region->owned_device = *std::move(d);
      region->data = region->owned_device->data();
      return Add(session, std::move(region));
    }
  }
  const int64_t page = sysconf(_SC_PAGESIZE);
  const size_t len = static_cast<size_t>((byte_size + page - 1) / page * page);
  // Fresh anonymous pages are the kernel's zeros: never another client's bytes from the heap (issue
  // 35, item 1), and nothing is committed before the client writes it.
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return absl::ResourceExhaustedError(absl::StrCat(what, ": out of host memory"));
  region->owned = p;
  region->owned_len = len;
  region->data = static_cast<uint8_t*>(region->owned);
  if (cuda_device_ >= 0) {
    absl::StatusOr<std::unique_ptr<PinnedHostRange>> pinned = PinHostMemory(region->owned, static_cast<int64_t>(len), cuda_device_);
    if (pinned.ok()) region->pinned = *std::move(pinned);
  }
  return Add(session, std::move(region));
}

absl::StatusOr<uint64_t> RegionRegistry::Register(const std::string& session, const Peer& peer,
                                                  const v1::RegisterRegion& r) {
  const bool shm = !r.shm_name().empty(), ipc = !r.cuda_ipc_handle().empty(), own = r.server_memory();
  if (int(shm) + int(ipc) + int(own) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("region '", r.name(),
                                                   "': set exactly one of shm_name, cuda_ipc_handle and server_memory"));
  }
  if (own) {
    if (r.offset() != 0) return absl::InvalidArgumentError("a server_memory region has offset 0");
    return RegisterServerMemory(session, r.name(), r.byte_size());
  }
  if (ipc) return RegisterCudaIpc(session, r.name(), r.cuda_ipc_handle(), r.offset(), r.byte_size());
  return Register(session, peer, r.name(), r.shm_name(), r.offset(), r.byte_size());
}

absl::Status RegionRegistry::CheckRoomLocked(const std::string& session, int64_t server_bytes,
                                             int64_t mapped_bytes) const {
  size_t held = 0;
  int64_t held_bytes = 0, all_bytes = 0, held_mapped = 0, all_mapped = 0;
  for (const auto& [_, r] : regions_) {
    const int64_t own = r->server_memory() ? r->byte_size : 0, mapped = static_cast<int64_t>(r->map_len);
    all_bytes += own;
    all_mapped += mapped;
    if (r->session != session) continue;
    held += 1;
    held_bytes += own;
    held_mapped += mapped;
  }
  if (max_total_server_bytes_ > 0 && server_bytes > max_total_server_bytes_ - all_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(server_bytes, " bytes more than the ", all_bytes,
                                                     " all sessions hold would pass the server's limit of ",
                                                     max_total_server_bytes_, " (--data-plane-total-bytes)"));
  }
  if (held >= kMaxRegionsPerSession) {
    return absl::ResourceExhaustedError(absl::StrCat("the session already holds ", held,
                                                     " regions, the most one session may register"));
  }
  if (server_bytes > max_server_bytes_ - held_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(server_bytes, " bytes more than the session's ", held_bytes,
                                                     " would pass its limit of ", max_server_bytes_));
  }
  if (mapped_bytes > max_total_mapped_bytes_ - all_mapped) {
    return absl::ResourceExhaustedError(absl::StrCat("mapping ", mapped_bytes, " bytes more than the ", all_mapped,
                                                     " all sessions have mapped would pass the server's limit of ",
                                                     max_total_mapped_bytes_, " (--shm-total-bytes)"));
  }
  if (mapped_bytes > max_mapped_bytes_ - held_mapped) {
    return absl::ResourceExhaustedError(absl::StrCat("mapping ", mapped_bytes, " bytes more than the session's ",
                                                     held_mapped, " would pass its limit of ", max_mapped_bytes_,
                                                     " (--shm-bytes-per-session)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> RegionRegistry::Add(const std::string& session, std::shared_ptr<Region> region) {
  std::lock_guard<std::mutex> lock(mu_);
  // A registration racing the session's end must not leave a region that nothing releases.
  LCE_RETURN_IF_ERROR(CheckOpenLocked(session));
  // One session's memory is not another's: the same object (by inode), or the same CUDA allocation
  // (a handle another session registered, leaked or guessed), is refused to any other session.
  for (const auto& [_, r] : regions_) {
    if (r->session == session) continue;
    if (region->shm_ino != 0 && r->shm_ino == region->shm_ino && r->shm_dev == region->shm_dev) {
      return absl::PermissionDeniedError(absl::StrCat("region '", region->name, "' (", region->shm_name,
                                                      "): the object is registered by another session"));
    }
    if (region->device_memory != nullptr && r->device_memory == region->device_memory) {
      return absl::PermissionDeniedError(absl::StrCat("region '", region->name,
                                                      "' (CUDA IPC): the allocation is registered by another session"));
    }
  }
  if (absl::Status s = CheckRoomLocked(session, region->server_memory() ? region->byte_size : 0,
                                       static_cast<int64_t>(region->map_len));
      !s.ok()) {
    return s;
  }
  const uint64_t id = next_id_++;
  regions_.emplace(id, std::move(region));
  return id;
}

absl::Status RegionRegistry::Unregister(const std::string& session, uint64_t region_id) {
  std::shared_ptr<const Region> gone;  // unmapped outside the lock
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.find(region_id);
  if (it == regions_.end()) return absl::NotFoundError(absl::StrCat("region ", region_id, " is not registered"));
  if (it->second->session != session) {
    return absl::PermissionDeniedError(absl::StrCat("region ", region_id, " belongs to another session"));
  }
  gone = std::move(it->second);
  regions_.erase(it);
  return absl::OkStatus();
}

int RegionRegistry::ReleaseSession(const std::string& session) {
  std::vector<std::shared_ptr<const Region>> gone;  // unmapped after the lock is released
  std::lock_guard<std::mutex> lock(mu_);
  sessions_.erase(session);
  for (auto it = regions_.begin(); it != regions_.end();) {
    if (it->second->session == session) {
      gone.push_back(std::move(it->second));
      it = regions_.erase(it);
    } else {
      ++it;
    }
  }
  return static_cast<int>(gone.size());
}

absl::StatusOr<RegionRegistry::Slice> RegionRegistry::Resolve(const std::string& session, const std::string& secret,
                                                             const v1::RegionSlice& slice, int64_t bytes_needed,
                                                             const char* what) const {
  if (session.empty() || secret.empty()) {
    return absl::PermissionDeniedError(absl::StrCat(
        what, ": the request carries no ", session.empty() ? "lce-session" : "lce-session-secret",
        " metadata: a request that names regions carries its session's id (lce-session) and secret "
        "(lce-session-secret, SessionResponse.session_secret)"));
  }
  // The session's secret and the region are read under one hold of mu_, as ReleaseSession drops a session
  // and its regions: a session that ends mid-request answers PERMISSION_DENIED, as one that ended before it
  // (read apart, the soak saw NOT_FOUND once for a session closed mid-request).
  std::string want;
  std::shared_ptr<const Region> r;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto s = sessions_.find(session); s != sessions_.end()) want = s->second.secret;
    if (auto it = regions_.find(slice.region_id()); it != regions_.end()) r = it->second;
  }
  if (absl::Status s = SecretMatches(want, secret); !s.ok()) {
    return absl::PermissionDeniedError(absl::StrCat(what, ": lce-session and lce-session-secret: ", s.message()));
  }
  if (r == nullptr) {
    return absl::NotFoundError(
        absl::StrCat(what, ": region ", slice.region_id(), " is not registered (never, or unregistered)"));
  }
  if (r->session != session) {
    return absl::PermissionDeniedError(
        absl::StrCat(what, ": region ", slice.region_id(), " belongs to another session than the request's lce-session"));
  }
  LCE_RETURN_IF_ERROR(LostError(*r, what));
  // Every term is checked as signed: a negative size would pass the bound below and wrap to a huge
  // span (issue 16: a read of length -1 streamed the heap, a write overflowed it).
  if (slice.offset() < 0 || slice.byte_size() < 0 || bytes_needed < 0 || slice.byte_size() != bytes_needed ||
      slice.offset() > r->byte_size || slice.byte_size() > r->byte_size - slice.offset()) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": slice at offset ", slice.offset(), " of ", slice.byte_size(), " bytes does not fit: region ",
        slice.region_id(), " ('", r->name, "') has ", r->byte_size, " bytes and the chunk needs exactly ",
        bytes_needed, " bytes there"));
  }
  return Slice{absl::Span<uint8_t>(r->data + slice.offset(), static_cast<size_t>(bytes_needed)), r,
               r->device_memory != nullptr || r->owned_device != nullptr, r->server_memory(), r.get()};
}

absl::Status RegionRegistry::LostError(const Region& r, const char* what) {
  if (!r.lost.load(std::memory_order_acquire)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      what, ": region '", r.name, "' (", r.shm_name, ") is gone: the shm object was shrunk below the region while "
      "the server had it mapped; unregister it and register a new one"));
}

absl::Status RegionRegistry::CheckIntact(const Slice& slice, const char* what) {
  if (slice.region == nullptr) return absl::OkStatus();
  // A GPU server's copies of a page-locked region never fault: one read of the slice's last byte
  // from here does, when the object now ends before it (an object shrinks from its end).
  if (slice.region->map_base != nullptr && !slice.bytes.empty()) {
    const volatile uint8_t* last = slice.bytes.data() + slice.bytes.size() - 1;
    (void)*last;
  }
  return LostError(*slice.region, what);
}

RegionRegistry::Counts RegionRegistry::counts() const {
  std::lock_guard<std::mutex> lock(mu_);
  Counts c;
  for (const auto& [_, r] : regions_) {
    (r->device_memory != nullptr ? c.device : r->server_memory() ? c.server : c.shm) += 1;
  }
  return c;
}

size_t RegionRegistry::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return regions_.size();
}

}  // namespace lce::server
