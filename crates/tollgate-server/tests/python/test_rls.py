"""`tollgate serve` answering an independent gRPC client (grpcio) we did not write.

The client is grpcio (not Envoy's own client) with the stubs the `xds-protos` package
generates from Envoy's own protos
(`envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`), so this checks the wire
format as Envoy's protos define it, not as our Rust types see it.

Run by `tests/grpc_python.rs` (`cargo test`), or directly:

    TOLLGATE_BIN=target/debug/tollgate .venv/bin/python -m pytest -q crates/tollgate-server/tests/python

Each test uses its own descriptor values: the server (and its counters) is shared by
the whole module.
"""

import itertools
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import grpc
import pytest
from google.protobuf import json_format, wrappers_pb2
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

HOST = "127.0.0.1"

RULES = """\
domain: test
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 3, name: per_user}
  - key: path
    value: /upload*
    rate_limit: {unit: hour, requests_per_unit: 1, name: uploads}
  - key: unlimited
    rate_limit: {unlimited: true}
  - key: tier
    rate_limit: {unit: hour, requests_per_unit: 1, name: tiers}
    metadata:
      team: payments
      weight: 2
      tags: [gold, "eu"]
"""

OK = rls_pb2.RateLimitResponse.OK
OVER_LIMIT = rls_pb2.RateLimitResponse.OVER_LIMIT
MINUTE = rls_pb2.RateLimitResponse.RateLimit.MINUTE
HOUR = rls_pb2.RateLimitResponse.RateLimit.HOUR
U32_MAX = 4294967295


_PORTS = itertools.count(os.getpid() % 2000)


def free_port():
    """A loopback port nobody listens on right now.

    Taken from 5000-6999, below the kernel's ephemeral range, never twice in this
    process: a port the kernel picked for bind(0) could be picked again for a client
    connection before the server under test binds it.
    """
    for n in _PORTS:
        port = 5000 + n % 2000
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
            return port
    raise AssertionError("unreachable")


def http_status(url):
    """The status of GET `url`, never through a proxy; None when nothing answers."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=1) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def log_text(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def make_certificates(directory):
    """With `openssl`: a CA (`ca.pem`), a server certificate for 127.0.0.1 and localhost
    (`server.pem`, `server.key`) and a client certificate (`client.pem`, `client.key`),
    both signed by the CA."""
    def openssl(*args):
        done = subprocess.run(["openssl", *args], cwd=directory, capture_output=True)
        assert done.returncode == 0, f"openssl {args} failed: {done.stderr.decode()}"

    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", "-new", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=tollgate python test CA")
    (directory / "server.ext").write_text(
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    (directory / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for who in ["server", "client"]:
        openssl("req", "-new", *key, "-keyout", f"{who}.key", "-out", f"{who}.csr",
                "-subj", f"/CN=tollgate python test {who}")
        openssl("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", f"{who}.pem", "-days", "2", "-extfile", f"{who}.ext")


def start_server(tmp, flags):
    """`tollgate serve` with RULES and these extra `flags`, ready; (process, gRPC port,
    HTTP port, log path)."""
    binary = os.environ.get("TOLLGATE_BIN")
    assert binary, "set TOLLGATE_BIN to the tollgate binary (cargo test does this)"
    rules = tmp / "rules"
    rules.mkdir()
    (rules / "test.yaml").write_text(RULES)
    grpc_port, http_port = free_port(), free_port()
    while http_port == grpc_port:
        http_port = free_port()
    log_path = tmp / "server.log"
    command = [
        binary,
        "serve",
        "--config", str(rules),
        "--grpc-listen", f"{HOST}:{grpc_port}",
        "--http-listen", f"{HOST}:{http_port}",
        *flags,
    ]
    # No TOLLGATE_* settings from the caller's environment: only the flags above count.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOLLGATE_")}
    with open(log_path, "wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 10
    ready = f"http://{HOST}:{http_port}/readyz"
    while http_status(ready) != 200:
        if server.poll() is not None:
            pytest.fail(f"tollgate serve exited with {server.returncode} before it was ready:\n{log_text(log_path)}")
        if time.monotonic() > deadline:
            server.kill()
            server.wait()
            pytest.fail(f"{ready} did not answer 200 within 10 s:\n{log_text(log_path)}")
        time.sleep(0.05)
    return server, grpc_port, http_port, log_path


def stop_server(server, log_path):
    """SIGTERM: the server must drain and exit 0 within a few seconds."""
    server.send_signal(signal.SIGTERM)
    try:
        code = server.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pytest.fail(f"tollgate serve did not exit within 5 s of SIGTERM:\n{log_text(log_path)}")
    assert code == 0, f"tollgate serve exited with {code} after SIGTERM:\n{log_text(log_path)}"


@pytest.fixture(scope="module", params=["native", "tonic", "mutual-tls"])
def stub(request, tmp_path_factory):
    """A running `tollgate serve` with RULES, and a stub connected to its gRPC port;
    every test runs on both gRPC transports (`--grpc-transport`), and over mutual TLS
    (`--grpc-tls-cert`, `--grpc-tls-key`, `--grpc-tls-client-ca`: served by tonic, with
    grpcio's BoringSSL as the client, the TLS library Envoy uses).

    At the end: SIGTERM, and the server must drain and exit 0 within a few seconds.
    """
    tmp = tmp_path_factory.mktemp("tollgate")
    flags = ["--legacy-headers", "--response-dynamic-metadata"]
    certificates = None
    if request.param == "mutual-tls":
        certificates = tmp / "certificates"
        certificates.mkdir()
        make_certificates(certificates)
        flags += [
            "--grpc-tls-cert", str(certificates / "server.pem"),
            "--grpc-tls-key", str(certificates / "server.key"),
            "--grpc-tls-client-ca", str(certificates / "ca.pem"),
        ]
    else:
        flags += ["--grpc-transport", request.param]
    server, grpc_port, _, log_path = start_server(tmp, flags)
    try:
        options = [("grpc.enable_http_proxy", 0)]
        if certificates is not None:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=(certificates / "ca.pem").read_bytes(),
                private_key=(certificates / "client.key").read_bytes(),
                certificate_chain=(certificates / "client.pem").read_bytes(),
            )
            channel = grpc.secure_channel(f"{HOST}:{grpc_port}", credentials, options=options)
        else:
            channel = grpc.insecure_channel(f"{HOST}:{grpc_port}", options=options)
        try:
            stub = rls_pb2_grpc.RateLimitServiceStub(channel)
            stub.channel = channel
            stub.target = f"{HOST}:{grpc_port}"
            stub.certificates = certificates
            yield stub
        finally:
            channel.close()
        stop_server(server, log_path)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


@pytest.fixture(scope="module", params=["native", "tonic"])
def envoy_stub(request, tmp_path_factory):
    """A `tollgate serve` answering as envoyproxy/ratelimit with
    `LIMIT_RESPONSE_HEADERS_ENABLED=true`: its three headers only, no `Retry-After`, no
    `raw_body`."""
    tmp = tmp_path_factory.mktemp("tollgate-envoy")
    flags = ["--grpc-transport", request.param, "--envoy-headers", "--ratelimit-headers=false",
             "--retry-after=false", "--problem-body=false"]
    server, grpc_port, _, log_path = start_server(tmp, flags)
    try:
        channel = grpc.insecure_channel(f"{HOST}:{grpc_port}",
                                        options=[("grpc.enable_http_proxy", 0)])
        try:
            yield rls_pb2_grpc.RateLimitServiceStub(channel)
        finally:
            channel.close()
        stop_server(server, log_path)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def request(domain, *descriptors, hits_addend=0):
    """A RateLimitRequest; each descriptor is a list of (key, value) entries."""
    return rls_pb2.RateLimitRequest(
        domain=domain,
        descriptors=[
            ratelimit_pb2.RateLimitDescriptor(
                entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in entries]
            )
            for entries in descriptors
        ],
        hits_addend=hits_addend,
    )


def check(stub, *descriptors, domain="test", hits_addend=0):
    return stub.ShouldRateLimit(request(domain, *descriptors, hits_addend=hits_addend), timeout=5)


def headers(response):
    """`response_headers_to_add` as a dict by lower-case name; every name at most once."""
    names = [h.key.lower() for h in response.response_headers_to_add]
    assert len(names) == len(set(names)), f"a header repeats: {names}"
    return {h.key.lower(): h.value for h in response.response_headers_to_add}


def away_from_window_end(window_seconds, margin=5):
    """Waits, if needed, so that the next `margin` seconds stay in one epoch-aligned
    window of `window_seconds`: a count must not restart in the middle of a test."""
    left = window_seconds - time.time() % window_seconds
    if left < margin:
        time.sleep(left + 0.2)


def test_a_user_counts_down_to_zero_then_is_over_the_limit(stub):
    away_from_window_end(60)
    for expected_remaining in (2, 1, 0):
        before = time.time()
        response = check(stub, [("user", "alice")])
        after = time.time()
        assert response.overall_code == OK
        assert len(response.statuses) == 1
        status = response.statuses[0]
        assert status.code == OK
        assert status.limit_remaining == expected_remaining
        assert status.current_limit.requests_per_unit == 3
        assert status.current_limit.unit == MINUTE
        assert status.current_limit.name == "per_user"
        # Whole seconds, as Envoy's service sends them: 60 - now % 60 on whole seconds.
        assert status.duration_until_reset.nanos == 0
        reset = status.duration_until_reset.seconds
        assert 60 - int(after) % 60 <= reset <= 60 - int(before) % 60, (before, after, reset)

    response = check(stub, [("user", "alice")])
    assert response.overall_code == OVER_LIMIT
    assert response.statuses[0].code == OVER_LIMIT
    assert response.statuses[0].limit_remaining == 0
    assert response.statuses[0].current_limit.name == "per_user"


def test_answers_carry_ratelimit_headers_and_a_rejection_explains_itself(stub):
    away_from_window_end(60)
    response = check(stub, [("user", "carol")])
    assert response.overall_code == OK
    h = headers(response)
    assert h["ratelimit-policy"] == '"per_user";q=3;w=60'
    state = re.fullmatch(r'"per_user";r=(\d+);t=(\d+)', h["ratelimit"])
    assert state, f"RateLimit: {h['ratelimit']!r}"
    assert int(state.group(1)) == 2
    assert 1 <= int(state.group(2)) <= 60
    assert h["x-ratelimit-limit"] == "3"
    assert h["x-ratelimit-remaining"] == "2"
    assert 1 <= int(h["x-ratelimit-reset"]) <= 60
    assert "retry-after" not in h, "an OK answer has no Retry-After"
    assert response.raw_body == b"", "an OK answer has no body"

    check(stub, [("user", "carol")])
    check(stub, [("user", "carol")])
    response = check(stub, [("user", "carol")])
    assert response.overall_code == OVER_LIMIT
    h = headers(response)
    assert re.fullmatch(r"[1-9][0-9]*", h["retry-after"]), f"Retry-After: {h['retry-after']!r}"
    assert int(h["retry-after"]) <= 60
    assert re.fullmatch(r'"per_user";r=0;t=\d+', h["ratelimit"]), f"RateLimit: {h['ratelimit']!r}"
    assert h["x-ratelimit-remaining"] == "0"
    problem = json.loads(response.raw_body)
    assert [p["policy"] for p in problem["violated_policies"]] == ["per_user"], problem


def test_several_descriptors_answer_in_order_and_a_rejected_request_charges_nothing(stub):
    # bob's limit is per minute, the uploads' per hour: an hour ends only where a
    # minute does, so staying away from the minute's end keeps both windows.
    away_from_window_end(60)
    bob, nothing, upload = [("user", "bob")], [("colour", "blue")], [("path", "/upload/photo.jpg")]

    response = check(stub, bob, nothing, upload)
    assert response.overall_code == OK
    assert len(response.statuses) == 3
    per_user, unmatched, uploads = response.statuses
    assert (per_user.code, per_user.current_limit.name, per_user.limit_remaining) == (OK, "per_user", 2)
    assert unmatched.code == OK
    assert not unmatched.HasField("current_limit"), "a descriptor without a rule has no limit"
    assert (uploads.code, uploads.current_limit.name, uploads.limit_remaining) == (OK, "uploads", 0)
    assert uploads.current_limit.unit == HOUR
    assert uploads.current_limit.requests_per_unit == 1

    bob_remaining = []
    for _ in range(2):
        response = check(stub, bob, nothing, upload)
        assert response.overall_code == OVER_LIMIT
        assert [s.code for s in response.statuses] == [OK, OK, OVER_LIMIT]
        assert response.statuses[2].current_limit.name == "uploads"
        bob_remaining.append(response.statuses[0].limit_remaining)
    assert bob_remaining[0] == bob_remaining[1], f"bob was charged by a rejected request: {bob_remaining}"

    # Only the first (admitted) request counted for bob.
    response = check(stub, bob)
    assert response.overall_code == OK
    assert response.statuses[0].limit_remaining == 1


def test_an_unlimited_descriptor_reports_the_most_remaining_there_is(stub):
    for _ in range(5):
        response = check(stub, [("unlimited", "anything")])
        assert response.overall_code == OK
        assert response.statuses[0].code == OK
        assert response.statuses[0].limit_remaining == U32_MAX


def test_hits_addend_charges_several_hits_at_once(stub):
    away_from_window_end(60)
    response = check(stub, [("user", "dave")], hits_addend=2)
    assert response.overall_code == OK
    assert response.statuses[0].limit_remaining == 1
    response = check(stub, [("user", "dave")])
    assert response.overall_code == OK
    assert response.statuses[0].limit_remaining == 0


def test_dynamic_metadata_names_the_request_and_the_passing_descriptors_metadata(stub):
    away_from_window_end(60)
    own_limit = ratelimit_pb2.RateLimitDescriptor(
        entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key="user", value="heidi")],
        limit=ratelimit_pb2.RateLimitDescriptor.RateLimitOverride(requests_per_unit=10, unit=HOUR),
        hits_addend=wrappers_pb2.UInt64Value(value=3),
    )
    req = request("test", [("tier", "t1")], [("user", "grace")], hits_addend=1)
    req.descriptors.append(own_limit)
    response = stub.ShouldRateLimit(req, timeout=5)
    assert response.overall_code == OK
    metadata = json_format.MessageToDict(response.dynamic_metadata)
    assert metadata == {
        "domain": "test",
        "hitsAddend": 1.0,
        "descriptors": [
            {"entries": ["tier=t1"], "code": "OK"},
            {"entries": ["user=grace"], "code": "OK"},
            {"entries": ["user=heidi"], "limit": "requests_per_unit:10 unit:HOUR",
             "hitsAddend": 3.0, "code": "OK"},
        ],
        # The rules' metadata of the descriptors that passed, merged.
        "metadata": {"team": "payments", "weight": 2.0, "tags": ["gold", "eu"]},
    }, metadata

    # tiers allows one an hour: the second request is over the limit, and a descriptor
    # that did not pass gives no metadata (what passed is what routing may use).
    response = check(stub, [("tier", "t1")])
    assert response.overall_code == OVER_LIMIT
    metadata = json_format.MessageToDict(response.dynamic_metadata)
    assert metadata == {
        "domain": "test",
        "descriptors": [{"entries": ["tier=t1"], "code": "OVER_LIMIT"}],
    }, metadata


def test_malformed_requests_are_invalid_arguments_and_the_server_keeps_serving(stub):
    with pytest.raises(grpc.RpcError) as error:
        check(stub, [("user", "erin")], domain="")
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details() == "rate limit domain must not be empty"

    with pytest.raises(grpc.RpcError) as error:
        check(stub)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details() == "rate limit descriptor list must not be empty"

    with pytest.raises(grpc.RpcError) as error:
        check(stub, [("", "erin")])
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    away_from_window_end(60)
    response = check(stub, [("user", "erin")])
    assert response.overall_code == OK
    assert response.statuses[0].limit_remaining == 2, "the malformed requests charged nothing"


def test_requests_over_the_caps_are_invalid_arguments_naming_the_cap(stub):
    """At most 64 descriptors of 32 entries (`--max-descriptors`, `--max-entries`), keys
    and values of at most 64 KiB: past them INVALID_ARGUMENT, whatever the transport;
    100,000 descriptors (1.8 MB) are refused as quickly."""
    cases = [
        ([[("user", f"gina{i}")] for i in range(65)],
         "a request may carry at most 64 descriptors (--max-descriptors)"),
        ([[("user", f"hana{i}")] for i in range(100_000)],
         "a request may carry at most 64 descriptors (--max-descriptors)"),
        ([[(f"k{j}", "v") for j in range(33)]],
         "descriptor 0: a descriptor may carry at most 32 entries (--max-entries)"),
        ([[("user", "x" * (1 << 20))]],
         "descriptor 0, entry 0: the value is 1048576 bytes; a key or value may be at most "
         "65536 bytes (--max-entry-bytes)"),
    ]
    for descriptors, why in cases:
        with pytest.raises(grpc.RpcError) as error:
            check(stub, *descriptors)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details() == why

    # At the cap: decided, and the 64 descriptors of one limit make one policy item.
    away_from_window_end(60)
    response = check(stub, *[[("user", f"gina{i}")] for i in range(64)])
    assert response.overall_code == OK
    assert len(response.statuses) == 64
    assert all(s.limit_remaining == 2 for s in response.statuses), "the refusals charged nothing"
    h = headers(response)
    assert h["ratelimit-policy"] == '"per_user";q=3;w=60'
    assert re.fullmatch(r'"per_user";r=2;t=\d+', h["ratelimit"]), f"RateLimit: {h['ratelimit']!r}"


def test_a_domain_without_rules_is_not_limited(stub):
    response = check(stub, [("user", "frank")], domain="nobody-configured-this")
    assert response.overall_code == OK
    assert len(response.statuses) == 1
    assert response.statuses[0].code == OK
    assert not response.statuses[0].HasField("current_limit")


def test_a_client_of_the_wrong_kind_is_refused(stub):
    """A cleartext listener refuses a TLS client; a mutual TLS listener refuses a
    cleartext client, and a TLS client that presents no certificate."""
    options = [("grpc.enable_http_proxy", 0)]
    if stub.certificates is None:
        wrong = [grpc.secure_channel(stub.target, grpc.ssl_channel_credentials(), options=options)]
    else:
        ca = (stub.certificates / "ca.pem").read_bytes()
        wrong = [
            grpc.insecure_channel(stub.target, options=options),
            grpc.secure_channel(stub.target, grpc.ssl_channel_credentials(root_certificates=ca),
                                options=options),
        ]
    for channel in wrong:
        try:
            other = rls_pb2_grpc.RateLimitServiceStub(channel)
            with pytest.raises(grpc.RpcError) as error:
                other.ShouldRateLimit(request("test", [("user", "wrong-kind")]), timeout=5)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE, error.value
        finally:
            channel.close()
    # The right client still is answered.
    assert check(stub, [("user", "wrong-kind")]).overall_code == OK


def test_an_unknown_method_is_unimplemented(stub):
    call = stub.channel.unary_unary(
        "/envoy.service.ratelimit.v3.RateLimitService/NoSuchMethod",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    with pytest.raises(grpc.RpcError) as error:
        call(b"", timeout=5)
    assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_bytes_that_are_not_a_request_are_rejected_and_the_server_keeps_serving(stub):
    call = stub.channel.unary_unary(
        "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    with pytest.raises(grpc.RpcError) as error:
        # Field 1 (domain) as a length-delimited string that claims 100 bytes.
        call(b"\x0a\x64abc", timeout=5)
    assert error.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL)
    response = check(stub, [("user", "gina")], domain="nobody-configured-this")
    assert response.overall_code == OK


def test_many_calls_in_flight_on_one_connection_each_get_their_own_answer(stub):
    # 300 calls at once on the stub's one HTTP/2 connection, each for its own key of a
    # rule that admits 3 per minute, each charging its index mod 5 hits.
    away_from_window_end(60)
    futures = []
    for i in range(300):
        hits = i % 5
        futures.append((hits, stub.ShouldRateLimit.future(
            request("test", [("user", f"many-{i}")], hits_addend=hits), timeout=10)))
    for hits, future in futures:
        response = future.result()
        charged = max(hits, 1)
        if charged <= 3:
            assert response.overall_code == OK
            assert response.statuses[0].limit_remaining == 3 - charged
        else:
            assert response.overall_code == OVER_LIMIT


def test_a_descriptor_without_entries_is_ok_with_no_limit(stub):
    # As Envoy's service answers it: no rule matches an empty descriptor.
    response = check(stub, [])
    assert response.overall_code == OK
    assert len(response.statuses) == 1
    assert response.statuses[0].code == OK
    assert not response.statuses[0].HasField("current_limit")
    assert response.statuses[0].limit_remaining == 0


SERVING = health_pb2.HealthCheckResponse.SERVING


def health(stub, service):
    """`grpc.health.v1.Health/Check` for `service`, through gRPC's own health stub."""
    checker = health_pb2_grpc.HealthStub(stub.channel)
    return checker.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_the_health_service_says_serving_for_the_server_and_for_ratelimit(stub):
    # "" is the server as a whole (Kubernetes' gRPC probe asks it by default);
    # "ratelimit" is the name envoyproxy/ratelimit registers, which Envoy's cluster
    # health checks name.
    for service in ("", "ratelimit", "envoy.service.ratelimit.v3.RateLimitService"):
        assert health(stub, service) == SERVING, service


def test_the_health_service_does_not_know_other_names(stub):
    with pytest.raises(grpc.RpcError) as error:
        health(stub, "no.such.Service")
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    # The server keeps serving.
    assert health(stub, "") == SERVING


def test_envoy_style_answers_carry_envoys_headers_and_nothing_else(envoy_stub):
    away_from_window_end(60)
    before = int(time.time())
    response = check(envoy_stub, [("user", "ivan")], [("path", "/upload/x")])
    after = int(time.time())
    assert response.overall_code == OK
    # uploads (1 an hour, 0 left now) is the descriptor with the least remaining; the
    # reset is Envoy's: whole seconds to the end of the hour.
    fields = [(h.key, h.value) for h in response.response_headers_to_add]
    assert [k for k, _ in fields] == ["RateLimit-Limit", "RateLimit-Remaining", "RateLimit-Reset"]
    assert fields[0][1] == "1" and fields[1][1] == "0", fields
    assert int(fields[2][1]) in {3600 - t % 3600 for t in range(before, after + 1)}, fields
    assert response.raw_body == b""

    response = check(envoy_stub, [("user", "ivan")], [("path", "/upload/x")])
    assert response.overall_code == OVER_LIMIT
    assert headers(response)["ratelimit-limit"] == "1"
    assert headers(response)["ratelimit-remaining"] == "0"
    assert set(headers(response)) == {"ratelimit-limit", "ratelimit-remaining", "ratelimit-reset"}
    assert response.raw_body == b""
