#include "request_authenticator.h"

#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"

namespace lce::server {
namespace {

std::string WriteToken(const std::string& name, const std::string& token) {
  const std::string path = (std::filesystem::temp_directory_path() / (name + std::to_string(::getpid()))).string();
  std::ofstream(path) << token << "\n";
  return path;
}

TEST(RequestAuthenticator, ScoringAndAdminTokens) {
  const std::string scoring = "scoring-token-0123456789", admin = "admin-token-9876543210";
  auto auth = RequestAuthenticator::FromFiles(WriteToken("score_tok", scoring), WriteToken("admin_tok", admin));
  ASSERT_TRUE(auth.ok()) << auth.status();
  EXPECT_TRUE(auth->enabled());
  EXPECT_TRUE(auth->Check("Bearer " + scoring, Access::kScoring).ok());
  EXPECT_TRUE(auth->Check("Bearer " + admin, Access::kScoring).ok());
  EXPECT_TRUE(auth->Check("Bearer " + admin, Access::kAdmin).ok());
  EXPECT_EQ(auth->Check("Bearer " + scoring, Access::kAdmin).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(auth->Check("", Access::kScoring).code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(auth->Check("Bearer wrong-token-000000000", Access::kScoring).code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(auth->Check(scoring, Access::kScoring).code(), absl::StatusCode::kUnauthenticated);  // no "Bearer "
}

TEST(RequestAuthenticator, NoTokensMeansOpenAndShortTokensAreRefused) {
  auto open = RequestAuthenticator::FromFiles("", "");
  ASSERT_TRUE(open.ok());
  EXPECT_FALSE(open->enabled());
  EXPECT_TRUE(open->Check("", Access::kAdmin).ok());
  EXPECT_EQ(RequestAuthenticator::FromFiles(WriteToken("short_tok", "abc"), "").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RequestAuthenticator::FromFiles("/nonexistent/token", "").status().code(), absl::StatusCode::kNotFound);
}

TEST(RequestAuthenticator, ConstantTimeEquals) {
  EXPECT_TRUE(ConstantTimeEquals("abc", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abd"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abcd"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
}

}  // namespace
}  // namespace lce::server
