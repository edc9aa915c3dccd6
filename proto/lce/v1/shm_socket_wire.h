// The shm socket's wire format (lce_server --shm-socket; SessionResponse.shm_socket), the one
// definition the server (server/transport/shm_socket.h) and the C++ client encode and decode with.
// A co-located client hands a region of its memory to the server as a file descriptor: it creates
// the memory (memfd_create), connects to the server's Unix-domain stream socket and sends, in one
// sendmsg carrying the descriptor as SCM_RIGHTS ancillary data, little-endian:
//   request  88 bytes: "LCF1", u32 name length (<= 256), 32 bytes session id (hex), 32 bytes the
//            session's secret (hex), i64 offset, i64 byte_size; then the region's name (its label
//            in messages);
//   reply    i32 code (google.rpc.Code), u32 message length, u64 region id (0 unless OK), the message.
// One registration a connection; the server closes its copy of the descriptor once it has mapped it
// (the mapping keeps the memory). The server checks the secret and the sender's uid (SO_PEERCRED).
// (The Python client, client/python/lce_client/_shm.py, writes the same with struct.)
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

namespace lce::v1::shm_socket {

inline constexpr char kMagic[4] = {'L', 'C', 'F', '1'};
inline constexpr size_t kRequestBytes = 88, kReplyHeaderBytes = 16, kMaxNameBytes = 256, kKeyBytes = 32;

struct Request {
  std::string session_id, secret;  // kKeyBytes characters each
  int64_t offset = 0, byte_size = 0;
  std::string name;  // at most kMaxNameBytes
};

// The 88 fixed bytes of `r` (ids cut or zero-padded to 32; the name's length capped).
inline void EncodeRequest(const Request& r, uint8_t out[kRequestBytes]) {
  std::memset(out, 0, kRequestBytes);
  const uint32_t name_len = static_cast<uint32_t>(std::min(r.name.size(), kMaxNameBytes));
  std::memcpy(out, kMagic, 4);
  std::memcpy(out + 4, &name_len, 4);
  std::memcpy(out + 8, r.session_id.data(), std::min(kKeyBytes, r.session_id.size()));
  std::memcpy(out + 40, r.secret.data(), std::min(kKeyBytes, r.secret.size()));
  std::memcpy(out + 72, &r.offset, 8);
  std::memcpy(out + 80, &r.byte_size, 8);
}

// False without the magic; `name_len` is the length of the name that follows.
inline bool DecodeRequest(const uint8_t in[kRequestBytes], Request* r, uint32_t* name_len) {
  if (std::memcmp(in, kMagic, 4) != 0) return false;
  std::memcpy(name_len, in + 4, 4);
  r->session_id.assign(reinterpret_cast<const char*>(in + 8), kKeyBytes);
  r->secret.assign(reinterpret_cast<const char*>(in + 40), kKeyBytes);
  std::memcpy(&r->offset, in + 72, 8);
  std::memcpy(&r->byte_size, in + 80, 8);
  return true;
}

inline void EncodeReplyHeader(int32_t code, uint32_t message_length, uint64_t region_id,
                              uint8_t out[kReplyHeaderBytes]) {
  std::memcpy(out, &code, 4);
  std::memcpy(out + 4, &message_length, 4);
  std::memcpy(out + 8, &region_id, 8);
}

inline void DecodeReplyHeader(const uint8_t in[kReplyHeaderBytes], int32_t* code, uint32_t* message_length,
                              uint64_t* region_id) {
  std::memcpy(code, in, 4);
  std::memcpy(message_length, in + 4, 4);
  std::memcpy(region_id, in + 8, 8);
}

}  // namespace lce::v1::shm_socket
