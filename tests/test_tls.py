"""Mutual TLS (DESIGN §9): every gRPC port admits only peers with a certificate of the CA, the router's public gRPC and
HTTP ports serve TLS, and greedy output over TLS equals plaintext token for token.

Certificates are made here at run time (``trustme``), in the ``specdec up --tls-dir`` layout
(:class:`launcher.cluster.TlsDir`): one CA, the services' certificate for 127.0.0.1, a client certificate; and the
same from a second, unrelated CA. The stack is ``served_router``'s: a tiny target behind a real verifier, a model
drafter and the router, on loopback.
"""

from __future__ import annotations

import argparse
import json
import ssl
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drafter_service.config import DrafterConfig
from grpc_common.probe import main as probe
from grpc_common.tls import PLAINTEXT, TlsConfig
from launcher.cli import deployment_from, register
from launcher.cluster import TlsDir, health
from router.config import RouterConfig
from router.server import RunningRouter, start_router
from specdec.cli import main as specdec_main
from specdec.client import Client, TlsFiles, Unavailable
from specdec.errors import InvalidArgumentError
from specdec.models import LoadedModel
from tests.test_router_distribution import served_router
from tests.test_router_http import request
from tests.tiny_models import tiny_draft, tiny_llama
from verifier_service.config import VerifierConfig
from verifier_service.server import start_verifier

PROMPTS = ([1, 2, 3], [4, 4, 5, 6, 1])
MAX_TOKENS = 20


def write_tls_dir(path: Path, ca: trustme.CA, *server_names: str) -> TlsDir:
    """``path`` laid out as ``--tls-dir``: ``ca``'s certificate, a service certificate for ``server_names`` and a
    client certificate, both issued by ``ca``."""
    path.mkdir(parents=True, exist_ok=True)
    ca.cert_pem.write_to_path(str(path / TlsDir.CA))
    for leaf, cert, key in (
        (ca.issue_cert(*server_names), TlsDir.CERT, TlsDir.KEY),
        (ca.issue_cert("specdec-test-client"), TlsDir.CLIENT_CERT, TlsDir.CLIENT_KEY),
    ):
        leaf.private_key_pem.write_to_path(str(path / key))
        for index, blob in enumerate(leaf.cert_chain_pems):
            blob.write_to_path(str(path / cert), append=index > 0)
    layout = TlsDir(path)
    layout.check()
    return layout


def service_tls(layout: TlsDir) -> TlsConfig:
    return TlsConfig(
        cert=str(layout.path / layout.CERT), key=str(layout.path / layout.KEY), ca=str(layout.path / layout.CA)
    )


@pytest.fixture(scope="module")
def ours(tmp_path_factory: pytest.TempPathFactory) -> TlsDir:
    return write_tls_dir(tmp_path_factory.mktemp("tls-ours"), trustme.CA(), "127.0.0.1", "localhost")


@pytest.fixture(scope="module")
def theirs(tmp_path_factory: pytest.TempPathFactory) -> TlsDir:
    """Another CA's files: certificates that look just as valid but chain to nothing ours trusts."""
    return write_tls_dir(tmp_path_factory.mktemp("tls-theirs"), trustme.CA(), "127.0.0.1", "localhost")


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return tiny_llama(seed=31, vocab_size=16, num_layers=2)


def drafter_config(target: LoadedModel) -> tuple[DrafterConfig, LoadedModel]:
    draft = tiny_draft(target, seed=32, num_layers=1, noise=0.05)
    return DrafterConfig(kind="model", draft_model=draft.name), draft


@pytest.fixture(scope="module")
def tls_router(target: LoadedModel, ours: TlsDir) -> Iterator[RunningRouter]:
    config, draft = drafter_config(target)
    with served_router(target, config, tls=service_tls(ours), draft=draft) as router:
        yield router


def greedy(address: str, tls: TlsFiles | bool, speculation: str) -> list[list[int]]:
    with Client(address, timeout_s=60, tls=tls) as client:
        results = [
            client.generate(
                prompt_ids=list(prompt),
                max_tokens=MAX_TOKENS,
                temperature=0,
                ignore_eos=True,
                drafter="model",
                speculation=speculation,
            )
            for prompt in PROMPTS
        ]
    for result in results:  # the drafter was reached over TLS, not dropped for target-only decoding
        assert result.stats.draft_tokens > 0 and not result.stats.drafter_fallback
    return [result.token_ids for result in results]


def client_files(layout: TlsDir, trusted: TlsDir) -> TlsFiles:
    """``layout``'s client certificate, trusting ``trusted``'s CA."""
    return TlsFiles(
        ca=trusted.path / trusted.CA, cert=layout.path / layout.CLIENT_CERT, key=layout.path / layout.CLIENT_KEY
    )


def test_greedy_output_over_mutual_tls_equals_plaintext(
    tls_router: RunningRouter, target: LoadedModel, ours: TlsDir
) -> None:
    config, draft = drafter_config(target)
    with served_router(target, config, draft=draft) as plain:
        expected = {mode: greedy(plain.grpc_address, False, mode) for mode in ("sequential", "pipelined")}
    for mode, outputs in expected.items():
        assert greedy(tls_router.grpc_address, client_files(ours, ours), mode) == outputs, mode


# What a client presents, given our CA to check the server with: nothing (plaintext), TLS without a client
# certificate, or a client certificate from the other CA.
REFUSED = ("plaintext", "no-certificate", "other-ca")


def refused_client(case: str, ours: TlsDir, theirs: TlsDir) -> TlsFiles | None:
    if case == "plaintext":
        return None
    if case == "no-certificate":
        return TlsFiles(ca=ours.path / ours.CA)
    return client_files(theirs, ours)


def health_check(address: str, files: TlsFiles | None) -> int:
    opened = grpc.insecure_channel(address) if files is None else grpc.secure_channel(address, files.credentials())
    with opened:
        return health_pb2_grpc.HealthStub(opened).Check(health_pb2.HealthCheckRequest(), timeout=5).status


@pytest.mark.parametrize("port", ["verifier", "drafter", "router"])
def test_grpc_ports_admit_only_certificates_of_the_ca(
    tls_router: RunningRouter, ours: TlsDir, theirs: TlsDir, port: str
) -> None:
    config = tls_router.config
    address = {"verifier": config.verifiers[0], "drafter": config.drafters[0], "router": tls_router.grpc_address}
    assert health_check(address[port], client_files(ours, ours)) == health_pb2.HealthCheckResponse.SERVING
    for case in REFUSED:
        with pytest.raises(grpc.RpcError) as refused:
            health_check(address[port], refused_client(case, ours, theirs))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, case


def test_the_sdk_without_the_right_client_certificate_is_refused(
    tls_router: RunningRouter, ours: TlsDir, theirs: TlsDir
) -> None:
    for files in (TlsFiles(ca=ours.path / ours.CA), client_files(theirs, ours)):
        with Client(tls_router.grpc_address, timeout_s=5, tls=files) as client, pytest.raises(Unavailable):
            client.generate(prompt_ids=[1, 2], max_tokens=2)


def https(layout: TlsDir | None, trusted: TlsDir) -> ssl.SSLContext:
    """A client context trusting ``trusted``'s CA and presenting ``layout``'s client certificate (None: none)."""
    context = ssl.create_default_context(cafile=str(trusted.path / trusted.CA))
    if layout is not None:
        context.load_cert_chain(str(layout.path / layout.CLIENT_CERT), str(layout.path / layout.CLIENT_KEY))
    return context


def test_the_http_port_serves_tls_to_clients_of_the_ca_only(
    tls_router: RunningRouter, ours: TlsDir, theirs: TlsDir
) -> None:
    address = tls_router.http_address
    status, _, body = request(address, "GET", "/health", tls=https(ours, ours))
    assert (status, json.loads(body)) == (200, {"status": "ok"})
    completion = {"prompt": list(PROMPTS[0]), "max_tokens": 4, "temperature": 0}
    status, _, body = request(address, "POST", "/v1/completions", completion, tls=https(ours, ours))
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 4
    for client in (None, theirs):
        with pytest.raises((ssl.SSLError, ConnectionError)):
            request(address, "GET", "/health", tls=https(client, ours))
    with pytest.raises(ConnectionError):  # a plaintext request gets no answer from a TLS port
        request(address, "GET", "/health")


@pytest.mark.parametrize("identity", ["plaintext", "other-ca"])
def test_workers_refuse_a_router_without_a_certificate_of_the_ca(
    tls_router: RunningRouter, ours: TlsDir, theirs: TlsDir, identity: str
) -> None:
    """Health checks go over the worker channels: a router the workers refuse never sees one healthy."""
    tls = PLAINTEXT
    if identity == "other-ca":  # the router trusts the workers' CA; the workers do not trust the router's
        tls = replace(service_tls(theirs), ca=str(ours.path / ours.CA))
    router = start_router(replace(tls_router.config, tls=tls))
    try:
        assert [worker.healthy for worker in router.frontend.pool.workers()] == [False, False]
    finally:
        router.stop(0)


def test_public_ports_without_client_certificates(tls_router: RunningRouter, ours: TlsDir) -> None:
    """``--no-tls-public-client-auth``: the public ports serve TLS to anyone trusting the CA (a bearer token is then
    what authenticates clients); the worker channels stay mutual TLS (the router still reaches its workers)."""
    router = start_router(replace(tls_router.config, tls_public_client_auth=False))
    try:
        with Client(router.grpc_address, timeout_s=60, tls=TlsFiles(ca=ours.path / ours.CA)) as client:
            result = client.generate(prompt_ids=list(PROMPTS[0]), max_tokens=4, temperature=0, drafter="model")
        assert len(result.token_ids) == 4 and not result.stats.drafter_fallback
        status, _, _ = request(router.http_address, "GET", "/health", tls=https(None, ours))
        assert status == 200
    finally:
        router.stop(0)


def test_server_name_checks_worker_certificates_against_one_name(
    target: LoadedModel, tmp_path: Path, tls_router: RunningRouter
) -> None:
    """Workers at addresses not in their certificate (pods): ``--tls-server-name`` names what the router checks."""
    named = service_tls(write_tls_dir(tmp_path, trustme.CA(), "verifier.specdec.internal"))
    verifier = start_verifier(VerifierConfig(tls=named), model=target)
    try:
        config = replace(tls_router.config, verifiers=(verifier.address,), drafters=(), tls=named)
        for server_name, healthy in ((None, False), ("verifier.specdec.internal", True)):
            router = start_router(replace(config, tls=replace(named, server_name=server_name)))
            try:
                assert [worker.healthy for worker in router.frontend.pool.workers()] == [healthy], server_name
            finally:
                router.stop(0)
    finally:
        verifier.stop(0)


def test_specdec_status_and_the_probe_check_health_over_tls(
    tls_router: RunningRouter, ours: TlsDir, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tls_router.config
    files = ["--tls-cert", str(ours.path / ours.CLIENT_CERT), "--tls-key", str(ours.path / ours.CLIENT_KEY)]
    files += ["--tls-ca", str(ours.path / ours.CA)]
    for address in (tls_router.grpc_address, *config.verifiers, *config.drafters):
        assert health(address, str(ours.path)) == "SERVING"
        assert health(address) == "UNREACHABLE"  # plaintext
        assert (probe([address, *files]), capsys.readouterr().out) == (0, "SERVING\n")
        assert (probe([address, "--timeout-s", "1"]), capsys.readouterr().out) == (1, "UNREACHABLE\n")


def test_every_service_takes_the_same_flags_and_env(ours: TlsDir) -> None:
    expected = service_tls(ours)
    flags = ours.service_arguments()  # what `specdec up --tls-dir` passes
    router_flags = ["--model", "m", "--verifier", "127.0.0.1:1", *flags]
    assert VerifierConfig.from_args(flags, environ={}).tls == expected
    assert DrafterConfig.from_args(["--kind", "ngram", *flags], environ={}).tls == expected
    assert RouterConfig.from_args(router_flags, environ={}).tls == expected
    for prefix, make in (
        ("SPECDEC_VERIFIER_", lambda env: VerifierConfig.from_args([], environ=env)),
        ("SPECDEC_DRAFTER_", lambda env: DrafterConfig.from_args(["--kind", "ngram"], environ=env)),
        ("SPECDEC_ROUTER_", lambda env: RouterConfig.from_args(["--model", "m", "--verifier", "a:1"], environ=env)),
    ):
        environ = {f"{prefix}TLS_CERT": expected.cert, f"{prefix}TLS_KEY": expected.key, f"{prefix}TLS_CA": expected.ca}
        assert make(environ).tls == expected, prefix
    router_env = {"SPECDEC_ROUTER_TLS_SERVER_NAME": "w", "SPECDEC_ROUTER_TLS_PUBLIC_CLIENT_AUTH": "0"}
    routed = RouterConfig.from_args(router_flags, environ=router_env)
    assert (routed.tls.server_name, routed.tls_public_client_auth) == ("w", False)
    assert VerifierConfig().tls == PLAINTEXT and not PLAINTEXT.enabled


def test_incomplete_or_bad_tls_files_are_refused_naming_the_flag(ours: TlsDir, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"^tls_ca: "):
        VerifierConfig.from_args(ours.service_arguments()[:4], environ={})
    with pytest.raises(InvalidArgumentError, match=r"^tls_key: no such file"):
        replace(service_tls(ours), key=str(tmp_path / "absent.pem"))
    with pytest.raises(InvalidArgumentError, match=r"^tls_server_name: "):
        TlsConfig(server_name="w")
    (tmp_path / "garbage.pem").write_text("not a certificate")
    with pytest.raises(InvalidArgumentError, match=r"^tls_cert: .* is not a PEM certificate chain"):
        replace(service_tls(ours), cert=str(tmp_path / "garbage.pem"))
    with pytest.raises(InvalidArgumentError, match=r"^tls_cert: "):  # a key that is not the certificate's
        replace(service_tls(ours), key=str(ours.path / ours.CLIENT_KEY))
    with pytest.raises(InvalidArgumentError, match=r"^tls_ca: .* is not a PEM CA bundle"):
        replace(service_tls(ours), ca=str(tmp_path / "garbage.pem"))


def test_up_tls_dir_is_checked_before_anything_starts(ours: TlsDir, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    deployment = deployment_from(parser.parse_args(["up", "--tls-dir", str(ours.path)]))
    assert deployment.tls_dir == str(ours.path.resolve())
    (tmp_path / TlsDir.CA).write_text("")
    with pytest.raises(FileNotFoundError, match=r"missing server\.pem, server-key\.pem, client\.pem, client-key\.pem$"):
        deployment_from(parser.parse_args(["up", "--tls-dir", str(tmp_path)]))


def test_specdec_generate_takes_the_client_files(
    tls_router: RunningRouter, ours: TlsDir, capsys: pytest.CaptureFixture[str]
) -> None:
    """``specdec generate --router``: with the client files the request reaches the router, which refuses a text
    prompt by name (the tiny target has no tokenizer); with the CA alone the handshake fails."""
    address, ca = tls_router.grpc_address, str(ours.path / ours.CA)
    client = ["--tls-cert", str(ours.path / ours.CLIENT_CERT), "--tls-key", str(ours.path / ours.CLIENT_KEY)]
    assert specdec_main(["generate", "Hi", "--router", address, "--tls-ca", ca, *client]) == 2
    assert "this router has no tokenizer; send prompt_ids" in capsys.readouterr().err
    assert specdec_main(["generate", "Hi", "--router", address, "--tls-ca", ca, "--timeout", "5"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err
