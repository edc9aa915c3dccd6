// Fuzz target: the data plane's transfer sequence (proto/lce/v1/data_plane_wire.h) as
// RegionDataPlane::Serve reads it, without the socket: each 96-byte request header decoded, its
// length and op checked, its session's secret checked (RegionRegistry::CheckSecret), its (session,
// region, offset, length) resolved by RegionRegistry::Resolve
// against the server-memory regions of two sessions, and the transfer's bytes moved in or out of
// the resolved span. A span outside its region is caught by the checks below (region sizes are
// known here) or by ASan; the header encoding must round-trip.
//
// Input: transfers one after another: a control byte (bit 0: put the magic in, bit 1: put session
// A's id and secret in, bit 2: session B's, bit 3: then spoil the secret: so that mutations reach
// the resolve; the sessions' keys are random), 96 header bytes, then for a
// write as many payload bytes as the header's length (what the input has left of them).
#include <cstring>

#include "fuzz_common.h"
#include "lce/v1/data_plane_wire.h"
#include "region_registry.h"

namespace lce::server {
namespace {

namespace wire = v1::data_plane;

constexpr int64_t kMaxWriteBytes = int64_t{4} << 30;  // RegionDataPlaneOptions::max_write_bytes

void Run(const uint8_t* data, size_t size) {
  RegionRegistry regions(-1);
  regions.EnableServerMemory(1 << 16, 1 << 18);
  const RegionRegistry::SessionKeys a = regions.OpenSession(), b = regions.OpenSession();
  std::map<uint64_t, std::pair<std::string, int64_t>> sizes;  // region -> (session, bytes)
  for (auto [session, bytes] : {std::pair<std::string, int64_t>{a.id, 4096}, {a.id, 100}, {b.id, 64}}) {
    absl::StatusOr<uint64_t> id = regions.RegisterServerMemory(session, "r", bytes);
    LCE_FUZZ_CHECK(id.ok(), "%s", std::string(id.status().message()).c_str());
    sizes[*id] = {session, bytes};
  }
  size_t at = 0;
  for (int transfer = 0; transfer < 64 && size - at >= 1 + wire::kHeaderBytes; ++transfer) {
    const uint8_t control = data[at];
    uint8_t head[wire::kHeaderBytes];
    std::memcpy(head, data + at + 1, sizeof(head));
    at += 1 + sizeof(head);
    if (control & 1) std::memcpy(head, wire::kMagic, 4);
    for (const auto& [bit, keys] : {std::pair<int, const RegionRegistry::SessionKeys*>{2, &a}, {4, &b}}) {
      if ((control & bit) == 0) continue;
      std::memcpy(head + 8, keys->id.data(), 32);
      std::memcpy(head + 40, keys->secret.data(), 32);
    }
    if (control & 8) head[40] ^= 1;
    wire::TransferHeader h;
    if (!wire::DecodeTransferHeader(head, &h)) return;  // Serve: bad magic, the connection ends
    uint8_t again[wire::kHeaderBytes];
    wire::EncodeTransferHeader(h, again);
    LCE_FUZZ_CHECK(std::memcmp(head, again, sizeof(head)) == 0, "the header does not round-trip");
    if (h.length < 0) return;  // Serve: refused, and the connection ends
    const bool write = h.op == wire::kOpWrite;
    v1::RegionSlice slice;
    slice.set_region_id(h.region_id);
    slice.set_offset(h.offset);
    slice.set_byte_size(h.length);
    if (h.op != wire::kOpWrite && h.op != wire::kOpRead) {
      if (!write) continue;
    }
    const absl::Status secret = regions.CheckSecret(h.session_id, h.secret);
    LCE_FUZZ_CHECK(secret.ok() == ((h.session_id == a.id && h.secret == a.secret) ||
                                   (h.session_id == b.id && h.secret == b.secret)),
                   "the secret check let a wrong secret in, or kept the right one out");
    absl::StatusOr<RegionRegistry::Slice> s =
        secret.ok() ? regions.Resolve(h.session_id, h.secret, slice, h.length, "data plane") : absl::StatusOr<RegionRegistry::Slice>(secret);
    const size_t payload = write ? static_cast<size_t>(std::min<int64_t>(h.length, static_cast<int64_t>(size - at))) : 0;
    if (s.ok()) {
      auto it = sizes.find(h.region_id);
      LCE_FUZZ_CHECK(it != sizes.end(), "resolved unknown region %llu", static_cast<unsigned long long>(h.region_id));
      LCE_FUZZ_CHECK(it->second.first == h.session_id, "resolved another session's region");
      LCE_FUZZ_CHECK(s->server_memory && !s->device, "kind");
      LCE_FUZZ_CHECK(static_cast<int64_t>(s->bytes.size()) == h.length, "span of %zu bytes for %lld", s->bytes.size(),
                     static_cast<long long>(h.length));
      LCE_FUZZ_CHECK(h.offset >= 0 && h.offset <= it->second.second && h.length <= it->second.second - h.offset,
                     "slice [%lld, +%lld) outside a region of %lld bytes", static_cast<long long>(h.offset),
                     static_cast<long long>(h.length), static_cast<long long>(it->second.second));
      if (write) {
        std::memcpy(s->bytes.data(), data + at, payload);
        std::memset(s->bytes.data() + payload, 0, s->bytes.size() - payload);
      } else {
        volatile uint8_t sum = 0;
        for (uint8_t b : s->bytes) sum = static_cast<uint8_t>(sum + b);
      }
    } else if (write && h.length > kMaxWriteBytes) {
      return;  // Serve: not drained; the connection ends
    }
    at += payload;
    if (payload < static_cast<size_t>(write ? h.length : 0)) return;  // the peer went away mid-payload
    uint8_t reply[wire::kReplyHeaderBytes];
    const std::string msg = s.ok() ? std::string() : std::string(s.status().message());
    wire::EncodeReplyHeader(static_cast<int32_t>(s.status().code()), static_cast<uint32_t>(msg.size()), reply);
    int32_t code = 0;
    uint32_t len = 0;
    wire::DecodeReplyHeader(reply, &code, &len);
    LCE_FUZZ_CHECK(code == static_cast<int32_t>(s.status().code()) && len == msg.size(), "reply round trip");
  }
}

void WriteSeeds(const std::string& dir) {
  // Sessions by control bit (2: A, 4: B; 8 spoils the secret); their keys are made per run.
  auto transfer = [](std::string& out, uint8_t control, uint32_t op, uint64_t region, int64_t offset, int64_t length,
                     bool payload) {
    wire::TransferHeader h{op, "", "", region, offset, length};
    uint8_t head[wire::kHeaderBytes];
    wire::EncodeTransferHeader(h, head);
    out.push_back(static_cast<char>(control));
    out.append(reinterpret_cast<const char*>(head), sizeof(head));
    if (payload) out.append(static_cast<size_t>(length), '\x5a');
  };
  std::string s;
  transfer(s, 2, wire::kOpWrite, 1, 0, 64, true);
  transfer(s, 2, wire::kOpRead, 1, 32, 32, false);
  transfer(s, 2, wire::kOpWrite, 2, 90, 10, true);
  fuzz::WriteSeed(dir, "write_then_read", s);
  s.clear();
  transfer(s, 4, wire::kOpRead, 1, 0, 16, false);   // another session's region
  transfer(s, 2, wire::kOpWrite, 2, 96, 8, true);   // past the end
  transfer(s, 2, wire::kOpRead, 9, 0, 8, false);    // unknown region
  transfer(s, 2, 7, 1, 0, 8, false);                // unknown op
  transfer(s, 2, wire::kOpRead, 1, -8, 8, false);   // negative offset
  transfer(s, 2, wire::kOpRead, 1, 0, -1, false);   // negative length
  transfer(s, 10, wire::kOpRead, 1, 0, 16, false);  // a wrong secret
  fuzz::WriteSeed(dir, "refusals", s);
  s.clear();
  transfer(s, 3, wire::kOpRead, 3, 0, 64, false);
  transfer(s, 5, wire::kOpWrite, 3, INT64_MAX, 2, true);
  fuzz::WriteSeed(dir, "controls", s);
}

}  // namespace
}  // namespace lce::server

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  lce::fuzz::MaybeWriteSeeds(lce::server::WriteSeeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  lce::server::Run(data, size);
  return 0;
}
