"""The connector's ``kv_connector_extra_config`` keys: defaults, the environment, validation, and
that every key is documented where operators read about it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdwire.http_models import url_of
from reference_connector.vllm import config
from reference_connector.vllm.config import ConfigError, Settings

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
ENV = (
    "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT",
    "VLLM_MOONCAKE_CONNECTOR_TIMEOUT",
    "VLLM_MOONCAKE_BOOTSTRAP_PORT",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def test_defaults_are_vllms() -> None:
    s = Settings.from_extra_config({})
    assert (s.protocol, s.device_name, s.profile) == ("rdma", "", "pdwire/2")
    assert (s.abort_timeout, s.receive_timeout, s.deadline) == (480.0, 540.0, 60.0)
    assert (s.bootstrap_address, s.bootstrap_host, s.bootstrap_port) == (None, "0.0.0.0", 8998)
    assert (s.bootstrap_timeout, s.auth_key, s.num_workers) == (30.0, None, 10)


def test_the_environment_sets_vllms_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", "100")
    monkeypatch.setenv("VLLM_MOONCAKE_CONNECTOR_TIMEOUT", "5.5")
    monkeypatch.setenv("VLLM_MOONCAKE_BOOTSTRAP_PORT", "9100")
    s = Settings.from_extra_config({})
    assert (s.abort_timeout, s.receive_timeout) == (100.0, 160.0)
    assert (s.bootstrap_timeout, s.bootstrap_port) == (5.5, 9100)
    s = Settings.from_extra_config({"abort_timeout": 7, "receive_timeout": 9})
    assert (s.abort_timeout, s.receive_timeout) == (7.0, 9.0)


def test_keys_set_the_sessions_and_agents() -> None:
    s = Settings.from_extra_config(
        {
            "mooncake_protocol": "tcp",
            "device_name": "mlx5_0",
            "bootstrap_server_address": "10.0.0.5:8998",
            "profile": "legacy",
            "deadline": 12.5,
            "bootstrap_timeout": 3,
            "num_workers": 2,
        }
    )
    assert (s.protocol, s.device_name, s.profile) == ("tcp", "mlx5_0", "legacy")
    assert s.bootstrap_address == ("10.0.0.5", 8998)
    assert (s.deadline, s.bootstrap_timeout, s.num_workers) == (12.5, 3.0, 2)
    assert config.split_host_port("[::1]:80") == ("::1", 80)
    assert url_of("::1", 80) == "http://[::1]:80"


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        ({"mooncake_protcol": "tcp"}, "mooncake_protcol"),
        ({"profile": "pdwire/3"}, "profile"),
        ({"abort_timeout": 0}, "abort_timeout"),
        ({"deadline": "soon"}, "deadline"),
        ({"num_workers": 0}, "num_workers"),
        ({"bootstrap_server_address": "10.0.0.5"}, "bootstrap_server_address"),
        ({"bootstrap_server_address": "10.0.0.5:99999"}, "bootstrap_server_address"),
        ({"auth_key_file": "/no/such/file"}, "auth_key_file"),
        ({"kv_lease_duration": 0}, "kv_lease_duration must be positive, got 0.0."),
        ({"kv_lease_duration": "long"}, "kv_lease_duration"),
    ],
)
def test_bad_values_name_their_key(extra: dict[str, object], names: str) -> None:
    with pytest.raises(ConfigError, match=names):
        Settings.from_extra_config(extra)


def test_kv_lease_duration_is_read_as_vllm_034_reads_it() -> None:
    assert Settings.from_extra_config({}).lease is None
    assert Settings.from_extra_config({"kv_lease_duration": "12"}).lease == 12.0


def test_auth_key_file(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_bytes(b"s3cret\n")
    assert Settings.from_extra_config({"auth_key_file": str(key)}).auth_key == b"s3cret"
    with pytest.raises(ConfigError, match="pdwire/2"):
        Settings.from_extra_config({"auth_key_file": str(key), "profile": "legacy"})
    key.write_bytes(b"\n")
    with pytest.raises(ConfigError, match="empty"):
        Settings.from_extra_config({"auth_key_file": str(key)})


def test_accepted_key_files(tmp_path: Path) -> None:
    """8.6-R16: older keys accepted while keys are rotated; only beside auth_key_file."""
    key, old = tmp_path / "key", tmp_path / "old"
    key.write_bytes(b"new\n")
    old.write_bytes(b"old\n")
    both = {"auth_key_file": str(key), "accepted_key_files": [str(old)]}
    settings = Settings.from_extra_config(both)
    assert (settings.auth_key, settings.accepted_keys) == (b"new", (b"old",))
    with pytest.raises(ConfigError, match="needs auth_key_file"):
        Settings.from_extra_config({"accepted_key_files": [str(old)]})
    with pytest.raises(ConfigError, match="list of paths"):
        Settings.from_extra_config({**both, "accepted_key_files": str(old)})


def _documented(text: str) -> set[str]:
    return set(re.findall(r"``?([a-z_]+)``?", text)) & config.KEYS


@pytest.mark.parametrize(
    "where",
    [Path("reference_connector/vllm/config.py"), Path("README.md"), Path("docs/vllm-connector.md")],
)
def test_every_key_is_documented(where: Path) -> None:
    text = (ROOT / where).read_text()
    if where.suffix == ".py":
        text = config.__doc__ or ""
    assert _documented(text) == config.KEYS
