"""Which listeners count as loopback, and when serving without auth is refused."""

from __future__ import annotations

import dataclasses

import pytest

from service.api.transport_security import ExposureError, check_exposure, is_loopback, server_credentials
from service.config import Config


@pytest.mark.parametrize("listen,loopback", [
    ("127.0.0.1:50051", True), ("127.9.9.9:1", True), ("localhost:50051", True), ("[::1]:50051", True),
    ("0.0.0.0:50051", False), ("[::]:50051", False), ("10.0.0.5:50051", False), ("retrieval.internal:1", False),
    (":50051", False),
])
def test_loopback(listen: str, loopback: bool) -> None:
    assert is_loopback(listen) is loopback


def test_exposure_rules() -> None:
    cfg = Config()
    assert "auth OFF: listening on loopback" in check_exposure(cfg, "127.0.0.1:1")
    with pytest.raises(ExposureError, match="--insecure-open"):
        check_exposure(cfg, "0.0.0.0:1")
    assert "insecure_open" in check_exposure(dataclasses.replace(cfg, insecure_open=True), "0.0.0.0:1")
    assert "auth on (API keys)" in check_exposure(dataclasses.replace(cfg, api_keys_file="k.toml"), "0.0.0.0:1")
    assert "client certificates" in check_exposure(dataclasses.replace(cfg, tls_client_ca_file="ca.pem"), "0.0.0.0:1")


def test_tls_settings_must_be_complete() -> None:
    assert server_credentials(Config()) is None
    with pytest.raises(ValueError, match="both"):
        server_credentials(Config(tls_cert_file="server.pem"))
    with pytest.raises(ValueError, match="needs tls_cert_file"):
        server_credentials(Config(tls_client_ca_file="ca.pem"))
