// The data plane's wire format (lce_server --data-port; GetInfoResponse.data_port), the one
// definition the server (server/transport/region_data_plane.h) and the C++ client (client/
// data_plane_connection.h) both encode and decode with. Little-endian, one transfer after another
// on a connection:
//   request  96 bytes: "LCE2", u32 op (1 write, 2 read), 32 bytes session id (hex), 32 bytes the
//            session's secret (hex, SessionResponse.session_secret), u64 region_id, i64 offset,
//            i64 length; a write then sends `length` bytes;
//   reply    i32 code (google.rpc.Code), u32 message length, the message; a read that succeeded
//            then sends `length` bytes.
// With lce_server --data-plane-tls (GetInfoResponse.data_plane_tls) the same bytes go inside TLS.
// (The Python client, client/python/lce_client/_data_plane.py, writes the same with struct.)
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace lce::v1::data_plane {

// "LCE1" was the header without the secret (before issue 22); a server answers it "bad magic".
inline constexpr char kMagic[4] = {'L', 'C', 'E', '2'};
inline constexpr uint32_t kOpWrite = 1, kOpRead = 2;
inline constexpr size_t kHeaderBytes = 96, kSessionIdBytes = 32, kSecretBytes = 32, kReplyHeaderBytes = 8;

struct TransferHeader {
  uint32_t op = 0;
  std::string session_id;  // kSessionIdBytes characters
  std::string secret;      // kSecretBytes characters
  uint64_t region_id = 0;
  int64_t offset = 0, length = 0;
};

// The 96 request bytes of `h` (a session id or secret of another length is cut or zero-padded to 32).
inline void EncodeTransferHeader(const TransferHeader& h, uint8_t out[kHeaderBytes]) {
  std::memset(out, 0, kHeaderBytes);
  std::memcpy(out, kMagic, 4);
  std::memcpy(out + 4, &h.op, 4);
  std::memcpy(out + 8, h.session_id.data(), std::min(kSessionIdBytes, h.session_id.size()));
  std::memcpy(out + 40, h.secret.data(), std::min(kSecretBytes, h.secret.size()));
  std::memcpy(out + 72, &h.region_id, 8);
  std::memcpy(out + 80, &h.offset, 8);
  std::memcpy(out + 88, &h.length, 8);
}

// False when the bytes do not start with the magic.
inline bool DecodeTransferHeader(const uint8_t in[kHeaderBytes], TransferHeader* h) {
  if (std::memcmp(in, kMagic, 4) != 0) return false;
  std::memcpy(&h->op, in + 4, 4);
  h->session_id.assign(reinterpret_cast<const char*>(in + 8), kSessionIdBytes);
  h->secret.assign(reinterpret_cast<const char*>(in + 40), kSecretBytes);
  std::memcpy(&h->region_id, in + 72, 8);
  std::memcpy(&h->offset, in + 80, 8);
  std::memcpy(&h->length, in + 88, 8);
  return true;
}

inline void EncodeReplyHeader(int32_t code, uint32_t message_length, uint8_t out[kReplyHeaderBytes]) {
  std::memcpy(out, &code, 4);
  std::memcpy(out + 4, &message_length, 4);
}

inline void DecodeReplyHeader(const uint8_t in[kReplyHeaderBytes], int32_t* code, uint32_t* message_length) {
  std::memcpy(code, in, 4);
  std::memcpy(message_length, in + 4, 4);
}

}  // namespace lce::v1::data_plane
