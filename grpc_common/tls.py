"""Mutual TLS for every service: one definition of the flags, and the credentials of servers and channels.

A service given ``--tls-cert``, ``--tls-key`` and ``--tls-ca`` (env ``<PREFIX>TLS_CERT`` / ``TLS_KEY`` / ``TLS_CA``,
the prefix being the service's: ``SPECDEC_VERIFIER_``, ``SPECDEC_DRAFTER_``, ``SPECDEC_ROUTER_``) serves every gRPC
port with that certificate and admits only peers that present a certificate chained to the CA: a client without
one, or with one from another CA, fails the handshake before any call. The router also presents the same
certificate when it dials workers and checks theirs against the CA, so one certificate per service serves both
directions: it needs no extended key usage, or both TLS server and TLS client auth. The names in a worker's
certificate must cover the address the router dials, or the router's ``--tls-server-name`` (one name that every
worker certificate carries, for workers at changing addresses such as pods). Without the three flags everything
is plaintext. Prometheus metrics ports stay plain HTTP (they carry no request data); the router's ``/metrics`` is
on its HTTP port and so behind TLS with it.
"""

from __future__ import annotations

import argparse
import ssl
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio

from specdec.client import TlsFiles
from specdec.errors import InvalidArgumentError

FILES = ("cert", "key", "ca")


@dataclass(frozen=True)
class TlsConfig:
    """PEM paths of a service's identity (``cert`` chain and its ``key``) and of the ``ca`` its peers must chain to;
    all None: plaintext. ``server_name``: the name dialled servers' certificates are checked against (None: the host
    dialled); only services that dial others have the flag."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in FILES if getattr(self, name)]
        if given and len(given) < len(FILES):
            missing = next(name for name in FILES if name not in given)
            raise InvalidArgumentError(f"tls_{missing}", "--tls-cert, --tls-key and --tls-ca are given together")
        for name in given:
            if not Path(getattr(self, name)).is_file():
                raise InvalidArgumentError(f"tls_{name}", f"no such file: {getattr(self, name)}")
        if given:
            self._check_pem()
        if self.server_name and not given:
            raise InvalidArgumentError("tls_server_name", "needs --tls-cert, --tls-key and --tls-ca")

    def _check_pem(self) -> None:
        """Load the files once with :mod:`ssl`, so that a bad one is a message naming its flag at start-up rather
        than gRPC's "failed to bind" when the port is added."""
        try:  # a password callback, so that an encrypted key (which gRPC cannot use) fails instead of prompting
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.cert, self.key, password=str)
        except ssl.SSLError as error:
            message = f"{self.cert} with key {self.key} is not a PEM certificate chain and its unencrypted key"
            raise InvalidArgumentError("tls_cert", f"{message} ({error})") from None
        try:
            ssl.create_default_context(cafile=self.ca)
        except ssl.SSLError as error:
            raise InvalidArgumentError("tls_ca", f"{self.ca} is not a PEM CA bundle ({error})") from None

    @property
    def enabled(self) -> bool:
        return self.cert is not None

    def server_credentials(self, *, require_client_auth: bool = True) -> grpc.ServerCredentials:
        """Credentials serving ``cert``; with ``require_client_auth`` a client must present a certificate of ``ca``."""
        assert self.cert is not None and self.key is not None and self.ca is not None
        return grpc.ssl_server_credentials(
            [(Path(self.key).read_bytes(), Path(self.cert).read_bytes())],
            root_certificates=Path(self.ca).read_bytes(),
            require_client_auth=require_client_auth,
        )

    def http_context(self, *, require_client_auth: bool = True) -> ssl.SSLContext:
        """The same for an HTTP server (aiohttp): TLS 1.2 or later, ``cert`` served, clients checked against ``ca``."""
        assert self.cert is not None and self.key is not None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.ca)
        context.load_cert_chain(self.cert, self.key)
        context.verify_mode = ssl.CERT_REQUIRED if require_client_auth else ssl.CERT_NONE
        return context

    def client_files(self) -> TlsFiles:
        """What this service presents and trusts when it dials another (the SDK's type: one way to make a channel)."""
        return TlsFiles(ca=self.ca, cert=self.cert, key=self.key, server_name=self.server_name)


PLAINTEXT = TlsConfig()


def aio_channel(address: str, tls: TlsConfig, options: Sequence[tuple[str, str | int]] = ()) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to ``address``: mutual TLS with ``tls`` when it is enabled, else plaintext."""
    if not tls.enabled:
        return grpc.aio.insecure_channel(address, options=list(options))
    files = tls.client_files()
    return grpc.aio.secure_channel(address, files.credentials(), [*options, *files.channel_options()])


def channel(address: str, tls: TlsConfig) -> grpc.Channel:
    """A blocking channel to ``address`` (health probes, tools), mutual TLS with ``tls`` when enabled."""
    if not tls.enabled:
        return grpc.insecure_channel(address)
    files = tls.client_files()
    return grpc.secure_channel(address, files.credentials(), files.channel_options())


def add_tls_arguments(
    parser: argparse.ArgumentParser, env_prefix: str, environ: Mapping[str, str], *, dials: bool = False
) -> None:
    """``--tls-cert``, ``--tls-key``, ``--tls-ca`` (and ``--tls-server-name`` for a service that ``dials`` others),
    each defaulting to ``<env_prefix>TLS_<NAME>``; read them back with :func:`tls_from_args`."""
    helps = {
        "cert": "PEM certificate chain this service presents (server and client side)",
        "key": "PEM private key of --tls-cert",
        "ca": "PEM CA bundle every peer's certificate must chain to; with all three, every gRPC port is mutual TLS",
    }
    if dials:
        helps["server_name"] = "name the dialled workers' certificates must carry (default: the dialled host)"
    for name, help_text in helps.items():
        env_name = f"{env_prefix}TLS_{name.upper()}"
        parser.add_argument(
            "--tls-" + name.replace("_", "-"),
            dest=f"tls_{name}",
            default=environ.get(env_name) or None,
            help=f"{help_text} (env {env_name})",
        )


def tls_from_args(values: MutableMapping[str, object]) -> TlsConfig:
    """Take the values :func:`add_tls_arguments` added out of parsed ``values`` (``vars(namespace)``)."""

    def take(name: str) -> str | None:
        value = values.pop(f"tls_{name}", None)
        return str(value) if value else None

    return TlsConfig(cert=take("cert"), key=take("key"), ca=take("ca"), server_name=take("server_name"))
