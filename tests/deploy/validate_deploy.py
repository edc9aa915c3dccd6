"""Structural checks of the deploy assets, run by validate_deploy.sh (no docker needed).

Usage: python3 validate_deploy.py ROOT yaml|dashboard [PROMTOOL]
  yaml       parse docker-compose.yml and deploy/**/*.y*ml with PyYAML, then check compose and the
             Kubernetes manifests hang together (needs PyYAML: exits 3 when it is missing).
  dashboard  the Grafana dashboard JSON loads, has the four required panels' expressions, uses only
             metric names the server exports, and (with PROMTOOL) every expression parses as PromQL.
Prints PASS/FAIL lines; exit status 1 when anything failed.
"""
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

# What lce_server exports (server/ops/metrics.h registry; names fixed with the server's owner).
# name -> (type, labels)
EXPORTED = {
    "lce_requests_total": ("counter", {"method", "code"}),
    "lce_request_duration_seconds": ("histogram", {"method"}),
    "lce_tokens_total": ("counter", {"op"}),
    "lce_bytes_received_total": ("counter", set()),
    "lce_bytes_sent_total": ("counter", set()),
    "lce_engine_seconds": ("histogram", {"op", "phase"}),
    "lce_inflight_requests": ("gauge", set()),
    "lce_admission_rejections_total": ("counter", {"reason"}),
    "lce_device_memory_bytes": ("gauge", {"kind"}),
    "lce_head_version": ("gauge", {"head"}),
    "lce_tp_size": ("gauge", set()),
    "lce_collective_seconds_total": ("counter", {"rank"}),
    "lce_peer_up": ("gauge", {"rank"}),
    "lce_sessions": ("gauge", set()),
    "lce_regions": ("gauge", {"kind"}),
}
TARGET_LABELS = {"instance", "job", "service", "pod", "namespace"}  # added by Prometheus

failures = 0


def ok(msg):
    print(f"PASS {msg}")


def fail(msg):
    global failures
    failures += 1
    print(f"FAIL {msg}")


def check(cond, msg):
    (ok if cond else fail)(msg)
    return cond


def series_names():
    """Every series name a scrape can contain, with the labels each carries."""
    out = {}
    for name, (kind, labels) in EXPORTED.items():
        if kind == "histogram":
            out[name + "_bucket"] = labels | {"le"}
            out[name + "_sum"] = labels
            out[name + "_count"] = labels
        else:
            out[name] = labels
    return out


# ---- YAML ----------------------------------------------------------------------------------------

def yaml_files(root):
    files = [os.path.join(root, "docker-compose.yml")]
    for ext in ("yaml", "yml"):
        files += glob.glob(os.path.join(root, "deploy", "**", f"*.{ext}"), recursive=True)
    return sorted(set(f for f in files if os.path.isfile(f)))


def check_yaml(root):
    try:
        import yaml  # noqa: F401
    except ImportError:
        print(f"PyYAML is not importable by {sys.executable}")
        return 3
    import yaml

    docs = {}
    for path in yaml_files(root):
        rel = os.path.relpath(path, root)
        try:
            with open(path) as f:
                docs[rel] = [d for d in yaml.safe_load_all(f) if d is not None]
            ok(f"yaml parses: {rel} ({len(docs[rel])} document(s))")
        except yaml.YAMLError as e:
            fail(f"yaml parses: {rel}: {e}")
    check("docker-compose.yml" in docs, "docker-compose.yml exists")
    if "docker-compose.yml" in docs:
        check_compose(root, docs["docker-compose.yml"][0])
    check_grafana_provisioning(docs)
    k8s = [(rel, d) for rel, ds in docs.items() if rel.startswith("deploy/k8s/") for d in ds]
    check_k8s(root, k8s)
    return 1 if failures else 0


def check_compose(root, c):
    services = c.get("services", {})
    for name in ("lce-server", "prometheus", "grafana"):
        check(name in services, f"compose: service {name}")
    s = services.get("lce-server", {})
    build = s.get("build", {})
    check(isinstance(build, dict) and build.get("dockerfile") == "deploy/Dockerfile"
          and os.path.isfile(os.path.join(root, build.get("context", "."), "deploy/Dockerfile")),
          "compose: lce-server builds deploy/Dockerfile")
    cmd = s.get("command", "")
    cmd = " ".join(cmd) if isinstance(cmd, list) else str(cmd)
    for flag in ("lce_server", "--port=50051", "--metrics-port=9400", "--data-port=50052", "--backend=auto",
                 "--seed-head=128256x4096"):
        check(flag in cmd.split(), f"compose: lce-server command has {flag}")
    devices = (s.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", []))
    check(any(d.get("driver") == "nvidia" and d.get("count") == 1 and "gpu" in d.get("capabilities", [])
              for d in devices), "compose: lce-server reserves one nvidia GPU")
    ports = [str(p) for p in s.get("ports", [])]
    check(all(any(p.endswith(f":{n}") for p in ports) for n in (50051, 50052, 9400)),
          "compose: lce-server publishes 50051, 50052 (data plane) and 9400")
    # Bind mounts of prometheus and grafana point at files in this repository.
    for svc in ("prometheus", "grafana"):
        for v in services.get(svc, {}).get("volumes", []):
            src = v.split(":")[0] if isinstance(v, str) else v.get("source", "")
            if src.startswith("./"):
                check(os.path.exists(os.path.join(root, src)), f"compose: {svc} mounts {src} (exists)")
    prom_mounts = " ".join(str(v) for v in services.get("prometheus", {}).get("volumes", []))
    check("./deploy/prometheus/prometheus.yml:" in prom_mounts,
          "compose: prometheus uses deploy/prometheus/prometheus.yml")
    declared = set((c.get("volumes") or {}).keys())
    for svc, body in services.items():
        for v in body.get("volumes", []):
            src = v.split(":")[0] if isinstance(v, str) else v.get("source", "")
            if src and not src.startswith((".", "/")):
                check(src in declared, f"compose: named volume {src} of {svc} is declared")


def check_grafana_provisioning(docs):
    ds = [d for rel, dd in docs.items() if "grafana/provisioning/datasources" in rel for d in dd]
    dp = [d for rel, dd in docs.items() if "grafana/provisioning/dashboards" in rel for d in dd]
    check(any(x.get("type") == "prometheus" and x.get("url", "").startswith("http://prometheus:9090")
              for d in ds for x in d.get("datasources", [])),
          "grafana: a prometheus datasource at http://prometheus:9090")
    check(any(p.get("type") == "file" and p.get("options", {}).get("path")
              for d in dp for p in d.get("providers", [])), "grafana: a file dashboard provider")


def labels_match(selector, labels):
    return all(labels.get(k) == v for k, v in (selector or {}).items())


def check_k8s(root, k8s):
    if not k8s:
        fail("k8s: no manifests under deploy/k8s")
        return
    by_kind = {}
    for rel, d in k8s:
        kind = d.get("kind")
        if kind == "Kustomization":
            here = os.path.dirname(os.path.join(root, rel))  # resources are relative to the kustomization
            for r in d.get("resources", []):
                check(os.path.isfile(os.path.join(here, r)), f"k8s: kustomization resource {r} of {rel} exists")
            continue
        check(bool(d.get("apiVersion")) and bool(kind) and bool(d.get("metadata", {}).get("name")),
              f"k8s: {rel} {kind} has apiVersion, kind, metadata.name")
        by_kind.setdefault(kind, []).append(d)
    workloads = by_kind.get("StatefulSet", []) + by_kind.get("Deployment", [])
    services = by_kind.get("Service", [])
    check(len(workloads) >= 1, "k8s: a StatefulSet or Deployment")
    check(len(services) >= 1, "k8s: a Service")
    check(len(by_kind.get("ServiceMonitor", [])) >= 1, "k8s: a ServiceMonitor")
    for w in workloads:
        name = w["metadata"]["name"]
        spec = w.get("spec", {})
        tmpl = spec.get("template", {})
        check(labels_match(spec.get("selector", {}).get("matchLabels"), tmpl.get("metadata", {}).get("labels", {})),
              f"k8s: {name} selector matches its pod template")
        if w["kind"] == "StatefulSet":
            headless = [s for s in services if s["metadata"]["name"] == spec.get("serviceName")]
            check(len(headless) == 1 and headless[0]["spec"].get("clusterIP") == "None",
                  f"k8s: {name} serviceName {spec.get('serviceName')} is a headless Service")
        containers = tmpl.get("spec", {}).get("containers", [])
        check(len(containers) >= 1, f"k8s: {name} has containers")
        for c in containers:
            cname = f"{name}/{c.get('name')}"
            for probe in ("readinessProbe", "livenessProbe"):
                p = c.get(probe, {})
                check(isinstance(p.get("grpc"), dict) and p["grpc"].get("port") == 50051,
                      f"k8s: {cname} {probe} is a native grpc probe on 50051")
            res = c.get("resources", {})
            gpus = res.get("limits", {}).get("nvidia.com/gpu")
            check(isinstance(gpus, int) and gpus >= 1, f"k8s: {cname} limits nvidia.com/gpu ({gpus})")
            req = res.get("requests", {}).get("nvidia.com/gpu", gpus)
            check(req == gpus, f"k8s: {cname} nvidia.com/gpu requests == limits")
            argv = [str(a) for a in c.get("command", []) + c.get("args", [])]
            if argv and argv[0].endswith("lce_tp_launch.sh"):
                check(len(argv) > 1 and argv[1] == str(gpus),
                      f"k8s: {cname} TP size (launcher argument {argv[1] if len(argv) > 1 else '?'}) "
                      f"equals its GPUs ({gpus})")
            dp = [a.split("=", 1)[1] for a in argv if a.startswith("--dp-size=")]
            if dp:  # a data-parallel job: one replica a pod
                check(dp == [str(spec.get("replicas"))],
                      f"k8s: {cname} --dp-size ({dp}) equals the StatefulSet's replicas ({spec.get('replicas')})")
            ports = {p.get("name"): p.get("containerPort") for p in c.get("ports", [])}
            check(ports.get("grpc") == 50051 and ports.get("metrics") == 9400 and ports.get("data") == 50052,
                  f"k8s: {cname} names ports grpc=50051, metrics=9400 and data=50052")
            check("--metrics-port=9400" in argv and "--port=50051" in argv and "--data-port=50052" in argv,
                  f"k8s: {cname} starts the server on 50051 with metrics on 9400 and the data plane on 50052")
            sc = {**tmpl.get("spec", {}).get("securityContext", {}), **c.get("securityContext", {})}
            check(sc.get("runAsNonRoot") is True, f"k8s: {cname} runs as non-root")
        pod_labels = tmpl.get("metadata", {}).get("labels", {})
        check(any(labels_match(s["spec"].get("selector"), pod_labels) and s["spec"].get("clusterIP") != "None"
                  and any(p.get("port") == 50051 for p in s["spec"].get("ports", [])) for s in services),
              f"k8s: a Service with port 50051 selects {name}'s pods")
        # Data-plane clients need their gRPC calls and sockets on one pod: the headless Service.
        check(any(labels_match(s["spec"].get("selector"), pod_labels) and s["spec"].get("clusterIP") == "None"
                  and any(p.get("port") == 50052 and p.get("targetPort") == "data" for p in s["spec"].get("ports", []))
                  for s in services),
              f"k8s: the headless Service of {name}'s pods has the data port 50052")
    for sm in by_kind.get("ServiceMonitor", []):
        sel = sm["spec"].get("selector", {}).get("matchLabels", {})
        targets = [s for s in services if labels_match(sel, s["metadata"].get("labels", {}))]
        check(len(targets) == 1, f"k8s: ServiceMonitor {sm['metadata']['name']} selects exactly one Service "
                                 f"({[s['metadata']['name'] for s in targets]})")
        for ep in sm["spec"].get("endpoints", []):
            check(any(ep.get("port") in [p.get("name") for p in s["spec"].get("ports", [])] for s in targets),
                  f"k8s: ServiceMonitor endpoint port '{ep.get('port')}' is a named port of that Service")
            check(ep.get("path", "/metrics") == "/metrics", "k8s: ServiceMonitor scrapes /metrics")


# ---- dashboard -----------------------------------------------------------------------------------

def check_dashboard(root, promtool):
    path = os.path.join(root, "deploy/grafana/dashboards/lce-serve.json")
    try:
        with open(path) as f:
            dash = json.load(f)
        ok("dashboard: deploy/grafana/dashboards/lce-serve.json loads as JSON")
    except (OSError, ValueError) as e:
        fail(f"dashboard: {path}: {e}")
        return 1
    panels = dash.get("panels", [])
    exprs = [(p.get("title", "?"), t["expr"]) for p in panels for t in p.get("targets", []) if t.get("expr")]
    check(bool(dash.get("uid")) and bool(dash.get("title")), "dashboard: has uid and title")
    ids = [p.get("id") for p in panels]
    check(len(ids) == len(set(ids)), "dashboard: panel ids are unique")
    compact = [(title, re.sub(r"\s+", "", e)) for title, e in exprs]

    def has(pred, what):
        hits = [t for t, e in compact if pred(e)]
        check(bool(hits), f"dashboard: {what}" + (f" (panel '{hits[0]}')" if hits else ""))

    has(lambda e: "lce_requests_total" in e and re.search(r"by\((method,code|code,method)\)", e) and "rate(" in e,
        "request rate by method and code from lce_requests_total")
    for q in ("0.5", "0.9", "0.99"):
        has(lambda e, q=q: f"histogram_quantile({q}," in e and "lce_request_duration_seconds_bucket" in e
            and re.search(r"by\([^)]*\ble\b", e),
            f"latency p{q[2:].ljust(2, '0')} from lce_request_duration_seconds_bucket")
    has(lambda e: "lce_tokens_total" in e and "rate(" in e, "tokens/s from lce_tokens_total")
    has(lambda e: "lce_device_memory_bytes" in e, "GPU memory from lce_device_memory_bytes")

    known = series_names()
    for title, e in exprs:
        names = set(re.findall(r"\blce_[a-zA-Z0-9_]+", e))
        unknown = names - set(known)
        check(not unknown, f"dashboard: '{title}' uses exported metric names only {sorted(names)}"
                           + (f"; unknown: {sorted(unknown)}" if unknown else ""))
        allowed = set().union(*(known[n] for n in names if n in known)) | TARGET_LABELS
        for grp in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", e):
            labels = {x.strip() for x in grp.split(",") if x.strip()}
            check(labels <= allowed, f"dashboard: '{title}' groups by labels the series carry {sorted(labels)}")

    if promtool:
        # promtool parses PromQL in recording rules; Grafana's $__ variables become fixed ranges.
        groups = [{"name": "dashboard", "rules": [
            {"record": f"dashboard:expr_{i}", "expr": re.sub(r"\$__(rate_)?interval|\$__range", "5m", e)}
            for i, (_, e) in enumerate(exprs)]}]
        with tempfile.NamedTemporaryFile("w", suffix=".rules.json", delete=False) as f:
            json.dump({"groups": groups}, f)  # JSON is YAML
            rules = f.name
        try:
            r = subprocess.run([promtool, "check", "rules", rules], capture_output=True, text=True)
            check(r.returncode == 0, f"dashboard: all {len(exprs)} expressions parse as PromQL (promtool check rules)"
                  + ("" if r.returncode == 0 else "\n" + r.stdout + r.stderr))
        finally:
            os.unlink(rules)
    else:
        print("SKIP dashboard: PromQL parse of the expressions (no promtool)")
    return 1 if failures else 0


def main():
    root, mode = sys.argv[1], sys.argv[2]
    if mode == "yaml":
        return check_yaml(root)
    if mode == "dashboard":
        return check_dashboard(root, sys.argv[3] if len(sys.argv) > 3 else "")
    print(f"unknown mode {mode}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
