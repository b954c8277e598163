"""Transport security: TLS server credentials from configuration, and the rule that auth is
required whenever the server listens beyond loopback.

- ``tls_cert_file`` + ``tls_key_file``: serve TLS instead of plaintext.
- ``tls_client_ca_file`` too: mutual TLS; every client must present a certificate signed by
  that CA, and its subject can name the principal (``client_subject`` in the keys file, or
  the certificate's common name when there is no keys file).
- Listening on a non-loopback address with no auth (no keys file, no client CA) refuses to
  start unless ``insecure_open`` says so explicitly.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

import grpc

from service.config import Config

LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}


class ExposureError(ValueError):
    """The configuration would serve the network without auth."""


def listen_host(listen: str) -> str:
    host = listen.rsplit(":", 1)[0] if ":" in listen else listen
    return host.strip("[]")


def is_loopback(listen: str) -> bool:
    host = listen_host(listen).lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "", "0.0.0.0" parse; hostnames other than localhost are not loopback


def auth_enabled(cfg: Config) -> bool:
    return bool(cfg.api_keys_file or cfg.tls_client_ca_file)


def check_exposure(cfg: Config, listen: str) -> str:
    """Raise ExposureError for an unauthenticated non-loopback listener; else the line to log
    at start about who may call."""
    tls = "TLS" if cfg.tls_cert_file else "plaintext"
    if auth_enabled(cfg):
        how = " + ".join(n for n, on in (("API keys", cfg.api_keys_file), ("client certificates", cfg.tls_client_ca_file)) if on)
        return f"auth on ({how}), {tls}, listening on {listen}"
    if is_loopback(listen):
        return (f"auth OFF: listening on loopback {listen} only, {tls}; every caller is anonymous and sees "
                "public documents only (set api_keys_file or tls_client_ca_file before listening beyond loopback)")
    if cfg.insecure_open:
        return (f"auth OFF on non-loopback {listen} ({tls}) because insecure_open is set: anyone who can reach "
                "this address may call")
    raise ExposureError(
        f"refusing to listen on {listen} without auth: it is not a loopback address. Give an API keys file "
        "(--api-keys) or a client CA (--tls-client-ca), listen on 127.0.0.1, or pass --insecure-open to serve "
        "it open on purpose")


def server_credentials(cfg: Config) -> grpc.ServerCredentials | None:
    """TLS credentials when a certificate is configured, else None (plaintext)."""
    if not cfg.tls_cert_file and not cfg.tls_key_file:
        if cfg.tls_client_ca_file:
            raise ValueError("tls_client_ca_file needs tls_cert_file and tls_key_file")
        return None
    if not (cfg.tls_cert_file and cfg.tls_key_file):
        raise ValueError("TLS needs both tls_cert_file and tls_key_file")
    key = Path(cfg.tls_key_file).expanduser().read_bytes()
    cert = Path(cfg.tls_cert_file).expanduser().read_bytes()
    ca = Path(cfg.tls_client_ca_file).expanduser().read_bytes() if cfg.tls_client_ca_file else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)
