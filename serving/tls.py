"""TLS and mutual-TLS credentials for servers and channels, from PEM files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TLSFiles:
    """PEM paths: this process's certificate and key, and the CA that peers' certificates must chain to.

    With ``client_auth`` a server requires client certificates signed by the CA (mutual TLS); a client
    with a certificate presents it.
    """

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    client_auth: bool = False

    @property
    def enabled(self) -> bool:
        """True when any TLS file is configured."""
        return bool(self.cert or self.key or self.ca)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server credentials; raises ValueError when the certificate or key is missing."""
        if not (self.cert and self.key):
            raise ValueError("a TLS server needs both --tls-cert and --tls-key")
        if self.client_auth and not self.ca:
            raise ValueError("--tls-client-auth needs --tls-ca (the CA client certificates must chain to)")
        return grpc.ssl_server_credentials(
            [(Path(self.key).read_bytes(), Path(self.cert).read_bytes())],
            root_certificates=Path(self.ca).read_bytes() if self.client_auth else None,
            require_client_auth=self.client_auth,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Channel credentials trusting the CA and presenting the client certificate when configured."""
        return grpc.ssl_channel_credentials(
            root_certificates=Path(self.ca).read_bytes() if self.ca else None,
            private_key=Path(self.key).read_bytes() if self.key else None,
            certificate_chain=Path(self.cert).read_bytes() if self.cert else None,
        )
