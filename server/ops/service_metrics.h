// The metrics lce_server exports (Prometheus names, base units), registered once and updated by
// the service. Handles are looked up per request, never per row.
#pragma once

#include <memory>
#include <string>

#include "head_store.h"
#include "metrics.h"

namespace lce::server {

class ServiceMetrics {
 public:
  explicit ServiceMetrics(metrics::Registry& registry);

  metrics::Family<metrics::Counter>& requests;          // lce_requests_total{method,code}
  metrics::Family<metrics::Histogram>& duration;        // lce_request_duration_seconds{method}
  metrics::Family<metrics::Counter>& tokens;            // lce_tokens_total{op}
  metrics::Counter& bytes_received;                     // lce_bytes_received_total
  metrics::Counter& bytes_sent;                         // lce_bytes_sent_total
  metrics::Family<metrics::Histogram>& engine_seconds;  // lce_engine_seconds{op,phase}
  metrics::Family<metrics::Histogram>& queue_wait;      // lce_queue_wait_seconds{method}
  metrics::Gauge& inflight;                             // lce_inflight_requests
  metrics::Family<metrics::Counter>& rejections;        // lce_admission_rejections_total{reason}
  metrics::Family<metrics::Counter>& accept_errors;     // lce_accept_errors_total{listener,errno}
  metrics::Family<metrics::Gauge>& memory;              // lce_device_memory_bytes{kind}
  metrics::Family<metrics::Gauge>& head_version;        // lce_head_version{head}
  metrics::Gauge& tp_size;                              // lce_tp_size
  metrics::Family<metrics::Counter>& collective_seconds;  // lce_collective_seconds_total{rank}
  metrics::Family<metrics::Counter>& collective_bytes;  // lce_collective_bytes_total{rank}
  metrics::Family<metrics::Gauge>& peer_up;             // lce_peer_up{rank}
  metrics::Gauge& sessions;                             // lce_sessions
  metrics::Family<metrics::Gauge>& regions;             // lce_regions{kind}
  // Dynamic batching (server/api/dynamic_batcher.h), by op: rows and requests per batched engine
  // call, a request's wait from its arrival to its batch's launch, merged calls that failed and
  // ran again one request at a time.
  metrics::Family<metrics::Histogram>& batch_rows;      // lce_batch_rows{op}
  metrics::Family<metrics::Histogram>& batch_requests;  // lce_batch_requests{op}
  metrics::Family<metrics::Histogram>& batch_queue_seconds;  // lce_batch_queue_seconds{op}
  metrics::Family<metrics::Counter>& batch_fallbacks;   // lce_batch_fallbacks_total{op}
  // Pending weight-gradient contributions (docs/MATH.md, "When dW is committed"): held now, the
  // memory their buffers take, and those freed without a commit, by why.
  metrics::Gauge& pending_grads;                        // lce_pending_grads
  metrics::Gauge& pending_grad_bytes;                   // lce_pending_grad_bytes
  metrics::Family<metrics::Counter>& pending_grads_dropped;  // lce_pending_grads_dropped_total{reason}

  // Refreshes the sampled gauges (head versions, engine memory) from the head store.
  void Sample(const HeadStore& heads);
};

}  // namespace lce::server
