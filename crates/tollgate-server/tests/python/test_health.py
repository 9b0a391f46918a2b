"""`grpc.health.v1.Health` through gRPC's own health stubs (`grpcio-health-checking`), on a
server whose rules do not load at start, then do, then drain.

A server started with an invalid rule file stays up and says so: the health service
answers NOT_SERVING, `ShouldRateLimit` fails with UNKNOWN "no rate limit configuration
loaded" (what envoyproxy/ratelimit answers, and what Envoy's filter turns into its
`failure_mode_deny` choice); once the file is fixed it answers SERVING and decides.
On SIGTERM a `Watch` stream (tonic transport) hears NOT_SERVING and ends.

Run by `tests/grpc_python.rs` (`cargo test`), or directly:

    TOLLGATE_BIN=target/debug/tollgate .venv/bin/python -m pytest -q crates/tollgate-server/tests/python
"""

import os
import signal
import subprocess
import time

import grpc
import pytest
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from test_rls import HOST, RULES, free_port, http_status, log_text, request

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
NO_RULES = "no rate limit configuration loaded"

# RULES with a unit that does not exist.
BROKEN = RULES.replace("unit: hour", "unit: fortnight")


def wait_for(what, condition, seconds, log_path):
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {seconds} s:\n{log_text(log_path)}")
        time.sleep(0.05)


def health(checker, service):
    return checker.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


@pytest.mark.parametrize("transport", ["native", "tonic"])
def test_a_server_whose_rules_do_not_load_is_up_not_serving_until_they_do(transport, tmp_path):
    binary = os.environ.get("TOLLGATE_BIN")
    assert binary, "set TOLLGATE_BIN to the tollgate binary (cargo test does this)"
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "test.yaml").write_text(BROKEN)
    grpc_port, http_port = free_port(), free_port()
    while http_port == grpc_port:
        http_port = free_port()
    log_path = tmp_path / "server.log"
    command = [
        binary, "serve",
        "--config", str(rules),
        "--grpc-listen", f"{HOST}:{grpc_port}",
        "--http-listen", f"{HOST}:{http_port}",
        "--grpc-transport", transport,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOLLGATE_")}
    with open(log_path, "wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    channel = grpc.insecure_channel(f"{HOST}:{grpc_port}", options=[("grpc.enable_http_proxy", 0)])
    try:
        def up():
            if server.poll() is not None:
                pytest.fail(f"tollgate serve exited with {server.returncode}:\n{log_text(log_path)}")
            return http_status(f"http://{HOST}:{http_port}/healthz") == 200
        wait_for("the server did not answer /healthz", up, 10, log_path)
        assert http_status(f"http://{HOST}:{http_port}/readyz") == 503
        assert "unknown unit `fortnight`" in log_text(log_path)

        checker = health_pb2_grpc.HealthStub(channel)
        limiter = rls_pb2_grpc.RateLimitServiceStub(channel)
        for service in ("", "ratelimit"):
            assert health(checker, service) == NOT_SERVING, service
        with pytest.raises(grpc.RpcError) as error:
            health(checker, "no.such.Service")
        assert error.value.code() == grpc.StatusCode.NOT_FOUND

        with pytest.raises(grpc.RpcError) as error:
            limiter.ShouldRateLimit(request("test", [("user", "ann")]), timeout=5)
        assert error.value.code() == grpc.StatusCode.UNKNOWN, error.value
        assert error.value.details() == NO_RULES

        watch = checker.Watch(health_pb2.HealthCheckRequest(service="ratelimit"), timeout=30)
        if transport == "tonic":
            assert next(watch).status == NOT_SERVING
        else:
            # The native transport serves unary calls only.
            with pytest.raises(grpc.RpcError) as error:
                next(watch)
            assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED

        # Fixed the way an editor saves: written beside it, renamed over it.
        (tmp_path / "test.yaml").write_text(RULES)
        os.rename(tmp_path / "test.yaml", rules / "test.yaml")
        wait_for("not SERVING after the fix", lambda: health(checker, "ratelimit") == SERVING, 5,
                 log_path)
        assert health(checker, "") == SERVING
        assert http_status(f"http://{HOST}:{http_port}/readyz") == 200
        response = limiter.ShouldRateLimit(request("test", [("user", "ann")]), timeout=5)
        assert response.overall_code == rls_pb2.RateLimitResponse.OK
        assert response.statuses[0].limit_remaining == 2
        if transport == "tonic":
            assert next(watch).status == SERVING

        server.send_signal(signal.SIGTERM)
        if transport == "tonic":
            # Draining: the watcher hears it, and the stream ends so the drain can.
            assert next(watch).status == NOT_SERVING
            assert list(watch) == []
        try:
            code = server.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pytest.fail(f"tollgate serve did not exit within 5 s of SIGTERM:\n{log_text(log_path)}")
        assert code == 0, f"tollgate serve exited with {code} after SIGTERM:\n{log_text(log_path)}"
    finally:
        channel.close()
        if server.poll() is None:
            server.kill()
            server.wait()
