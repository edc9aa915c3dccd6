// Early returns for absl::Status and absl::StatusOr inside the server (gRPC statuses are made once,
// at the edge: server/api/grpc_status.h). In a function returning absl::Status or StatusOr<T>:
//   LCE_RETURN_IF_ERROR(staging.Upload(buf, src, n));
//   LCE_ASSIGN_OR_RETURN(std::shared_ptr<ServedHead> head, heads->Get(name));
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define LCE_RETURN_IF_ERROR(expr)                                 \
  do {                                                            \
    if (::absl::Status lce_status_ = (expr); !lce_status_.ok()) { \
      return lce_status_;                                         \
    }                                                             \
  } while (0)

// `lhs` may declare a variable (it stays in scope after the macro) or name an existing one.
#define LCE_ASSIGN_OR_RETURN(lhs, expr) \
  LCE_ASSIGN_OR_RETURN_IMPL_(LCE_STATUS_CONCAT_(lce_status_or_, __LINE__), lhs, expr)

#define LCE_STATUS_CONCAT_INNER_(a, b) a##b
#define LCE_STATUS_CONCAT_(a, b) LCE_STATUS_CONCAT_INNER_(a, b)
#define LCE_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return std::move(tmp).status();   \
  lhs = *std::move(tmp)
