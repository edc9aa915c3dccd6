#include "request_authenticator.h"

#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace lce::server {
namespace {

absl::StatusOr<std::string> ReadToken(const std::string& path) {
  if (path.empty()) return std::string();
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read token file ", path));
  std::string line;
  std::getline(in, line);
  std::string token(absl::StripAsciiWhitespace(line));
  if (token.size() < 16) return absl::InvalidArgumentError(absl::StrCat("token in ", path, " is shorter than 16 characters"));
  return token;
}

}  // namespace

bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  volatile unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff = diff | static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

absl::StatusOr<RequestAuthenticator> RequestAuthenticator::FromFiles(const std::string& scoring_file,
                                                                     const std::string& admin_file) {
  RequestAuthenticator a;
  absl::StatusOr<std::string> s = ReadToken(scoring_file);
  if (!s.ok()) return s.status();
  absl::StatusOr<std::string> adm = ReadToken(admin_file);
  if (!adm.ok()) return adm.status();
  a.scoring_ = *s;
  a.admin_ = *adm;
  return a;
}

absl::Status RequestAuthenticator::Check(const std::string& authorization, Access access) const {
  if (!enabled()) return absl::OkStatus();
  constexpr char kPrefix[] = "Bearer ";
  if (authorization.rfind(kPrefix, 0) != 0) {
    return absl::UnauthenticatedError("missing 'authorization: Bearer <token>' metadata");
  }
  const std::string token = authorization.substr(sizeof(kPrefix) - 1);
  const bool is_admin = !admin_.empty() && ConstantTimeEquals(token, admin_);
  const bool is_scoring = !scoring_.empty() && ConstantTimeEquals(token, scoring_);
  if (!is_admin && !is_scoring) return absl::UnauthenticatedError("unknown bearer token");
  if (access == Access::kAdmin && !is_admin) {
    return absl::PermissionDeniedError("this RPC needs the admin token");
  }
  return absl::OkStatus();
}

}  // namespace lce::server
