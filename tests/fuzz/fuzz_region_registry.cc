// Fuzz target: region registration (OpenSession's RegisterRegion, lce.v1.RegisterRegion) and the
// uses of a registered region, through RegionRegistry's public functions: Register (a serialized
// RegisterRegion, or a name, shm name, offset and size), Resolve of a slice (whose bytes are then
// touched end to end), Unregister, ReleaseSession, IdentifyPeer of a gRPC peer string, and RegisterFd
// of a sparse memfd of any size (mapped only within the mapped-bytes caps: issue 35, item 2). The peer
// is local or remote, its uid ours, unknown or another. Two POSIX shm objects of ours exist for the
// shm names to find (the seeds name them); server memory is capped at 64 KiB a session.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fuzz_common.h"
#include "google/protobuf/stubs/logging.h"
#include "region_registry.h"

namespace lce::server {
namespace {

const char* kShmA = "/lce_fuzz_region_a";  // 8192 bytes
const char* kShmB = "/lce_fuzz_region_b";  // 100 bytes
constexpr int64_t kMappedPerSession = int64_t{1} << 20;  // the mapped-bytes caps, small enough to meet

void MakeShm() {
  for (auto [name, bytes] : {std::pair<const char*, off_t>{kShmA, 8192}, {kShmB, 100}}) {
    const int fd = shm_open(name, O_RDWR | O_CREAT, 0600);
    if (fd < 0 || ftruncate(fd, bytes) != 0) {
      std::perror("shm_open");
      std::exit(1);
    }
    close(fd);
  }
  std::atexit([] {
    shm_unlink(kShmA);
    shm_unlink(kShmB);
  });
}

// Input: records (fuzz_common.h), each an operation: byte 0 the operation, byte 1 the session
// (s0, s1 or none), byte 2 the peer (bit 0: local; bits 1-2: uid ours, unknown, another; bit 3:
// Resolve asks for other than the slice's size; bit 4: Resolve shows the next session's secret), the
// rest its argument: a serialized RegisterRegion (register), RegionSlice (resolve), a little-endian
// region id (unregister), a peer string.
void Run(const uint8_t* data, size_t size) {
  RegionRegistry regions(-1);
  regions.EnableServerMemory(1 << 16, 1 << 17);
  regions.AllowShmByName(true);  // the name path is parsed too (--allow-shm-by-name)
  regions.LimitMappedBytes(kMappedPerSession, 3 * kMappedPerSession / 2);  // issue 35, item 2
  // Two open sessions (a released one stays closed: its registrations are refused) and none.
  const RegionRegistry::SessionKeys keys[3] = {regions.OpenSession(), regions.OpenSession(), {}};
  const std::string sessions[3] = {keys[0].id, keys[1].id, ""};
  std::map<uint64_t, std::pair<std::string, int64_t>> held;  // what Register returned: (session, bytes)
  fuzz::Records records(data, size);
  std::string_view rec;
  for (int op = 0; op < 64 && records.Next(&rec); ++op) {
    if (rec.size() < 3) continue;
    const std::string& session = sessions[static_cast<uint8_t>(rec[1]) % 3];
    // The session's secret, or (flag bit 4) the other session's: a request's proof (issue 35, item 12).
    const std::string& secret = keys[(static_cast<uint8_t>(rec[1]) + ((rec[2] & 16) ? 1 : 0)) % 3].secret;
    const uint8_t flags = static_cast<uint8_t>(rec[2]);
    RegionRegistry::Peer peer;
    peer.local = flags & 1;
    const int who = (flags >> 1) & 3;
    peer.uid = who == 0 ? static_cast<int64_t>(getuid()) : who == 1 ? -1 : 4242;
    const std::string arg(rec.substr(3));
    switch (static_cast<uint8_t>(rec[0]) % 6) {
      case 0: {
        v1::RegisterRegion r;
        if (!r.ParseFromString(arg)) break;
        absl::StatusOr<uint64_t> id = regions.Register(session, peer, r);
        if (!id.ok()) {
          LCE_FUZZ_CHECK(!id.status().message().empty(), "an error without a message");
          break;
        }
        LCE_FUZZ_CHECK(held.count(*id) == 0, "region id %llu given twice", static_cast<unsigned long long>(*id));
        LCE_FUZZ_CHECK(r.byte_size() > 0, "a region of %lld bytes", static_cast<long long>(r.byte_size()));
        LCE_FUZZ_CHECK(r.server_memory() || (peer.local && peer.uid == static_cast<int64_t>(getuid())),
                       "shared memory by name for a peer that may not have it");
        held[*id] = {session, r.byte_size()};
        break;
      }
      case 1: {
        v1::RegionSlice slice;
        if (!slice.ParseFromString(arg)) break;
        // A size off by a few bytes from the slice's, where that does not overflow (a byte_size near
        // INT64_MAX plus a shift is the harness's own undefined behaviour, not the registry's).
        int64_t needed = slice.byte_size();
        if (int64_t shifted = 0; flags & 8 && !__builtin_add_overflow(needed, static_cast<int8_t>(rec[2]), &shifted)) {
          needed = shifted;
        }
        absl::StatusOr<RegionRegistry::Slice> s = regions.Resolve(session, secret, slice, needed, "hidden_region");
        if (!s.ok()) break;
        LCE_FUZZ_CHECK(!(flags & 16), "resolved with another session's secret");
        auto it = held.find(slice.region_id());
        LCE_FUZZ_CHECK(it != held.end(), "resolved an unknown region");
        LCE_FUZZ_CHECK(it->second.first == session && !session.empty(), "resolved another session's region");
        LCE_FUZZ_CHECK(slice.offset() >= 0 && needed >= 0 && slice.offset() <= it->second.second &&
                           needed <= it->second.second - slice.offset(),
                       "slice [%lld, +%lld) outside %lld bytes", static_cast<long long>(slice.offset()),
                       static_cast<long long>(needed), static_cast<long long>(it->second.second));
        LCE_FUZZ_CHECK(static_cast<int64_t>(s->bytes.size()) == needed, "span size");
        if (!s->bytes.empty()) {  // the first and last bytes are the region's (ASan, or SIGSEGV past a mapping)
          s->bytes[0] ^= 1;
          s->bytes[0] ^= 1;
          s->bytes[s->bytes.size() - 1] ^= 1;
          s->bytes[s->bytes.size() - 1] ^= 1;
        }
        break;
      }
      case 2: {
        uint64_t id = 0;
        std::memcpy(&id, arg.data(), std::min(arg.size(), sizeof(id)));
        absl::Status s = regions.Unregister(session, id);
        if (s.ok()) {
          LCE_FUZZ_CHECK(held.count(id) == 1 && held[id].first == session, "unregistered another's region");
          held.erase(id);
        }
        break;
      }
      case 3: {
        const int n = regions.ReleaseSession(session);
        int mine = 0;
        for (auto it = held.begin(); it != held.end();) {
          if (it->second.first == session) {
            ++mine;
            it = held.erase(it);
          } else {
            ++it;
          }
        }
        LCE_FUZZ_CHECK(n == mine, "released %d regions of %d", n, mine);
        break;
      }
      case 4:
        (void)RegionRegistry::IdentifyPeer(arg);
        break;
      case 5: {  // a sparse memfd handed over (the shm socket's path): mapped only within the caps
        int64_t v[3] = {0, 0, 0};  // the object's size, the region's offset and size
        std::memcpy(v, arg.data(), std::min(arg.size(), sizeof(v)));
        const int64_t object = v[0] & ((int64_t{1} << 44) - 1);  // sparse: up to 16 TiB costs nothing
        const int fd = memfd_create("lce_fuzz_sparse", MFD_CLOEXEC);
        if (fd < 0 || ftruncate(fd, object) != 0) {
          if (fd >= 0) close(fd);
          break;
        }
        absl::StatusOr<uint64_t> id = regions.RegisterFd(session, secret, static_cast<int64_t>(getuid()), "sparse", fd,
                                                         v[1], v[2]);
        close(fd);
        if (!id.ok()) break;
        LCE_FUZZ_CHECK(v[2] > 0 && v[2] <= kMappedPerSession, "mapped %lld bytes of a sparse file",
                       static_cast<long long>(v[2]));
        LCE_FUZZ_CHECK(held.count(*id) == 0, "region id %llu given twice", static_cast<unsigned long long>(*id));
        held[*id] = {session, v[2]};
        break;
      }
    }
    LCE_FUZZ_CHECK(regions.size() == held.size(), "%zu regions held, %zu registered", regions.size(), held.size());
  }
}

void WriteSeeds(const std::string& dir) {
  auto op = [](std::string& out, uint8_t code, uint8_t session, uint8_t flags, const std::string& arg) {
    fuzz::AppendRecord(out, std::string({static_cast<char>(code), static_cast<char>(session), static_cast<char>(flags)}) + arg);
  };
  auto reg = [](const char* shm, int64_t offset, int64_t bytes) {
    v1::RegisterRegion r;
    r.set_name("hidden");
    if (shm == nullptr) {
      r.set_server_memory(true);
    } else {
      r.set_shm_name(shm);
      r.set_offset(offset);
    }
    r.set_byte_size(bytes);
    return r.SerializeAsString();
  };
  auto slice = [](uint64_t id, int64_t offset, int64_t bytes) {
    v1::RegionSlice s;
    s.set_region_id(id);
    s.set_offset(offset);
    s.set_byte_size(bytes);
    return s.SerializeAsString();
  };
  auto id = [](uint64_t v) { return std::string(reinterpret_cast<const char*>(&v), sizeof(v)); };
  std::string s;
  op(s, 0, 0, 1, reg(kShmA, 0, 8192));      // 1: s0's, shm by name from a local peer of our uid
  op(s, 0, 0, 1, reg(kShmB, 50, 50));       // 2
  op(s, 0, 1, 1, reg(kShmA, 4096, 100));    // refused: s0 holds the object
  op(s, 0, 1, 1, reg(nullptr, 0, 4096));    // 3: s1's server memory
  op(s, 1, 0, 0, slice(1, 8000, 192));
  op(s, 1, 0, 0, slice(2, 0, 50));
  op(s, 1, 1, 0, slice(1, 0, 8));           // another session's
  op(s, 1, 1, 0, slice(3, 4000, 96));
  op(s, 1, 1, 8, slice(3, 4000, 96));       // the chunk needs other than the slice's size
  op(s, 2, 1, 0, id(1));                    // another session's
  op(s, 2, 0, 0, id(2));
  op(s, 3, 0, 0, "");
  op(s, 4, 0, 0, "ipv4:127.0.0.1:1");
  auto sparse = [](int64_t object, int64_t offset, int64_t bytes) {
    const int64_t v[3] = {object, offset, bytes};
    return std::string(reinterpret_cast<const char*>(v), sizeof(v));
  };
  op(s, 5, 0, 0, sparse(int64_t{1} << 40, 0, int64_t{1} << 40));  // refused: over the caps
  op(s, 5, 0, 0, sparse(8192, 0, 4096));
  fuzz::WriteSeed(dir, "sessions", s);
  s.clear();
  op(s, 0, 0, 0, reg(kShmA, 0, 64));        // a remote peer
  op(s, 0, 0, 3, reg(kShmA, 0, 64));        // uid unknown
  op(s, 0, 0, 5, reg(kShmA, 0, 64));        // another uid
  op(s, 0, 0, 1, reg("/lce_fuzz_region_none", 0, 64));
  op(s, 0, 0, 1, reg(kShmB, 0, 101));       // past the object
  op(s, 0, 0, 1, reg(kShmB, -1, 10));
  op(s, 0, 2, 1, reg(nullptr, 0, 1 << 17)); // over the session's limit
  op(s, 1, 2, 0, slice(1, 0, 8));           // no session
  fuzz::WriteSeed(dir, "refusals", s);
}

}  // namespace
}  // namespace lce::server

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);  // invalid UTF-8 in string fields is logged, and fuzzed often
  lce::fuzz::MaybeWriteSeeds(lce::server::WriteSeeds);
  lce::server::MakeShm();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  lce::server::Run(data, size);
  return 0;
}
