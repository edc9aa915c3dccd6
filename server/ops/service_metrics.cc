#include "service_metrics.h"

namespace lce::server {

ServiceMetrics::ServiceMetrics(metrics::Registry& r)
    : requests(r.AddCounter("lce_requests", "RPCs finished, by method and gRPC status code.", {"method", "code"})),
      duration(r.AddHistogram("lce_request_duration_seconds", "Wall time of RPCs, from first byte to status.",
                              {"method"}, metrics::ExponentialBuckets(0.001, 2, 18))),
      tokens(r.AddCounter("lce_tokens", "Rows (tokens) processed, by operation.", {"op"})),
      bytes_received(r.AddCounter("lce_bytes_received",
                                  "Hidden-state and gradient bytes received (gRPC messages and the data plane).")
                         .WithLabels({})),
      bytes_sent(r.AddCounter("lce_bytes_sent",
                              "Answer bytes sent (per-row outputs and d_hidden; gRPC messages and the data plane).")
                     .WithLabels({})),
      engine_seconds(r.AddHistogram("lce_engine_seconds", "Engine time per chunk, by operation and phase.",
                                    {"op", "phase"}, metrics::ExponentialBuckets(0.0001, 2, 20))),
      queue_wait(r.AddHistogram("lce_queue_wait_seconds", "Time a stream waited between admission and its header.",
                                {"method"}, metrics::ExponentialBuckets(0.0001, 2, 16))),
      inflight(r.AddGauge("lce_inflight_requests", "Streams being served now.").WithLabels({})),
      rejections(r.AddCounter("lce_admission_rejections", "Requests refused by admission control, by reason.",
                              {"reason"})),
      accept_errors(r.AddCounter("lce_accept_errors",
                                 "Failed accepts that the listener survived (descriptor or memory shortages), by "
                                 "listener and errno.",
                                 {"listener", "errno"})),
      memory(r.AddGauge("lce_device_memory_bytes", "Engine memory by kind (weights, workspace), all heads.", {"kind"})),
      head_version(r.AddGauge("lce_head_version", "Current version of each head.", {"head"})),
      tp_size(r.AddGauge("lce_tp_size", "Tensor-parallel group size.").WithLabels({})),
      collective_seconds(r.AddCounter("lce_collective_seconds", "Time the front spent in tensor-parallel collectives.",
                                      {"rank"})),
      collective_bytes(r.AddCounter("lce_collective_bytes",
                                    "Bytes the rank put into tensor-parallel collectives (every rank the same).",
                                    {"rank"})),
      peer_up(r.AddGauge("lce_peer_up", "1 while the tensor-parallel rank is healthy, 0 after it failed.", {"rank"})),
      sessions(r.AddGauge("lce_sessions", "Open co-located sessions (OpenSession streams).").WithLabels({})),
      regions(r.AddGauge("lce_regions",
                         "Registered regions of sessions, by kind (host shm, device CUDA IPC, server memory of the "
                         "data plane).",
                         {"kind"})),
      batch_rows(r.AddHistogram("lce_batch_rows", "Rows of each engine call of the dynamic batcher, by operation.",
                                {"op"}, metrics::ExponentialBuckets(1, 2, 13))),
      batch_requests(r.AddHistogram("lce_batch_requests",
                                    "Requests merged into each engine call of the dynamic batcher, by operation.",
                                    {"op"}, metrics::ExponentialBuckets(1, 2, 10))),
      batch_queue_seconds(r.AddHistogram("lce_batch_queue_seconds",
                                         "Time a batched request waited from its arrival to its batch's launch.",
                                         {"op"}, metrics::ExponentialBuckets(0.00001, 2, 18))),
      batch_fallbacks(r.AddCounter("lce_batch_fallbacks",
                                   "Merged engine calls that failed and ran again one request at a time.", {"op"})),
      pending_grads(r.AddGauge("lce_pending_grads",
                               "Weight-gradient contributions held pending (being computed or waiting for CommitGrad), "
                               "all heads.")
                        .WithLabels({})),
      pending_grad_bytes(r.AddGauge("lce_pending_grad_bytes",
                                    "Memory of this rank's pending weight-gradient buffers (and spares), all heads.")
                             .WithLabels({})),
      pending_grads_dropped(r.AddCounter("lce_pending_grads_dropped",
                                         "Pending weight-gradient contributions freed without a commit, by reason "
                                         "(released: failed request or discarded; expired; evicted; stale: the "
                                         "weight changed).",
                                         {"reason"})) {}

void ServiceMetrics::Sample(const HeadStore& heads) {
  double weights = 0, workspace = 0;
  for (const auto& h : heads.List()) {
    head_version.WithLabels({h->name}).Set(static_cast<double>(h->version));
    const EngineMemory m = h->engine->memory();
    weights += static_cast<double>(m.weights_bytes);
    workspace += static_cast<double>(m.workspace_bytes);
  }
  double pending = 0, pending_bytes = 0;
  for (const auto& h : heads.List()) {
    std::lock_guard<std::mutex> lock(h->training->mu);
    pending += static_cast<double>(h->training->pending.size());
    if (h->training->trainer != nullptr) pending_bytes += static_cast<double>(h->training->trainer->pending_bytes());
  }
  pending_grads.Set(pending);
  pending_grad_bytes.Set(pending_bytes);
  memory.WithLabels({"weights"}).Set(weights);
  memory.WithLabels({"workspace"}).Set(workspace);
}

}  // namespace lce::server
