"""The shared Kafka/registry security settings: validation, and the same meaning for librdkafka and for Java."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from pgcdc_common.security import KafkaSecurity, RegistrySecurity


def test_plaintext_by_default_adds_only_the_protocol() -> None:
    assert KafkaSecurity().librdkafka() == {"security.protocol": "PLAINTEXT"}
    assert KafkaSecurity().java() == {"security.protocol": "PLAINTEXT"}


def test_sasl_ssl_translates_for_both_clients(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    sec = KafkaSecurity(
        security_protocol="sasl_ssl",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="cdc",
        sasl_password='p"w\\1',  # type: ignore[arg-type]  # pydantic turns it into a SecretStr
        ssl_ca_location=ca,
    )
    assert sec.librdkafka() == {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "cdc",
        "sasl.password": 'p"w\\1',
        "ssl.ca.location": str(ca),
        "ssl.endpoint.identification.algorithm": "https",
    }
    java = sec.java()
    assert java["security.protocol"] == "SASL_SSL"
    assert java["ssl.truststore.type"] == "PEM"
    assert java["ssl.truststore.location"] == str(ca)
    # The quote and the backslash are escaped: the password cannot end JAAS's quoted string early.
    assert java["sasl.jaas.config"] == (
        'org.apache.kafka.common.security.scram.ScramLoginModule required username="cdc" password="p\\"w\\\\1";'
    )
    assert 'p"w' not in repr(sec)  # the secret is not in the model's repr


def test_no_hostname_check_when_asked() -> None:
    sec = KafkaSecurity(security_protocol="ssl", ssl_check_hostname=False)
    assert sec.librdkafka()["ssl.endpoint.identification.algorithm"] == "none"
    assert sec.java()["ssl.endpoint.identification.algorithm"] == ""


def test_password_from_a_file(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("from-file\nignored\n")
    sec = KafkaSecurity(
        security_protocol="sasl_ssl", sasl_mechanism="PLAIN", sasl_username="u", sasl_password_file=secret
    )
    assert sec.librdkafka()["sasl.password"] == "from-file"
    assert 'password="from-file"' in sec.java()["sasl.jaas.config"]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"security_protocol": "sasl_ssl"}, "needs sasl_mechanism, sasl_username, sasl_password"),
        ({"security_protocol": "sasl_ssl", "sasl_mechanism": "PLAIN", "sasl_username": "u"}, "sasl_password"),
        ({"sasl_username": "u"}, "set security_protocol = 'sasl_ssl'"),
        ({"ssl_ca_location": "/etc/hosts"}, "uses no TLS"),
        ({"security_protocol": "ssl", "ssl_ca_location": "/no/such/ca.pem"}, "is not a readable file"),
        (
            {"security_protocol": "sasl_ssl", "sasl_mechanism": "PLAIN", "sasl_username": "u",
             "sasl_password_file": "/no/such/file"},
            "cannot be read",
        ),
        ({"security_protocol": "tls"}, "literal_error"),
    ],
)  # fmt: skip
def test_inconsistent_settings_are_refused(settings: dict[str, str], message: str) -> None:
    with pytest.raises(ValidationError) as err:
        KafkaSecurity(**settings)  # type: ignore[arg-type]
    text = str(err.value) + " ".join(e["type"] for e in err.value.errors())
    assert message in text


def test_empty_secret_file_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("")
    with pytest.raises(ValidationError, match="is empty"):
        RegistrySecurity(basic_auth_user_info_file=empty)


def test_registry_credentials_and_trust(tmp_path: Path) -> None:
    user_info, ca = tmp_path / "ui", tmp_path / "ca.pem"
    user_info.write_text("u:p\n")
    ca.write_text("x")
    conf = RegistrySecurity(basic_auth_user_info_file=user_info, ssl_ca_location=ca).security_conf()
    assert conf == {"basic.auth.user.info": "u:p", "ssl.ca.location": str(ca)}
    assert RegistrySecurity(basic_auth_user_info="a:b").security_conf() == {"basic.auth.user.info": "a:b"}  # type: ignore[arg-type]


def test_registry_user_info_must_be_user_colon_password_and_set_once(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="must be 'user:password'") as err:
        RegistrySecurity(basic_auth_user_info="no-colon-secret")  # type: ignore[arg-type]
    # What pgcdc shows of a validation error is each error's message (cdc/_config._explain), never the input.
    assert all("no-colon-secret" not in e["msg"] for e in err.value.errors())
    user_info = tmp_path / "ui"
    user_info.write_text("u:p\n")
    with pytest.raises(ValidationError, match="not both"):
        RegistrySecurity(basic_auth_user_info="a:b", basic_auth_user_info_file=user_info)  # type: ignore[arg-type]
