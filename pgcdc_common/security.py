"""How the capture and the sinks reach a secured Kafka and schema registry.

The keys live in the shared ``[kafka]`` and ``[registry]`` sections of the one configuration file, which both
the capture (cdc/_config.py) and the sinks (sinks/_config.py) read. One model and its translations live here,
in the contract both sides already share, so a setting cannot mean one thing to the capture and another to the
sinks: librdkafka's names for the capture and for every confluent-kafka client the sinks open (lag probe,
dead-letter topic), the Java client's names for Spark's Kafka source and sink.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr, model_validator

_SASL = ("sasl_plaintext", "sasl_ssl")
_TLS = ("ssl", "sasl_ssl")
_JAAS_MODULES = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}


def read_secret_file(path: Path, key: str) -> str:
    """The first line of a secret file; ValueError (no secret in it) when it cannot be read."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"{key} {str(path)!r} cannot be read: {exc.strerror or exc}") from exc
    if not lines or not lines[0]:
        raise ValueError(f"{key} {str(path)!r} is empty; its first line must be the secret")
    return lines[0]


def _check_file(path: Path | None, key: str) -> None:
    if path is not None and not path.is_file():
        raise ValueError(f"{key} {str(path)!r} is not a readable file; give the path of a PEM file")


class KafkaSecurity(BaseModel):
    """TLS and SASL to the brokers. Plaintext by default; secrets may come from the environment or a file."""

    security_protocol: Literal["plaintext", "ssl", "sasl_plaintext", "sasl_ssl"] = "plaintext"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = Field(default=None, description="or CDC_KAFKA__SASL_PASSWORD")
    sasl_password_file: Path | None = Field(default=None, description="file whose first line is the password")
    ssl_ca_location: Path | None = Field(default=None, description="PEM file of the CAs to trust; default: system's")
    ssl_check_hostname: bool = Field(default=True, description="verify that the broker's certificate names it")

    @model_validator(mode="after")
    def _consistent(self) -> KafkaSecurity:
        names = ("sasl_mechanism", "sasl_username", "sasl_password", "sasl_password_file")
        sasl_keys = [k for k in names if getattr(self, k) is not None]
        if self.security_protocol in _SASL:
            missing = [k for k in ("sasl_mechanism", "sasl_username") if getattr(self, k) is None]
            if self.sasl_password is None and self.sasl_password_file is None:
                missing.append("sasl_password (or sasl_password_file)")
            if missing:
                raise ValueError(f"security_protocol = {self.security_protocol!r} needs {', '.join(missing)}")
        elif sasl_keys:
            raise ValueError(
                f"{', '.join(sasl_keys)} set but security_protocol = {self.security_protocol!r}; "
                "set security_protocol = 'sasl_ssl' to authenticate"
            )
        if self.security_protocol not in _TLS and self.ssl_ca_location is not None:
            raise ValueError("ssl_ca_location is set but security_protocol uses no TLS; choose 'ssl' or 'sasl_ssl'")
        _check_file(self.ssl_ca_location, "ssl_ca_location")
        if self.sasl_password_file is not None:
            read_secret_file(self.sasl_password_file, "sasl_password_file")  # fail at start, not mid-run
        return self

    def _password(self) -> str:
        if self.sasl_password is not None:
            return self.sasl_password.get_secret_value()
        assert self.sasl_password_file is not None  # the validator guarantees one of them
        return read_secret_file(self.sasl_password_file, "kafka.sasl_password_file")

    def librdkafka(self) -> dict[str, Any]:
        """Settings for confluent-kafka (librdkafka) clients. Holds the password: never log it."""
        conf: dict[str, Any] = {"security.protocol": self.security_protocol.upper()}
        if self.security_protocol in _SASL:
            conf["sasl.mechanism"] = self.sasl_mechanism
            conf["sasl.username"] = self.sasl_username
            conf["sasl.password"] = self._password()
        if self.security_protocol in _TLS:
            if self.ssl_ca_location is not None:
                conf["ssl.ca.location"] = str(self.ssl_ca_location)
            conf["ssl.endpoint.identification.algorithm"] = "https" if self.ssl_check_hostname else "none"
        return conf

    def java(self) -> dict[str, str]:
        """The same settings for the Java client (Spark's Kafka source and sink), without the ``kafka.`` prefix."""
        conf = {"security.protocol": self.security_protocol.upper()}
        if self.security_protocol in _SASL:
            assert self.sasl_mechanism is not None
            assert self.sasl_username is not None
            conf["sasl.mechanism"] = self.sasl_mechanism
            conf["sasl.jaas.config"] = (
                f"{_JAAS_MODULES[self.sasl_mechanism]} required "
                f'username="{_jaas_quote(self.sasl_username)}" password="{_jaas_quote(self._password())}";'
            )
        if self.security_protocol in _TLS:
            if self.ssl_ca_location is not None:
                # Java reads PEM trust stores directly since Kafka 2.7 (KIP-651): the same file serves both.
                conf["ssl.truststore.type"] = "PEM"
                conf["ssl.truststore.location"] = str(self.ssl_ca_location)
            conf["ssl.endpoint.identification.algorithm"] = "https" if self.ssl_check_hostname else ""
        return conf


def _jaas_quote(value: str) -> str:
    # JAAS quoted strings take backslash escapes; a quote in a password must not end the string.
    return value.replace("\\", "\\\\").replace('"', '\\"')


class RegistrySecurity(BaseModel):
    """HTTPS and basic authentication to the schema registry."""

    basic_auth_user_info: SecretStr | None = Field(default=None, description="'user:password'")
    basic_auth_user_info_file: Path | None = Field(default=None, description="file whose first line is user:password")
    ssl_ca_location: Path | None = Field(default=None, description="PEM file of the CAs to trust for an https url")

    @model_validator(mode="after")
    def _files(self) -> RegistrySecurity:
        _check_file(self.ssl_ca_location, "ssl_ca_location")
        if self.basic_auth_user_info is not None and self.basic_auth_user_info_file is not None:
            raise ValueError("set basic_auth_user_info or basic_auth_user_info_file, not both")
        user_info = None
        if self.basic_auth_user_info is not None:
            user_info = self.basic_auth_user_info.get_secret_value()
        elif self.basic_auth_user_info_file is not None:
            user_info = read_secret_file(self.basic_auth_user_info_file, "basic_auth_user_info_file")
        if user_info is not None and ":" not in user_info:
            # The registry client would fail later with a traceback; the value itself is never echoed.
            raise ValueError("basic_auth_user_info must be 'user:password' (no ':' found)")
        return self

    def security_conf(self) -> dict[str, Any]:
        """SchemaRegistryClient settings for credentials and trust. Holds the credentials: never log them."""
        conf: dict[str, Any] = {}
        user_info = None
        if self.basic_auth_user_info is not None:
            user_info = self.basic_auth_user_info.get_secret_value()
        elif self.basic_auth_user_info_file is not None:
            user_info = read_secret_file(self.basic_auth_user_info_file, "registry.basic_auth_user_info_file")
        if user_info is not None:
            conf["basic.auth.user.info"] = user_info
        if self.ssl_ca_location is not None:
            conf["ssl.ca.location"] = str(self.ssl_ca_location)
        return conf
