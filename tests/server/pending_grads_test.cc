// The book of pending weight-gradient contributions (server/heads/pending_grads.h): the parts of a
// split request share one, complete when every part has succeeded, abandoned when one fails; a part
// that never comes lets the others' expire; late, extra and mismatched parts are refused.
#include "pending_grads.h"

#include "gtest/gtest.h"

namespace lce::server {
namespace {

using PartEnd = PendingGrads::PartEnd;

const absl::Time kNow = absl::FromUnixSeconds(1000);
const absl::Time kLater = kNow + absl::Minutes(1);

TEST(PendingGrads, OneRequestCompletesOrIsAbandoned) {
  PendingGrads book;
  const uint64_t a = book.Begin(3);
  EXPECT_EQ(book.EndPart(a, /*ok=*/true, kLater), PartEnd::kComplete);
  const uint64_t b = book.Begin(3);
  EXPECT_EQ(book.EndPart(b, /*ok=*/false, kLater), PartEnd::kAbandoned);
  EXPECT_EQ(book.EndPart(12345, true, kLater), PartEnd::kGone);
}

TEST(PendingGrads, SplitPartsShareOneContribution) {
  PendingGrads book;
  PendingGradLimits one;
  one.max_per_head = 1;
  const uint64_t split = 77;
  ASSERT_EQ(*book.JoinSplit(split, 3, 5), 0u) << "no part has begun it";
  ASSERT_TRUE(book.MakeRoom(5, kNow, one).ok());
  const uint64_t id = book.Begin(5, split, 3);
  EXPECT_EQ(*book.JoinSplit(split, 3, 5), id);
  EXPECT_EQ(book.size(), 1);
  // Two parts in; the first ends, then the second: the third is still due.
  EXPECT_EQ(book.EndPart(id, true, kLater), PartEnd::kWaiting);
  EXPECT_TRUE(book.Find(id)->filling());
  EXPECT_EQ(book.EndPart(id, true, kLater), PartEnd::kWaiting);
  EXPECT_FALSE(book.Find(id)->filling());
  EXPECT_FALSE(book.Find(id)->complete());
  EXPECT_EQ(*book.JoinSplit(split, 3, 5), id);
  EXPECT_EQ(book.Find(id)->deadline, absl::InfiniteFuture()) << "a part filling it again: no deadline";
  EXPECT_EQ(book.EndPart(id, true, kLater), PartEnd::kComplete);
  // A fourth part of three is refused.
  absl::StatusOr<uint64_t> extra = book.JoinSplit(split, 3, 5);
  EXPECT_EQ(extra.status().code(), absl::StatusCode::kAborted) << extra.status();
}

TEST(PendingGrads, AFailedPartAbandonsTheSplitAndRefusesLateParts) {
  PendingGrads book;
  const uint64_t split = 78;
  const uint64_t id = book.Begin(5, split, 3);
  ASSERT_EQ(*book.JoinSplit(split, 3, 5), id);
  EXPECT_EQ(book.EndPart(id, false, kLater), PartEnd::kFailed) << "a sibling still fills it";
  EXPECT_EQ(book.EndPart(id, true, kLater), PartEnd::kAbandoned) << "the last one out releases it";
  ASSERT_TRUE(book.Take(id).ok());
  absl::StatusOr<uint64_t> late = book.JoinSplit(split, 3, 5);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kAborted);
  EXPECT_NE(late.status().message().find("failed"), std::string::npos) << late.status();
}

TEST(PendingGrads, AMismatchedPartIsRefused) {
  PendingGrads book;
  const uint64_t split = 79;
  book.Begin(5, split, 2);
  EXPECT_EQ(book.JoinSplit(split, 2, 6).status().code(), absl::StatusCode::kAborted) << "another head version";
  EXPECT_EQ(book.JoinSplit(split, 3, 5).status().code(), absl::StatusCode::kAborted) << "another part count";
}

TEST(PendingGrads, PartsThatNeverComeLetTheOthersExpireOrBeEvicted) {
  PendingGrads book;
  PendingGradLimits limits;
  limits.max_per_head = 2;
  const uint64_t split = 80;
  const uint64_t id = book.Begin(5, split, 2);
  EXPECT_EQ(book.EndPart(id, true, kLater), PartEnd::kWaiting);
  // Before its deadline it stays; after it, room for a new one releases it as expired.
  auto kept = book.MakeRoom(5, kNow, limits);
  ASSERT_TRUE(kept.ok());
  EXPECT_TRUE(kept->empty());
  auto dropped = book.MakeRoom(5, kLater + absl::Seconds(1), limits);
  ASSERT_TRUE(dropped.ok());
  ASSERT_EQ(dropped->size(), 1u);
  EXPECT_EQ((*dropped)[0].id, id);
  EXPECT_EQ((*dropped)[0].why, PendingGrads::Drop::kExpired);
  absl::StatusOr<uint64_t> late = book.JoinSplit(split, 2, 5);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kAborted);
  EXPECT_NE(late.status().message().find("expired"), std::string::npos) << late.status();
  // A waiting split is evicted like a waiting contribution when the cap needs the room.
  const uint64_t s2 = book.Begin(5, 81, 2);
  EXPECT_EQ(book.EndPart(s2, true, absl::InfiniteFuture()), PartEnd::kWaiting);
  book.Begin(5);
  auto evicted = book.MakeRoom(5, kNow, limits);
  ASSERT_TRUE(evicted.ok());
  ASSERT_EQ(evicted->size(), 1u);
  EXPECT_EQ((*evicted)[0].id, s2);
  EXPECT_EQ((*evicted)[0].why, PendingGrads::Drop::kEvicted);
}

}  // namespace
}  // namespace lce::server
