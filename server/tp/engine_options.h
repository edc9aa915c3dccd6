// Every field of LceOptions in one list, for the code that copies or compares a call's options
// whole: the tensor-parallel control block (tp_group.cc sends them to the peers) and the dynamic
// batcher's merge key (dynamic_batcher.cc: calls merge only when their options are the same bits).
// Both go through EncodeOptions, so a field listed here reaches both, and a field added to
// LceOptions but not listed here fails to compile (the static_assert below).
#pragma once

#include <array>
#include <cstddef>
#include <cstring>
#include <tuple>

#include "lce/engine.h"

namespace lce::server {

// The fields, in the order they are encoded.
template <typename Options>  // LceOptions or const LceOptions
constexpr auto OptionFields(Options& o) {
  return std::tie(o.temperature, o.softcap, o.label_smoothing, o.z_loss, o.ignore_index, o.allow_tf32, o.top_k);
}

namespace options_detail {

// Converts to anything: T{Any{}, Any{}, ...} compiles for as many Anys as T has fields, at most.
struct Any {
  template <typename T>
  operator T() const;
};
template <typename T, typename... Fields>
consteval size_t AggregateFields() {
  if constexpr (requires { T{Fields{}..., Any{}}; }) {
    return AggregateFields<T, Fields..., Any>();
  } else {
    return sizeof...(Fields);
  }
}

template <typename Tuple>
struct EncodedSize;
template <typename... T>
struct EncodedSize<std::tuple<T&...>> {
  static constexpr size_t value = (sizeof(T) + ...);
};
using Fields = decltype(OptionFields(std::declval<LceOptions&>()));

}  // namespace options_detail

static_assert(options_detail::AggregateFields<LceOptions>() == std::tuple_size_v<options_detail::Fields>,
              "LceOptions has a field that OptionFields (server/tp/engine_options.h) does not list: add it there, "
              "or tensor-parallel peers and the dynamic batcher would not see it");

// A call's options as bytes: each field's bits, in OptionFields' order. Equal bytes, equal options
// (floats compare by their bits: -0 and 0 differ, a NaN equals itself).
using OptionBytes = std::array<unsigned char, options_detail::EncodedSize<options_detail::Fields>::value>;

inline OptionBytes EncodeOptions(const LceOptions& o) {
  OptionBytes bytes{};
  size_t at = 0;
  std::apply(
      [&](const auto&... field) { ((std::memcpy(bytes.data() + at, &field, sizeof field), at += sizeof field), ...); },
      OptionFields(o));
  return bytes;
}

inline LceOptions DecodeOptions(const OptionBytes& bytes) {
  LceOptions o;
  size_t at = 0;
  std::apply([&](auto&... field) { ((std::memcpy(&field, bytes.data() + at, sizeof field), at += sizeof field), ...); },
             OptionFields(o));
  return o;
}

}  // namespace lce::server
