"""TLS for the clients: the same options as the CLI's --tls-ca/--tls-cert/--tls-key/--tls-server-name.

    client = RetrievalClient("retrieval.internal:50051", api_key=key,
                             tls=TlsOptions(ca_file="ca.pem"))
    # mutual TLS: the certificate's subject can name the principal on the server
    client = RetrievalClient(target, tls=TlsOptions(ca_file="ca.pem", cert_file="me.pem", key_file="me.key"))
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TlsOptions:
    ca_file: str = ""  # CA to verify the server with; empty: the system roots
    cert_file: str = ""  # client certificate chain (mutual TLS)
    key_file: str = ""  # its private key
    server_name: str = ""  # verify the server certificate against this name instead of the target's host

    def credentials(self) -> grpc.ChannelCredentials:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("TlsOptions: cert_file and key_file go together")

        def read(path: str) -> bytes | None:
            return Path(path).expanduser().read_bytes() if path else None

        return grpc.ssl_channel_credentials(root_certificates=read(self.ca_file), private_key=read(self.key_file),
                                            certificate_chain=read(self.cert_file))

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def aio_channel(target: str, tls: TlsOptions | None) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(target)
    return grpc.aio.secure_channel(target, tls.credentials(), options=tls.options())


def sync_channel(target: str, tls: TlsOptions | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(target)
    return grpc.secure_channel(target, tls.credentials(), options=tls.options())
