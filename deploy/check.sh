#!/usr/bin/env bash
# Checks the deployment files under deploy/ and docs/operations.md.
#
#   bash deploy/check.sh [PATH/TO/tollgate]
#
# - the Prometheus alert rules: `promtool check rules` (promtool comes with Debian's
#   `prometheus` package: installed with apt-get when missing; skipped, saying so, when
#   it does not install);
# - every `tollgate_*` metric the alert rules, the Grafana dashboard and docs/operations.md
#   name is one that crates/tollgate-server/src/metrics.rs (or metrics/*.rs) registers;
# - the Grafana dashboard: valid JSON (`python3 -m json.tool`), a Prometheus data source
#   variable that every panel uses, unique panel ids, queries that promtool parses;
# - the Kubernetes manifests and the Envoy configurations (the front proxy's and the
#   sidecar's, deploy/kubernetes/envoy-sidecar/): YAML that parses (PyYAML; skipped, saying
#   so, without it), and what they must say: the probes, ports and rule volume of the
#   Deployment, the sidecar's container, config volume and Service, the Envoy rate limit
#   filter, its HTTP/2 cluster and that its domain is one the ConfigMap defines; the Envoy
#   configurations against Envoy's protos when a python with xds-protos is at hand (.venv,
#   as .ci/run makes it); `kubectl kustomize` when kubectl is installed;
# - the systemd unit: `systemd-analyze verify`, when systemd-analyze is installed;
# - with a `tollgate` binary as $1: the ConfigMap's rule files pass `tollgate validate`,
#   and every `--flag` and `TOLLGATE_*` variable that docs/operations.md and deploy/ name
#   is one that `tollgate <command> --help` lists.
#
# Prints one line per check (ok, skip or FAIL) and exits 1 if any check failed.
set -euo pipefail

tollgate=""
if [ $# -gt 0 ] && [ -n "$1" ]; then
  if [ ! -x "$1" ]; then
    echo "deploy/check.sh: $1 is not an executable tollgate binary" >&2
    exit 2
  fi
  tollgate=$(realpath "$1")
fi
cd "$(dirname "$0")/.."

passed=0
skipped=0
failed=0
ok() { printf 'ok    %s\n' "$*"; passed=$((passed + 1)); }
skip() { printf 'skip  %s\n' "$*"; skipped=$((skipped + 1)); }
fail() { printf 'FAIL  %s\n' "$*"; failed=$((failed + 1)); }
# Runs a check: its output is shown only when it fails.
check() {
  local what=$1 out
  shift
  if out=$("$@" 2>&1); then
    ok "$what"
  else
    fail "$what"
    printf '%s\n' "$out" | sed 's/^/      /'
  fi
}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

RULES=deploy/prometheus/tollgate-rules.yaml
DASHBOARD=deploy/grafana/tollgate-dashboard.json
ENVOY=deploy/envoy/envoy.yaml
K8S=deploy/kubernetes
SIDECAR=deploy/kubernetes/envoy-sidecar
UNIT=deploy/systemd/tollgate.service
DOC=docs/operations.md

# --- Prometheus rules ------------------------------------------------------------------

install_promtool() {
  command -v apt-get >/dev/null || return 1
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || return 1
    sudo="sudo -n"
  fi
  echo "promtool is missing: installing Debian's prometheus package"
  $sudo apt-get update -qq >/dev/null 2>&1 || return 1
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null 2>&1 || return 1
  # The package starts a Prometheus server where systemd runs; only promtool is wanted.
  if [ -d /run/systemd/system ]; then
    $sudo systemctl disable --now prometheus >/dev/null 2>&1 || true
  fi
  command -v promtool >/dev/null
}

if command -v promtool >/dev/null || install_promtool; then
  check "promtool check rules $RULES" promtool check rules "$RULES"
  # The dashboard's queries, as recording rules, so that promtool parses their PromQL.
  if python3 - "$DASHBOARD" > "$tmp/dashboard-queries.yaml" <<'EOF'
import json, sys
dash = json.load(open(sys.argv[1]))
exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
print("groups:\n  - name: dashboard\n    rules:")
for i, expr in enumerate(exprs):
    expr = expr.replace("$__rate_interval", "5m").replace("$job", ".*").replace("$instance", ".*")
    print(f"      - record: dashboard_query_{i}\n        expr: {json.dumps(expr)}")
EOF
  then
    check "promtool parses the dashboard's queries" promtool check rules "$tmp/dashboard-queries.yaml"
  else
    fail "the dashboard's queries: cannot read them from $DASHBOARD"
  fi
else
  skip "promtool check rules $RULES and the dashboard's queries: promtool is not installed and Debian's prometheus package did not install (apt-get missing, no root, or no package)"
fi

# The metrics the rules and the dashboard read, against those the service registers.
check "the alert rules, the dashboard and $DOC name only metrics Tollgate exports" python3 - "$RULES" "$DASHBOARD" "$DOC" <<'EOF'
import re, sys
import glob
src = "".join(open(p).read() for p in ["crates/tollgate-server/src/metrics.rs"] + sorted(glob.glob("crates/tollgate-server/src/metrics/*.rs")))
kinds = {}
for var, init in re.findall(r"let (\w+) = ([^;]+);", src):
    for kind in ("Histogram", "Counter", "Gauge"):
        if kind in init:
            kinds[var] = kind
            break
registered = re.findall(r'register\(\s*"(\w+)",\s*"[^"]*"\s*(?:"[^"]*"\s*)*,\s*(\w+)\.clone\(\)', src, re.S)
calls = len(re.findall(r"registry\.register\(", src))
if calls < 20 or len(registered) != calls:
    sys.exit(f"metrics.rs: read {len(registered)} of {calls} registry.register calls; has its layout changed?")
names = set()
for name, var in registered:
    base = "tollgate_" + name
    kind = kinds.get(var)
    if kind == "Counter":
        names.add(base + "_total")
    elif kind == "Gauge":
        names.add(base)
    elif kind == "Histogram":
        names.update(base + s for s in ("", "_bucket", "_sum", "_count"))
    else:
        sys.exit(f"metrics.rs: cannot tell the type of {name} ({var})")
unknown = []
for path in sys.argv[1:]:
    for used in sorted(set(re.findall(r"\btollgate_[a-z_]+\b", open(path).read()))):
        if used not in names:
            unknown.append(f"{path}: {used}")
if unknown:
    sys.exit("not exported by Tollgate:\n" + "\n".join(unknown))
EOF

# --- Grafana dashboard ------------------------------------------------------------------

check "python3 -m json.tool $DASHBOARD" python3 -m json.tool "$DASHBOARD"
check "the dashboard: a Prometheus data source variable, used by every panel; unique panel ids" python3 - "$DASHBOARD" <<'EOF'
import json, sys
dash = json.load(open(sys.argv[1]))
variables = {v["name"]: v for v in dash["templating"]["list"]}
ds = variables.get("datasource")
if not ds or ds["type"] != "datasource" or ds["query"] != "prometheus":
    sys.exit("no `datasource` variable of type datasource for prometheus")
ids = []
for panel in dash["panels"]:
    ids.append(panel["id"])
    if panel["type"] == "row":
        continue
    for target in [panel] + panel.get("targets", []):
        if target.get("datasource") != {"type": "prometheus", "uid": "${datasource}"}:
            sys.exit(f"panel {panel['title']!r} does not use the $datasource variable")
    if not panel.get("targets") or not all(t.get("expr") for t in panel["targets"]):
        sys.exit(f"panel {panel['title']!r} has no query")
if len(ids) != len(set(ids)):
    sys.exit("panel ids repeat")
EOF

# --- Kubernetes and Envoy YAML ------------------------------------------------------------

if python3 -c 'import yaml' 2>/dev/null; then
  have_yaml=1
  for file in "$K8S"/*.yaml "$SIDECAR"/*.yaml "$ENVOY"; do
    check "YAML parses: $file" python3 -c 'import sys, yaml; list(yaml.safe_load_all(open(sys.argv[1])))' "$file"
  done

  check "the Kubernetes manifests: Deployment probes, ports, rule volume; Services; ConfigMap" python3 - "$K8S" <<'EOF'
import glob, sys, yaml
docs = {}
for path in sorted(glob.glob(sys.argv[1] + "/*.yaml")):
    for doc in yaml.safe_load_all(open(path)):
        if doc and doc.get("kind") != "Kustomization":
            docs[(doc["kind"], doc["metadata"]["name"])] = doc
deployment = docs[("Deployment", "tollgate")]
pod = deployment["spec"]["template"]["spec"]
container = pod["containers"][0]
assert container["args"][0] == "serve", "the container runs `tollgate serve`"
env = {e["name"]: e.get("value") for e in container["env"]}
ports = {p["name"]: p["containerPort"] for p in container["ports"]}
def port_of(var, default):
    return int((env.get(var) or default).rsplit(":", 1)[1])
assert ports["grpc"] == port_of("TOLLGATE_GRPC_LISTEN", "0.0.0.0:8081"), "the grpc port is the gRPC listener's"
assert ports["http"] == port_of("TOLLGATE_HTTP_LISTEN", "0.0.0.0:8080"), "the http port is the HTTP listener's"
if "TOLLGATE_ADMIN_LISTEN" in env:
    assert ports["admin"] == port_of("TOLLGATE_ADMIN_LISTEN", ""), "the admin port is the admin listener's"
assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}, "readiness: /readyz on http"
assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}, "liveness: /healthz on http"
for kind in ("requests", "limits"):
    assert {"cpu", "memory"} <= set(container["resources"][kind]), f"resources.{kind}: cpu and memory"
assert "TOLLGATE_STORE" in env, "the store comes from TOLLGATE_STORE"
# The rules: a ConfigMap mounted as a directory (no subPath, which is never updated).
volumes = {v["name"]: v for v in pod["volumes"]}
mounts = [m for m in container["volumeMounts"] if "configMap" in volumes[m["name"]]]
assert mounts, "a ConfigMap volume is mounted"
for mount in mounts:
    assert "subPath" not in mount, "a ConfigMap mounted with subPath is never updated"
    assert env.get("TOLLGATE_CONFIG") == mount["mountPath"], "TOLLGATE_CONFIG is the mounted directory"
    assert ("ConfigMap", volumes[mount["name"]]["configMap"]["name"]) in docs, "the mounted ConfigMap is defined"
labels = deployment["spec"]["template"]["metadata"]["labels"]
service_ports = {}
for (kind, name), doc in docs.items():
    if kind == "Service":
        assert doc["spec"]["selector"].items() <= labels.items(), f"Service {name} selects the pods"
        for p in doc["spec"]["ports"]:
            assert p["targetPort"] in ports, f"Service {name}: targetPort {p['targetPort']} is a container port"
            service_ports.setdefault(name, {})[p["name"]] = p["port"]
assert service_ports["tollgate"] == {"grpc": 8081, "http": 8080}, "Service tollgate: grpc 8081, http 8080"
EOF

  # The sidecar's Envoy configuration, out of its ConfigMap, and its pod and Service.
  check "the Envoy sidecar: its container, config volume and Service" python3 - "$SIDECAR" "$tmp/sidecar-envoy.yaml" <<'EOF'
import glob, sys, yaml
docs = {}
for path in sorted(glob.glob(sys.argv[1] + "/*.yaml")):
    for doc in yaml.safe_load_all(open(path)):
        if doc and doc.get("kind") != "Kustomization":
            docs[(doc["kind"], doc["metadata"]["name"])] = doc
deployment = docs[("Deployment", "app")]
pod = deployment["spec"]["template"]["spec"]
containers = {c["name"]: c for c in pod["containers"]}
assert "app" in containers, "the application's container, `app`"
envoy = containers["envoy"]
args = envoy["args"]
config_path = args[args.index("-c") + 1]
volumes = {v["name"]: v for v in pod["volumes"]}
mounted = None
for m in envoy["volumeMounts"]:
    volume = volumes[m["name"]]
    if "configMap" in volume and config_path.startswith(m["mountPath"].rstrip("/") + "/"):
        mounted = (volume["configMap"]["name"], config_path[len(m["mountPath"].rstrip("/")) + 1:])
assert mounted, f"{config_path} comes from a mounted ConfigMap"
config = docs[("ConfigMap", mounted[0])]["data"][mounted[1]]
open(sys.argv[2], "w").write(config)
config = yaml.safe_load(config)
ports = {p["name"]: p["containerPort"] for p in envoy["ports"]}
listeners = {l["address"]["socket_address"]["port_value"] for l in config["static_resources"]["listeners"]}
for name in ("readinessProbe", "livenessProbe"):
    assert ports[envoy[name]["tcpSocket"]["port"]] in listeners, f"envoy's {name} checks its listener"
assert {"cpu", "memory"} <= set(envoy["resources"]["requests"]), "envoy: resource requests"
labels = deployment["spec"]["template"]["metadata"]["labels"]
service = docs[("Service", "app")]
assert service["spec"]["selector"].items() <= labels.items(), "Service app selects the pods"
for p in service["spec"]["ports"]:
    assert ports.get(p["targetPort"]) in listeners, "Service app sends clients to Envoy's listener"
clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
app_hosts = {e["endpoint"]["address"]["socket_address"]["address"]
             for g in clusters["app"]["load_assignment"]["endpoints"] for e in g["lb_endpoints"]}
assert app_hosts == {"127.0.0.1"}, "the sidecar forwards to the application in its pod"
EOF

  for envoy_file in "$ENVOY" "$tmp/sidecar-envoy.yaml"; do
  check "the Envoy configuration ($envoy_file): rate limit filter, HTTP/2 cluster, routes' actions, a domain the rules define" python3 - "$envoy_file" "$K8S/configmap.yaml" <<'EOF'
import sys, yaml
envoy = yaml.safe_load(open(sys.argv[1]))
rules = yaml.safe_load(open(sys.argv[2]))
domains = {yaml.safe_load(text)["domain"] for name, text in rules["data"].items()
           if name.endswith((".yaml", ".yml"))}
clusters = {c["name"]: c for c in envoy["static_resources"]["clusters"]}
filters, actions = [], set()
for listener in envoy["static_resources"]["listeners"]:
    for chain in listener["filter_chains"]:
        for f in chain["filters"]:
            hcm = f["typed_config"]
            filters += [h for h in hcm.get("http_filters", []) if h["name"] == "envoy.filters.http.ratelimit"]
            for vhost in hcm["route_config"]["virtual_hosts"]:
                for route in vhost["routes"]:
                    for limit in route.get("route", {}).get("rate_limits", []):
                        for action in limit["actions"]:
                            actions.update(action)
assert filters, "an envoy.filters.http.ratelimit filter"
for f in filters:
    config = f["typed_config"]
    assert config["@type"].endswith("ratelimit.v3.RateLimit")
    for key in ("domain", "timeout", "failure_mode_deny"):
        assert key in config, f"the rate limit filter sets {key}"
    assert config["domain"] in domains, f"domain {config['domain']!r} is not one of the ConfigMap's {sorted(domains)}"
    service = config["rate_limit_service"]
    assert service["transport_api_version"] == "V3"
    cluster = clusters[service["grpc_service"]["envoy_grpc"]["cluster_name"]]
    options = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in options["explicit_http_config"], "the rate limit cluster speaks HTTP/2"
    ports = {e["endpoint"]["address"]["socket_address"]["port_value"]
             for group in cluster["load_assignment"]["endpoints"] for e in group["lb_endpoints"]}
    assert ports == {8081}, "the rate limit cluster points at Tollgate's gRPC port, 8081"
assert {"remote_address", "request_headers"} <= actions, "routes use remote_address and request_headers actions"
EOF
  done

  # The ConfigMap's rule files, for `tollgate validate` below.
  check "the ConfigMap's rule files extracted" python3 - "$K8S/configmap.yaml" "$tmp/rules" <<'EOF'
import os, sys, yaml
os.makedirs(sys.argv[2])
written = 0
for doc in yaml.safe_load_all(open(sys.argv[1])):
    if doc and doc.get("kind") == "ConfigMap":
        for name, text in doc.get("data", {}).items():
            if name.endswith((".yaml", ".yml")):
                open(os.path.join(sys.argv[2], name), "w").write(text)
                written += 1
if not written:
    sys.exit("no *.yaml entry in the ConfigMap's data")
EOF
else
  have_yaml=0
  skip "YAML parsing of $K8S/*.yaml and $ENVOY, and their content checks: PyYAML is not installed for python3 (pip install pyyaml, or apt-get install python3-yaml)"
fi

# The Envoy configuration against Envoy's own protos (xds-protos: the .venv that .ci/run
# makes for the tests has them): every field name and type, inside typed_config too.
envoy_python=""
for candidate in .venv/bin/python python3; do
  if command -v "$candidate" >/dev/null && "$candidate" -c 'import envoy.config.bootstrap.v3.bootstrap_pb2' 2>/dev/null; then
    envoy_python=$candidate
    break
  fi
done
if [ "$have_yaml" = 1 ] && [ -n "$envoy_python" ]; then
  for envoy_file in "$ENVOY" "$tmp/sidecar-envoy.yaml"; do
  python3 -c 'import json, sys, yaml; json.dump(yaml.safe_load(open(sys.argv[1])), sys.stdout)' "$envoy_file" > "$tmp/envoy.json"
  check "$envoy_file parses as Envoy's Bootstrap message (xds-protos)" "$envoy_python" - "$tmp/envoy.json" <<'EOF'
import importlib, json, pkgutil, sys
import envoy
from google.protobuf import json_format
# Every Envoy message, so that each typed_config's type URL resolves.
for module in pkgutil.walk_packages(envoy.__path__, "envoy."):
    if module.name.endswith("_pb2"):
        try:
            importlib.import_module(module.name)
        except Exception:
            pass
from envoy.config.bootstrap.v3 import bootstrap_pb2
try:
    json_format.ParseDict(json.load(open(sys.argv[1])), bootstrap_pb2.Bootstrap())
except json_format.ParseError as e:
    sys.exit(str(e))
EOF
  done
else
  skip "$ENVOY and the sidecar's Envoy configuration against Envoy's protos: needs PyYAML and a python with xds-protos (.venv/bin/pip install -r crates/tollgate-server/tests/python/requirements.txt)"
fi

if command -v kubectl >/dev/null; then
  check "kubectl kustomize $K8S" kubectl kustomize "$K8S"
  check "kubectl kustomize $SIDECAR" kubectl kustomize "$SIDECAR"
else
  skip "kubectl kustomize $K8S and $SIDECAR: kubectl is not installed"
fi

# --- systemd ------------------------------------------------------------------------------

if command -v systemd-analyze >/dev/null; then
  # verify wants ExecStart's program to exist: the binary given, else a stand-in.
  program=${tollgate:-/bin/true}
  sed "s#^ExecStart=/usr/local/bin/tollgate #ExecStart=$program #" "$UNIT" > "$tmp/tollgate.service"
  verify_unit() {
    local out
    out=$(systemd-analyze verify "$tmp/tollgate.service" 2>&1) || { printf '%s\n' "$out"; return 1; }
    # Unknown keys and bad values are warnings, exit status 0: any line about the unit fails.
    if printf '%s\n' "$out" | grep 'tollgate.service'; then return 1; fi
  }
  check "systemd-analyze verify $UNIT" verify_unit
else
  skip "systemd-analyze verify $UNIT: systemd-analyze is not installed"
fi

# --- with the binary ----------------------------------------------------------------------

if [ -n "$tollgate" ]; then
  if [ "$have_yaml" = 0 ]; then
    # Without PyYAML: the block scalars (`name.yaml: |`) under the ConfigMap's `data:`.
    mkdir -p "$tmp/rules"
    awk -v dir="$tmp/rules" '
      /^data:/ { data = 1; next }
      data && /^[^ #]/ { data = 0 }
      data && match($0, /^  [^ :]+\.ya?ml: \|-?$/) {
        file = dir "/" substr($0, 3, index($0, ":") - 3); next
      }
      data && file != "" && /^  [^ ]/ { file = ""; next }
      file != "" { sub(/^    /, ""); print > file }
    ' "$K8S/configmap.yaml"
  fi
  if [ -n "$(ls -A "$tmp/rules" 2>/dev/null)" ]; then
    check "tollgate validate: the ConfigMap's rule files" "$tollgate" validate "$tmp/rules"
  else
    fail "tollgate validate of the ConfigMap's rule files: none found in $K8S/configmap.yaml"
  fi

  for command in "" serve proxy validate conformance redis-script redis-prune; do
    # shellcheck disable=SC2086
    "$tollgate" $command --help >> "$tmp/help.txt"
  done
  check "every --flag and TOLLGATE_* variable in $DOC and deploy/ is one tollgate --help lists" \
    python3 - "$tmp/help.txt" "$DOC" "$UNIT" "$K8S"/*.yaml "$SIDECAR"/*.yaml "$ENVOY" "$RULES" <<'EOF'
import re, sys
help_text = open(sys.argv[1]).read()
flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", help_text))
variables = set(re.findall(r"env: (TOLLGATE_[A-Z_]+)", help_text))
# Flags of other programs that the documentation quotes.
foreign = {"--release", "--from-literal", "--now", "--cluster", "--bigkeys", "--memkeys",
           "--no-install-recommends", "--"}
missing = []
for path in sys.argv[2:]:
    text = open(path).read()
    for flag in sorted(set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text)) - flags - foreign):
        missing.append(f"{path}: {flag}")
    for var in sorted(set(re.findall(r"\bTOLLGATE_[A-Z_]*[A-Z]\b", text)) - variables):
        missing.append(f"{path}: {var}")
if missing:
    sys.exit("not in tollgate --help:\n" + "\n".join(missing))
EOF
else
  skip "tollgate validate of the ConfigMap's rules, and the flags and variables the docs name: no tollgate binary given (bash deploy/check.sh target/debug/tollgate)"
fi

echo "deploy/check.sh: $passed passed, $skipped skipped, $failed failed"
[ "$failed" -eq 0 ]
