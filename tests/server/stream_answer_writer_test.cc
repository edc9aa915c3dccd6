#include "stream_answer_writer.h"

#include <gtest/gtest.h>

#include <mutex>
#include <thread>
#include <vector>

#include "thread_start.h"

namespace lce::server {
namespace {

// A stream that records what is written and on which thread, and fails from its `fail_at`-th write.
class RecordingStream : public grpc::internal::WriterInterface<int> {
 public:
  explicit RecordingStream(int fail_at = -1) : fail_at_(fail_at) {}
  bool Write(const int& msg, grpc::WriteOptions options) override {
    std::lock_guard<std::mutex> l(mu_);
    if (fail_at_ >= 0 && static_cast<int>(written.size()) >= fail_at_) return false;
    written.push_back(msg);
    last.push_back(options.is_last_message());
    threads.push_back(std::this_thread::get_id());
    return true;
  }
  std::vector<int> written;
  std::vector<bool> last;  // written with WriteOptions::set_last_message
  std::vector<std::thread::id> threads;

 private:
  std::mutex mu_;
  const int fail_at_;
};

TEST(StreamAnswerWriterTest, OwnThreadWritesInOrderOffTheCallersThread) {
  RecordingStream stream;
  StreamAnswerWriter<int> w(&stream, 2);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(w.Push(int{i}));
  ASSERT_TRUE(w.Finish());
  EXPECT_EQ(stream.written, (std::vector<int>{0, 1, 2, 3, 4}));
  for (auto id : stream.threads) EXPECT_NE(id, std::this_thread::get_id());
  EXPECT_FALSE(w.Push(int{5}));  // finished: nothing more goes out
  EXPECT_EQ(stream.written.size(), 5u);
}

TEST(StreamAnswerWriterTest, WithoutAThreadWritesOnTheCallersThread) {
  RecordingStream stream;
  StreamAnswerWriter<int> w(&stream, 2, /*own_thread=*/false);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(w.Push(int{i}));
  EXPECT_EQ(stream.written, (std::vector<int>{0, 1, 2}));  // written before Push returned
  for (auto id : stream.threads) EXPECT_EQ(id, std::this_thread::get_id());
  EXPECT_TRUE(w.Finish());
  EXPECT_FALSE(w.Push(int{3}));  // finished: nothing more goes out
  EXPECT_EQ(stream.written.size(), 3u);
}

TEST(StreamAnswerWriterTest, AFailedWriteFailsLaterPushesAndFinish) {
  for (bool own_thread : {true, false}) {
    RecordingStream stream(/*fail_at=*/1);
    StreamAnswerWriter<int> w(&stream, 2, own_thread);
    EXPECT_TRUE(w.Push(int{0}));
    w.Push(int{1});  // fails (on the writer's thread, the failure may show only later)
    EXPECT_FALSE(w.Finish()) << "own_thread " << own_thread;
    EXPECT_FALSE(w.Push(int{2}));
    EXPECT_EQ(stream.written, (std::vector<int>{0}));
  }
}

TEST(StreamAnswerWriterTest, TheLastMessageGoesAsSuchAndNothingAfterIt) {
  for (bool own_thread : {true, false}) {
    RecordingStream stream;
    StreamAnswerWriter<int> w(&stream, 2, own_thread);
    EXPECT_TRUE(w.Push(int{0}));
    EXPECT_TRUE(w.PushLast(int{1}));
    EXPECT_FALSE(w.Push(int{2})) << "own_thread " << own_thread;
    EXPECT_FALSE(w.PushLast(int{3}));
    EXPECT_TRUE(w.Finish());
    EXPECT_EQ(stream.written, (std::vector<int>{0, 1}));
    EXPECT_EQ(stream.last, (std::vector<bool>{false, true}));
  }
}

// Issue 35, item 4: where its thread cannot start (a task limit), the writer writes on the caller's
// thread instead of aborting the server.
TEST(StreamAnswerWriterTest, WritesInlineWhenItsThreadCannotStart) {
  RecordingStream stream;
  FailThreadStartsForTest(1);
  StreamAnswerWriter<int> w(&stream, 2);
  FailThreadStartsForTest(0);
  EXPECT_FALSE(w.own_thread());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(w.Push(int{i}));
  ASSERT_TRUE(w.Finish());
  EXPECT_EQ(stream.written, (std::vector<int>{0, 1, 2}));
  for (auto id : stream.threads) EXPECT_EQ(id, std::this_thread::get_id());
}

}  // namespace
}  // namespace lce::server
