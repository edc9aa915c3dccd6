// AnswerAssembly (client/answer_assembly.h): the answers of a request's streams placed at their rows,
// and the checks that turn a server's wrong answer into an error instead of a wrong result.
#include "answer_assembly.h"

#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace lce::client {
namespace {

v1::ChunkResult Answer(int64_t first, int64_t rows, std::vector<float> logprobs) {
  v1::ChunkResult c;
  c.set_first_row(first);
  c.set_rows(rows);
  for (float v : logprobs) c.add_logprobs(v);
  return c;
}

TEST(AnswerAssembly, PlacesEachAnswerAtItsRowsAndSumsThePartsSummaries) {
  ForwardBackwardResult out;
  AnswerAssembly a(/*rows=*/4, /*row_bytes=*/2, &out, {});
  // The second part answers first: placement is by row, not by arrival.
  ASSERT_TRUE(a.Claim(2, 2).ok());
  ASSERT_TRUE(a.PlaceRowValues(Answer(2, 2, {-3, -4}), 2, 2).ok());
  ASSERT_TRUE(a.PlaceDHidden(std::string("\x05\x06\x07\x08", 4), 2, 2).ok());
  ASSERT_TRUE(a.Claim(0, 2).ok());
  ASSERT_TRUE(a.PlaceRowValues(Answer(0, 2, {-1, -2}), 0, 2).ok());
  ASSERT_TRUE(a.PlaceDHidden(std::string("\x01\x02\x03\x04", 4), 0, 2).ok());
  // loss, valid tokens, head version, pending gradients
  const std::vector<PartSummary> parts = {{0.25, 2, 7, {11}}, {0.5, 1, 7, {12}}};
  v1::RequestHeader header;
  header.set_num_valid_tokens(3);
  ASSERT_TRUE(a.Finish(parts, header, /*split=*/true).ok());
  EXPECT_EQ(out.logprobs, (std::vector<float>{-1, -2, -3, -4}));
  EXPECT_TRUE(out.entropy.empty());  // not selected: not sized either
  EXPECT_EQ(out.d_hidden, (std::vector<uint8_t>{1, 2, 3, 4, 5, 6, 7, 8}));
  EXPECT_DOUBLE_EQ(out.reduced_loss, 0.75);
  EXPECT_EQ(out.valid_tokens, 3);
  EXPECT_EQ(out.head_version, 7);
  EXPECT_EQ(out.pending_grads, (std::vector<uint64_t>{11, 12}));
}

// The rankings (top_k values a row) and the z-loss land at their rows as the per-row floats do; a
// ranking of the wrong width is the server's error.
TEST(AnswerAssembly, PlacesRankingsAndZLoss) {
  ForwardBackwardResult out;
  AnswerAssembly a(/*rows=*/3, /*row_bytes=*/2, &out, {}, /*top_k=*/2);
  v1::ChunkResult late;  // rows 1..2
  for (int32_t t : {7, 8}) late.add_argmax(t);
  for (int32_t t : {7, 1, 8, 2}) late.add_top_tokens(t);
  for (float v : {-0.1f, -2.0f, -0.2f, -3.0f}) late.add_top_logprobs(v);
  for (float v : {0.5f, 0.6f}) late.add_z_loss(v);
  ASSERT_TRUE(a.Claim(1, 2).ok());
  ASSERT_TRUE(a.PlaceRowValues(late, 1, 2).ok());
  v1::ChunkResult first;  // row 0
  first.add_argmax(4);
  first.add_top_tokens(4);
  first.add_top_tokens(5);
  first.add_top_logprobs(-0.3f);
  first.add_top_logprobs(-1.5f);
  first.add_z_loss(0.4f);
  ASSERT_TRUE(a.Claim(0, 1).ok());
  ASSERT_TRUE(a.PlaceRowValues(first, 0, 1).ok());
  ASSERT_TRUE(a.Finish({{0, 3, 1, {}}}, v1::RequestHeader(), false).ok());
  EXPECT_EQ(out.rankings.argmax, (std::vector<int32_t>{4, 7, 8}));
  EXPECT_EQ(out.rankings.top_tokens, (std::vector<int32_t>{4, 5, 7, 1, 8, 2}));
  EXPECT_EQ(out.rankings.top_logprobs, (std::vector<float>{-0.3f, -1.5f, -0.1f, -2.0f, -0.2f, -3.0f}));
  EXPECT_EQ(out.z_loss, (std::vector<float>{0.4f, 0.5f, 0.6f}));

  ForwardBackwardResult bad_out;
  AnswerAssembly b(2, 2, &bad_out, {}, 2);
  v1::ChunkResult narrow;  // one token a row where the header asked two
  narrow.add_top_tokens(1);
  narrow.add_top_tokens(2);
  ASSERT_TRUE(b.Claim(0, 2).ok());
  EXPECT_EQ(b.PlaceRowValues(narrow, 0, 2).code(), absl::StatusCode::kInternal);
}

TEST(AnswerAssembly, RefusesARowAnsweredTwiceOrAnOutputOfTheWrongLength) {
  ForwardBackwardResult out;
  AnswerAssembly a(4, 2, &out, {});
  ASSERT_TRUE(a.Claim(0, 3).ok());
  const absl::Status twice = a.Claim(2, 2);
  EXPECT_EQ(twice.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(twice.message(), "row 2 was answered twice");
  const absl::Status short_answer = a.PlaceRowValues(Answer(0, 3, {-1, -2}), 0, 3);
  EXPECT_EQ(short_answer.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(short_answer.message(), "answer for rows [0, 3) has 2 logprob values, not 3");
  EXPECT_EQ(a.PlaceDHidden(std::string(5, 'x'), 0, 3).message(), "answer for rows [0, 3) has 5 d_hidden bytes, not 6");
}

TEST(AnswerAssembly, FinishRefusesMissingRowsPartialOutputsOrMixedVersions) {
  std::vector<PartSummary> one(1);
  {
    ForwardBackwardResult out;
    AnswerAssembly a(4, 2, &out, {});
    ASSERT_TRUE(a.Claim(0, 3).ok());
    EXPECT_EQ(a.Finish(one, {}, false).message(), "the server answered 3 of 4 rows");
  }
  {
    ForwardBackwardResult out;
    AnswerAssembly a(4, 2, &out, {});
    ASSERT_TRUE(a.Claim(0, 4).ok());
    ASSERT_TRUE(a.PlaceRowValues(Answer(0, 2, {-1, -2}), 0, 2).ok());
    EXPECT_EQ(a.Finish(one, {}, false).message(), "the server answered logprobs for 2 of 4 rows");
  }
  {
    ForwardBackwardResult out;
    AnswerAssembly a(4, 2, &out, {});
    ASSERT_TRUE(a.Claim(0, 4).ok());
    const std::vector<PartSummary> parts = {{0, 0, /*head_version=*/3, {}}, {0, 0, /*head_version=*/4, {}}};
    EXPECT_EQ(a.Finish(parts, {}, true).code(), absl::StatusCode::kAborted);
  }
  {
    ForwardBackwardResult out;
    AnswerAssembly a(4, 2, &out, {});
    ASSERT_TRUE(a.Claim(0, 4).ok());
    const std::vector<PartSummary> parts = {{0, /*valid_tokens=*/2, 0, {}}, {0, /*valid_tokens=*/1, 0, {}}};
    v1::RequestHeader header;
    header.set_num_valid_tokens(4);
    EXPECT_EQ(a.Finish(parts, header, true).code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(AnswerAssembly, DHiddenGoesToTheCallersDestinationWhenGiven) {
  ForwardBackwardResult out;
  std::vector<uint8_t> mine(4, 0);
  AnswerAssembly a(2, 2, &out, absl::MakeSpan(mine));
  ASSERT_TRUE(a.PlaceDHidden(std::string("\x09\x0a", 2), 1, 1).ok());
  EXPECT_EQ(mine, (std::vector<uint8_t>{0, 0, 9, 10}));
  EXPECT_TRUE(out.d_hidden.empty());
}

// A large d_hidden is sized ahead of the first answer (on a thread of its own); the streams' answers land
// at their rows as before, and a call that returned no d_hidden leaves the result's empty.
TEST(AnswerAssembly, DHiddenSizedAheadHoldsTheAnswersOrNothing) {
  const int64_t rows = 4096, row_bytes = 4096;  // 16 MiB: over the size sized ahead
  {
    ForwardBackwardResult out;
    AnswerAssembly a(rows, row_bytes, &out, {});
    a.SizeDHiddenAhead();
    ASSERT_TRUE(a.Claim(0, rows).ok());
    const std::string last(static_cast<size_t>(row_bytes), '\x2a');
    ASSERT_TRUE(a.PlaceDHidden(last, rows - 1, 1).ok());
    std::memset(a.DHiddenAt(0), 7, static_cast<size_t>((rows - 1) * row_bytes));  // a download's bytes
    a.CountDHidden(rows - 1);
    ASSERT_TRUE(a.Finish({{0, 0, 0, {}}}, {}, false).ok());
    ASSERT_EQ(out.d_hidden.size(), static_cast<size_t>(rows * row_bytes));
    EXPECT_EQ(out.d_hidden.front(), 7);
    EXPECT_EQ(out.d_hidden[(rows - 1) * row_bytes - 1], 7);
    EXPECT_EQ(out.d_hidden[(rows - 1) * row_bytes], 0x2a);
    EXPECT_EQ(out.d_hidden.back(), 0x2a);
  }
  {
    ForwardBackwardResult out;
    AnswerAssembly a(rows, row_bytes, &out, {});
    a.SizeDHiddenAhead();
    ASSERT_TRUE(a.Claim(0, rows).ok());
    ASSERT_TRUE(a.Finish({{0, 0, 0, {}}}, {}, false).ok());
    EXPECT_TRUE(out.d_hidden.empty());
  }
}

}  // namespace
}  // namespace lce::client
