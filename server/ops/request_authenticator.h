// Bearer-token authentication of RPCs: "authorization: Bearer <token>" metadata, compared in
// constant time against the tokens read from files at start-up. Scoring RPCs take the scoring or
// the admin token; admin RPCs (head loading and updates, optimizer steps) take the admin token.
// With no tokens configured, every call is allowed.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace lce::server {

enum class Access { kScoring, kAdmin };

class RequestAuthenticator {
 public:
  // Reads each token file (first line, surrounding whitespace trimmed); empty paths mean "none".
  static absl::StatusOr<RequestAuthenticator> FromFiles(const std::string& scoring_token_file,
                                                        const std::string& admin_token_file);
  RequestAuthenticator() = default;

  bool enabled() const { return !scoring_.empty() || !admin_.empty(); }
  // `authorization` is the metadata value ("" when absent). UNAUTHENTICATED when the token is
  // missing or unknown; PERMISSION_DENIED when a scoring token calls an admin RPC.
  absl::Status Check(const std::string& authorization, Access access) const;

 private:
  std::string scoring_, admin_;
};

// Equality whose time depends only on the lengths, not on where the strings differ.
bool ConstantTimeEquals(const std::string& a, const std::string& b);

}  // namespace lce::server
