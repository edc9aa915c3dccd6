#include "request_authenticator.h"

#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"

namespace lce::server {
namespace {

// A token file in the temp directory, removed when the test's scope ends.
class TokenFile {
 public:
  TokenFile(const std::string& name, const std::string& token)
      : path_((std::filesystem::temp_directory_path() / (name + std::to_string(::getpid()))).string()) {
    std::ofstream(path_) << token << "\n";
  }
  ~TokenFile() { std::filesystem::remove(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(RequestAuthenticator, ScoringAndAdminTokens) {
  const std::string scoring = "scoring-token-0123456789", admin = "admin-token-9876543210";
  const TokenFile scoring_file("score_tok", scoring), admin_file("admin_tok", admin);
  auto auth = RequestAuthenticator::FromFiles(scoring_file.path(), admin_file.path());
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
  const TokenFile short_file("short_tok", "abc");
  EXPECT_EQ(RequestAuthenticator::FromFiles(short_file.path(), "").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RequestAuthenticator::FromFiles("/nonexistent/token", "").status().code(), absl::StatusCode::kNotFound);
}

TEST(RequestAuthenticator, ConstantTimeEquals) {
  EXPECT_TRUE(ConstantTimeEquals("abc", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abd"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abcd"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
}

// A token one bit off anywhere, the first and the last byte included, is refused on both tokens'
// paths. Guards against a compare loop that stops short of the last byte (or starts past the first).
TEST(RequestAuthenticator, ATokenOneBitOffAtAnyByteIsRefused) {
  const std::string scoring = "scoring-token-0123456789", admin = "admin-token-9876543210";
  const TokenFile scoring_file("score_tok_bits", scoring), admin_file("admin_tok_bits", admin);
  auto auth = RequestAuthenticator::FromFiles(scoring_file.path(), admin_file.path());
  ASSERT_TRUE(auth.ok()) << auth.status();
  for (const std::string& token : {scoring, admin}) {
    for (size_t i = 0; i < token.size(); ++i) {
      for (unsigned char bit : {0x01, 0x80}) {
        std::string off = token;
        off[i] = static_cast<char>(off[i] ^ bit);
        EXPECT_FALSE(ConstantTimeEquals(off, token)) << token << " byte " << i;
        EXPECT_EQ(auth->Check("Bearer " + off, Access::kScoring).code(), absl::StatusCode::kUnauthenticated)
            << token << " byte " << i << " bit " << int{bit};
      }
    }
  }
}

}  // namespace
}  // namespace lce::server
