// EncodeOptions / OptionFields (server/tp/engine_options.h), the one list of LceOptions' fields that
// the tensor-parallel control block and the dynamic batcher's merge key both go through: every
// field survives the round trip, and a call differing from another in any one field gets its own
// batch (the property test_dynamic_batching.py checks end to end for three of the fields).
#include "engine_options.h"

#include <gtest/gtest.h>

#include <cmath>
#include <utility>

#include "dynamic_batcher.h"

namespace lce::server {
namespace {

void Change(float& v) { v += 0.25f; }
void Change(int32_t& v) { v += 7; }
void Change(bool& v) { v = !v; }

constexpr size_t kFields = std::tuple_size_v<decltype(OptionFields(std::declval<LceOptions&>()))>;

// Default options with field I changed.
template <size_t I>
LceOptions WithFieldChanged() {
  LceOptions o;
  Change(std::get<I>(OptionFields(o)));
  return o;
}

BatchKey KeyWith(const LceOptions& o) {
  static int head;
  BatchKey k;
  k.head = &head;
  k.options = o;
  return k;
}

template <size_t I>
void ExpectFieldTellsCallsApart() {
  const LceOptions changed = WithFieldChanged<I>();
  const LceOptions plain;
  EXPECT_NE(EncodeOptions(changed), EncodeOptions(plain)) << "field " << I;
  const LceOptions back = DecodeOptions(EncodeOptions(changed));
  EXPECT_EQ(EncodeOptions(back), EncodeOptions(changed)) << "field " << I;
  EXPECT_EQ(std::get<I>(OptionFields(back)), std::get<I>(OptionFields(changed))) << "field " << I;
  const BatchKey a = KeyWith(changed), b = KeyWith(plain);
  EXPECT_TRUE(a < b || b < a) << "calls differing in field " << I << " would share a batch";
}

template <size_t... I>
void ExpectEveryFieldTellsCallsApart(std::index_sequence<I...>) {
  (ExpectFieldTellsCallsApart<I>(), ...);
}

TEST(EngineOptions, EveryFieldTellsCallsApartAndSurvivesTheControlBlock) {
  ExpectEveryFieldTellsCallsApart(std::make_index_sequence<kFields>());
}

TEST(EngineOptions, RoundTripKeepsEveryValue) {
  LceOptions o;
  o.temperature = 0.7f;
  o.softcap = 30.0f;
  o.label_smoothing = 0.1f;
  o.z_loss = 1e-4f;
  o.ignore_index = -1;
  o.allow_tf32 = true;
  o.top_k = 5;
  const LceOptions back = DecodeOptions(EncodeOptions(o));
  EXPECT_EQ(back.temperature, 0.7f);
  EXPECT_EQ(back.softcap, 30.0f);
  EXPECT_EQ(back.label_smoothing, 0.1f);
  EXPECT_EQ(back.z_loss, 1e-4f);
  EXPECT_EQ(back.ignore_index, -1);
  EXPECT_TRUE(back.allow_tf32);
  EXPECT_EQ(back.top_k, 5);
}

// Options compare by bits, as the batcher always did: equal options share a key, -0 and 0 do not
// (an engine may treat them alike, but a merge must never depend on that).
TEST(EngineOptions, KeysCompareByBits) {
  LceOptions a, b;
  EXPECT_FALSE(KeyWith(a) < KeyWith(b) || KeyWith(b) < KeyWith(a));
  b.softcap = -0.0f;
  EXPECT_TRUE(KeyWith(a) < KeyWith(b) || KeyWith(b) < KeyWith(a));
  a.temperature = b.temperature = std::nanf("");
  b.softcap = 0.0f;
  EXPECT_FALSE(KeyWith(a) < KeyWith(b) || KeyWith(b) < KeyWith(a)) << "a NaN option equals itself";
}

}  // namespace
}  // namespace lce::server
