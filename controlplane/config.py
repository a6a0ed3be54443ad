"""The control plane's one configuration object, built once by the CLI.

Values come from flags, then the environment, then ``<home>/config.toml``, then
defaults (:class:`shared.config.Sources`). This is the only module of the control
plane that looks at environment values; the CLI passes ``os.environ`` in.

Environment variables: ``AGENTS_CONTROL_HOME``, ``AGENTS_CONTROL_STORE``,
``AGENTS_CONTROL_STORE_ENDPOINT``, ``AGENTS_CONTROL_STORE_REGION``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AGENTS_CONTROL_LISTEN``,
``AGENTS_CONTROL_LINK_LISTEN``, ``AGENTS_CONTROL_ADVERTISE_HOST``,
``AGENTS_CONTROL_METRICS``, ``AGENTS_CONTROL_ADDRESS``,
``AGENTS_CONTROL_CREDENTIAL``, ``AGENTS_CONTROL_CREDENTIAL_FILE``,
``AGENTS_CONTROL_HEARTBEAT``,
``AGENTS_CONTROL_LOG_LEVEL``, ``AGENTS_CONTROL_LOG_FORMAT``,
``AGENTS_CONTROL_JOIN_CONFIRM_GRACE``, ``AGENTS_CONTROL_CLUSTER``; test only:
``AGENTS_CONTROL_TEST_CRASH_IN_MIGRATE_AFTER``; and systemd's
``NOTIFY_SOCKET``, ``WATCHDOG_USEC``, ``WATCHDOG_PID`` (shared.sd_notify).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from shared.config import (
    Sources,
    check_file,
    check_folder,
    load_toml,
    parse_bool,
    split_hostport,
)
from shared.durations import seconds_value
from shared.errors import ConfigError
from shared.logs import check_format, check_level, parse_format, parse_level
from shared.sd_notify import NotifyConfig

__all__ = [
    "CONFIG_FILE",
    "DEFAULT_METRICS_LISTEN",
    "FILE_KEYS",
    "MAX_TOKEN_TTL",
    "SERVE_FILE",
    "ControlConfig",
    "cluster_servers",
    "default_home",
    "load_config",
    "parse_hostport",
    "read_credential",
]

logger = logging.getLogger(__name__)

CONFIG_FILE: Final = "config.toml"
#: Written by ``serve`` once it listens: the actual ports (useful with port 0).
SERVE_FILE: Final = "serve.json"
#: The most of a credential file read: a credential is ~75 characters, and a
#: large file named by mistake must not be read whole.
CREDENTIAL_FILE_LIMIT: Final = 4096
#: A join token lives at most this many seconds (24 hours).
MAX_TOKEN_TTL: Final = 24 * 3600
#: Where ``/metrics`` is served unless told otherwise; deploy/prometheus/prometheus.yml
#: scrapes it and the systemd unit relies on it (the machine's is next to it:
#: ``machine.config.SERVICE_METRICS_ADDRESS``).
DEFAULT_METRICS_LISTEN: Final = "127.0.0.1:9470"


def parse_hostport(value: str, field_name: str, *, allow_empty: bool = False) -> tuple[str, int]:
    """Split ``host:port`` (port 0..65535; ``[v6]:port`` allowed) or raise ConfigError.

    Surrounding spaces are ignored; an empty value gives ``("", 0)`` when
    ``allow_empty`` (a listener that is switched off).
    """
    text = str(value).strip()
    if not text:
        if allow_empty:
            return ("", 0)
        raise ConfigError(field_name, "must be host:port")
    return split_hostport(text, field_name)


def cluster_servers(value: str) -> tuple[str, ...]:
    """The NATS server URLs of ``cluster_url`` (comma-separated), checked: each
    ``nats://host:port`` or ``tls://host:port``; () for an empty value."""
    out: list[str] = []
    for raw in value.split(","):
        url = raw.strip()
        if not url:
            continue
        scheme, sep, rest = url.partition("://")
        if "@" in rest:
            # Not echoed: what precedes the @ is a password.
            raise ConfigError("cluster_url", "must not carry credentials (user:password@)")
        if not sep or scheme not in ("nats", "tls") or "/" in rest.rstrip("/"):
            raise ConfigError("cluster_url", f"must be nats://host:port (got {url[:64]!r})")
        parse_hostport(rest.rstrip("/"), "cluster_url")
        out.append(url)
    if value.strip() and not out:
        raise ConfigError("cluster_url", "must be nats://host:port")
    return tuple(out)


def default_home(env: Mapping[str, str]) -> Path:
    """``$AGENTS_CONTROL_HOME`` or ``~/.agents-control``."""
    value = env.get("AGENTS_CONTROL_HOME")
    return Path(value) if value else Path.home() / ".agents-control"


@dataclass(frozen=True)
class ControlConfig:
    """Everything the control-plane daemon and its CLI need, validated once."""

    home: Path
    """Folder holding only keys and config (0700, files 0600); all state is in the store."""
    store_url: str = ""
    """Where state lives: ``s3://bucket/prefix`` or ``file:///path`` (or a plain path)."""
    store_endpoint: str | None = None
    """http(s) URL of an S3-compatible server (MinIO, moto); None for AWS."""
    store_region: str = "us-east-1"
    """The bucket's region."""
    store_access_key: str | None = field(default=None, repr=False)
    """S3 access key id (``AWS_ACCESS_KEY_ID``); never written to the config file."""
    store_secret_key: str | None = field(default=None, repr=False)
    """S3 secret key (``AWS_SECRET_ACCESS_KEY``); never written to the config file."""
    store_object_lock: bool = False
    """The bucket has S3 Object Lock with a default retention (docs/security.md, "S3
    Object Lock"): every opening of the store checks that it does, and refuses the
    store when it does not. Only for an ``s3://`` store."""
    listen: str = "127.0.0.1:7443"
    """Public listener (server TLS only): Join, Admin, health. Port 0 picks a free one."""
    link_listen: str = "127.0.0.1:7444"
    """Link listener (mutual TLS required): Connect, RenewCertificate, backups."""
    advertise_host: str = ""
    """Host printed in join commands; empty means the public listener's host."""
    server_names: tuple[str, ...] = ()
    """Extra DNS names / IPs for the server certificate (besides localhost, 127.0.0.1)."""
    metrics_listen: str = DEFAULT_METRICS_LISTEN
    """``host:port`` of ``/metrics``; empty disables it."""
    address: str = ""
    """Where the CLI reaches the daemon's public listener; empty: from serve.json."""
    credential: str | None = field(default=None, repr=False)
    """Admin credential the CLI sends: ``--credential`` or the first line of
    ``--credential-file``, else ``AGENTS_CONTROL_CREDENTIAL`` or the first line of
    ``AGENTS_CONTROL_CREDENTIAL_FILE`` (:func:`read_credential`)."""
    heartbeat_interval: float = 15.0
    """Seconds between a machine's heartbeats; 3 missed ones mark it offline."""
    presence_write_interval: float = 300.0
    """Seconds within which a new link's presence is first written (at a random
    point), the least between two writes of a changed agent count, and between
    two alive stamps (controlplane.machines.alive); at least 60."""
    cert_lifetime_days: float = 30.0
    """Lifetime of machine client certificates."""
    renew_threshold: float = 1 / 3
    """Ask a machine to renew once less than this fraction of its lifetime remains."""
    token_ttl: int = 3600
    """Default join-token lifetime in seconds (at most 24 hours)."""
    log_level: str = "INFO"
    """``serve``'s logging level: DEBUG, INFO, WARNING or ERROR (any case in the
    flag, the environment and the file)."""
    log_format: str = "text"
    """``serve``'s log lines: ``text`` or ``json`` (one object per line; shared.logs)."""
    join_confirm_grace: float = 300.0
    """Seconds a joined machine has to connect before its join is rolled back (its
    token use given back): the join reply may never have reached it."""
    prompt_queue_depth: int = 1000
    """Most prompts queued for one machine; more are refused (RESOURCE_EXHAUSTED)."""
    prompt_max_bytes: int = 1024 * 1024
    """Largest prompt text accepted, in bytes of UTF-8 (INVALID_ARGUMENT above it)."""
    prompt_ttl_seconds: int = 7 * 24 * 3600
    """Seconds a queued prompt waits for its machine before it is dropped (audited)."""
    audit_retention_days: int = 400
    """Days an audit record is kept (at most a day more: they go by whole UTC days,
    swept hourly; docs/retention.md)."""
    wake_lead_seconds: float = 120.0
    """An offline machine with a provider is asked to start this long before its next
    schedule fire time (the time it needs to boot and connect)."""
    wake_check_seconds: float = 30.0
    """How often offline machines are checked for a schedule due (see wake_lead_seconds)."""
    store_retry_seconds: float = 0.2
    """Seconds before a store call that failed (a 503, a timeout) is tried again,
    doubling with jitter up to 5 s, five tries within 30 s at most."""
    clock_skew_bound_seconds: float = 60.0
    """Most our clock may differ from the store's (its Date header) before expiries
    wait (controlplane.integrity.clock)."""
    clock_check_seconds: float = 60.0
    """How often our clock is compared with the store's."""
    intent_recheck_seconds: float = 30.0
    """Seconds before the self-check asks again about an abandoned change whose
    roll-back said wait (a held join within ``join_confirm_grace``): how much later
    than its grace a roll-back may come (controlplane.integrity.intents.WAIT_RECHECK).
    ``config.toml`` only; tests that wait for a roll-back after a short grace
    shorten it, so it comes within a second of the grace, not 30 s after it."""
    notify: NotifyConfig = field(default_factory=NotifyConfig)
    """systemd's notify socket and watchdog (``$NOTIFY_SOCKET``, ``$WATCHDOG_USEC``,
    ``$WATCHDOG_PID``, set for a ``Type=notify`` unit): ``serve`` sends READY,
    STOPPING, STATUS and watchdog pings there (shared.sd_notify). Off when unset."""
    store_overrides: tuple[str, ...] = ()
    """Where a store setting came from other than config.toml: the flags and
    environment variables that set ``store_url``, ``store_endpoint`` or
    ``store_region`` (``store migrate`` switches config.toml, which they would
    keep overriding)."""
    cluster_url: str = ""
    """NATS server(s) of a deployment served by several replicas (``nats://host:port``,
    comma-separated for several): ``serve`` then runs one replica of it
    (controlplane.cluster). Empty (the default): one process serves alone and
    NATS is not used at all."""
    crash_in_migrate_after: int = 0
    """Test only (no flag, no file key; ``AGENTS_CONTROL_TEST_CRASH_IN_MIGRATE_AFTER``):
    ``store migrate`` SIGKILLs itself once it copied this many objects, so a
    real-process test can kill it in the middle of the copy. 0 (the default): off."""

    @property
    def config_path(self) -> Path:
        """The TOML file in the home."""
        return self.home / CONFIG_FILE

    @property
    def serve_path(self) -> Path:
        """The serve.json file in the home."""
        return self.home / SERVE_FILE

    def validate(self) -> ControlConfig:
        """Raise ConfigError naming the first bad field; return self."""
        check_folder(self.home.absolute(), "home")
        parse_hostport(self.listen, "listen")
        parse_hostport(self.link_listen, "link_listen")
        parse_hostport(self.metrics_listen, "metrics_listen", allow_empty=True)
        if self.address:
            parse_hostport(self.address, "address")
        if not 0.05 <= self.heartbeat_interval <= 300:
            raise ConfigError("heartbeat_interval", "must be between 0.05 and 300 seconds")
        if not 60 <= self.presence_write_interval <= 3600:
            raise ConfigError("presence_write_interval", "must be between 60 and 3600 seconds")
        # Down to a minute: bench/soak.py runs a month of renewals in minutes.
        if not 1 / 1440 <= self.cert_lifetime_days <= 397:
            raise ConfigError("cert_lifetime_days", "must be between 1 minute and 397 days")
        if not 0 < self.renew_threshold < 1:
            raise ConfigError("renew_threshold", "must be between 0 and 1")
        if not 60 <= self.token_ttl <= MAX_TOKEN_TTL:
            raise ConfigError("token_ttl", f"must be between 60 and {MAX_TOKEN_TTL} seconds")
        if (self.store_access_key is None) != (self.store_secret_key is None):
            raise ConfigError("store_secret_key", "access key and secret key go together")
        if self.store_object_lock and self.store_url and not self.store_url.startswith("s3://"):
            raise ConfigError("store_object_lock", "needs an s3:// store (a bucket's setting)")
        if not 1 <= self.join_confirm_grace <= 86400:
            raise ConfigError("join_confirm_grace", "must be between 1 and 86400 seconds")
        if not 1 <= self.prompt_queue_depth <= 100_000:
            raise ConfigError("prompt_queue_depth", "must be between 1 and 100000")
        if not 1 <= self.prompt_max_bytes <= 4 * 1024 * 1024:
            raise ConfigError("prompt_max_bytes", "must be between 1 and 4 MiB")
        if not 60 <= self.prompt_ttl_seconds <= 90 * 86400:
            raise ConfigError("prompt_ttl_seconds", "must be between 60 seconds and 90 days")
        if not 1 <= self.audit_retention_days <= 3650:
            raise ConfigError("audit_retention_days", "must be between 1 and 3650 days")
        if not 0 <= self.wake_lead_seconds <= 86400:
            raise ConfigError("wake_lead_seconds", "must be between 0 and 86400 seconds")
        if not 0.1 <= self.wake_check_seconds <= 3600:
            raise ConfigError("wake_check_seconds", "must be between 0.1 and 3600 seconds")
        if not 0.001 <= self.store_retry_seconds <= 5:
            raise ConfigError("store_retry_seconds", "must be between 0.001 and 5 seconds")
        if not 2 <= self.clock_skew_bound_seconds <= 86400:
            raise ConfigError("clock_skew_bound_seconds", "must be between 2 and 86400 seconds")
        if not 0.1 <= self.clock_check_seconds <= 3600:
            raise ConfigError("clock_check_seconds", "must be between 0.1 and 3600 seconds")
        if not 0.1 <= self.intent_recheck_seconds <= 3600:
            raise ConfigError("intent_recheck_seconds", "must be between 0.1 and 3600 seconds")
        cluster_servers(self.cluster_url)
        check_level(self.log_level)
        check_format(self.log_format)
        self.notify.validate()
        return self

    def file_values(self) -> dict[str, Any]:
        """The settings ``init`` writes to config.toml (no secrets)."""
        out: dict[str, Any] = {
            "store_url": self.store_url,
            "store_region": self.store_region,
            "listen": self.listen,
            "link_listen": self.link_listen,
            "metrics_listen": self.metrics_listen,
            "heartbeat_interval": self.heartbeat_interval,
            "cert_lifetime_days": self.cert_lifetime_days,
            "token_ttl": self.token_ttl,
        }
        if self.store_endpoint:
            out["store_endpoint"] = self.store_endpoint
        if self.store_object_lock:
            out["store_object_lock"] = True
        if self.advertise_host:
            out["advertise_host"] = self.advertise_host
        if self.server_names:
            out["server_names"] = list(self.server_names)
        return out


#: The keys config.toml may hold and the TOML types each accepts. Secrets (the
#: admin credential, the store's keys) are never read from the file.
FILE_KEYS: Final[dict[str, tuple[type, ...]]] = {
    "store_url": (str,),
    "store_endpoint": (str,),
    "store_region": (str,),
    "store_object_lock": (bool,),
    "listen": (str,),
    "link_listen": (str,),
    "advertise_host": (str,),
    "server_names": (list, str),
    "metrics_listen": (str,),
    "address": (str,),
    "heartbeat_interval": (int, float),
    "presence_write_interval": (int, float),
    "cert_lifetime_days": (int, float),
    "renew_threshold": (int, float),
    "token_ttl": (int,),
    "log_level": (str,),
    "log_format": (str,),
    "join_confirm_grace": (int, float),
    "prompt_queue_depth": (int,),
    "prompt_max_bytes": (int,),
    "prompt_ttl_seconds": (int,),
    "audit_retention_days": (int,),
    "wake_lead_seconds": (int, float),
    "wake_check_seconds": (int, float),
    "store_retry_seconds": (int, float),
    "clock_skew_bound_seconds": (int, float),
    "clock_check_seconds": (int, float),
    "intent_recheck_seconds": (int, float),
    "cluster_url": (str,),
}


def read_credential(flags: Mapping[str, Any], env: Mapping[str, str]) -> str | None:
    """The admin credential, or None when none is given.

    Flags win over the environment: ``--credential`` or ``--credential-file``,
    else ``AGENTS_CONTROL_CREDENTIAL`` or ``AGENTS_CONTROL_CREDENTIAL_FILE``.
    Both kinds at one level is refused (which one was meant?). A file gives its
    first line, stripped; a file that cannot be read, or whose first line is
    empty, is a ConfigError naming the file. No message holds the secret.
    """
    levels = (
        (
            flags.get("credential"),
            flags.get("credential_file"),
            "--credential",
            "--credential-file",
        ),
        (
            env.get("AGENTS_CONTROL_CREDENTIAL"),
            env.get("AGENTS_CONTROL_CREDENTIAL_FILE"),
            "AGENTS_CONTROL_CREDENTIAL",
            "AGENTS_CONTROL_CREDENTIAL_FILE",
        ),
    )
    for text, path, text_name, file_name in levels:
        if text and path:
            raise ConfigError("credential", f"both {text_name} and {file_name} given; give one")
        if text:
            return str(text)
        if path:
            return _credential_file(Path(str(path)).expanduser(), file_name)
    return None


def _credential_file(path: Path, name: str) -> str:
    # Opened as given, not checked for a regular file first: a pipe is fine
    # (`--credential-file <(pass show agents/admin)`).
    try:
        with path.open("rb") as f:
            first = f.readline(CREDENTIAL_FILE_LIMIT)
    except OSError as e:
        raise ConfigError("credential", f"{name}: cannot read {path}: {e.strerror or e}") from None
    try:
        line = first.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError("credential", f"{name}: {path} is not UTF-8 text") from None
    if not line:
        raise ConfigError(
            "credential", f"{name}: the first line of {path} is empty (it holds the credential)"
        )
    return line


def _names(value: Any) -> tuple[str, ...]:
    if isinstance(value, list | tuple):
        return tuple(str(v).strip() for v in value if str(v).strip())
    return tuple(v.strip() for v in str(value).split(",") if v.strip())


def load_config(
    flags: Mapping[str, Any], env: Mapping[str, str], *, read_file: bool = True
) -> ControlConfig:
    """Build and validate the config from flags > env > ``<home>/config.toml`` > defaults.

    ``flags`` holds the CLI's parsed options by field name (None when not given).
    """
    home = Path(flags.get("home") or default_home(env)).expanduser()
    file = load_toml(home / CONFIG_FILE) if read_file else {}
    check_file(file, FILE_KEYS, home / CONFIG_FILE)
    d = ControlConfig(home=home)
    get = Sources(flags, env, file).get

    def secret(name: str, env_key: str) -> str | None:
        value = flags.get(name) or env.get(env_key)
        return str(value) if value else None

    cfg = ControlConfig(
        home=home,
        store_url=get("store_url", "AGENTS_CONTROL_STORE", d.store_url, str),
        store_endpoint=get("store_endpoint", "AGENTS_CONTROL_STORE_ENDPOINT", None, str),
        store_region=get("store_region", "AGENTS_CONTROL_STORE_REGION", d.store_region, str),
        store_access_key=secret("store_access_key", "AWS_ACCESS_KEY_ID"),
        store_secret_key=secret("store_secret_key", "AWS_SECRET_ACCESS_KEY"),
        store_object_lock=get(
            "store_object_lock", "AGENTS_CONTROL_STORE_OBJECT_LOCK", False, parse_bool
        ),
        listen=get("listen", "AGENTS_CONTROL_LISTEN", d.listen, str),
        link_listen=get("link_listen", "AGENTS_CONTROL_LINK_LISTEN", d.link_listen, str),
        advertise_host=get("advertise_host", "AGENTS_CONTROL_ADVERTISE_HOST", "", str),
        server_names=get("server_names", None, (), _names),
        metrics_listen=get("metrics_listen", "AGENTS_CONTROL_METRICS", d.metrics_listen, str),
        address=get("address", "AGENTS_CONTROL_ADDRESS", "", str),
        credential=read_credential(flags, env),
        heartbeat_interval=get(
            "heartbeat_interval", "AGENTS_CONTROL_HEARTBEAT", d.heartbeat_interval, seconds_value
        ),
        presence_write_interval=get(
            "presence_write_interval", None, d.presence_write_interval, float
        ),
        cert_lifetime_days=get("cert_lifetime_days", None, d.cert_lifetime_days, float),
        renew_threshold=get("renew_threshold", None, d.renew_threshold, float),
        token_ttl=get("token_ttl", None, d.token_ttl, int),
        log_level=get("log_level", "AGENTS_CONTROL_LOG_LEVEL", d.log_level, parse_level),
        log_format=get("log_format", "AGENTS_CONTROL_LOG_FORMAT", d.log_format, parse_format),
        join_confirm_grace=get(
            "join_confirm_grace",
            "AGENTS_CONTROL_JOIN_CONFIRM_GRACE",
            d.join_confirm_grace,
            seconds_value,
        ),
        prompt_queue_depth=get("prompt_queue_depth", None, d.prompt_queue_depth, int),
        prompt_max_bytes=get("prompt_max_bytes", None, d.prompt_max_bytes, int),
        prompt_ttl_seconds=get("prompt_ttl_seconds", None, d.prompt_ttl_seconds, int),
        audit_retention_days=get("audit_retention_days", None, d.audit_retention_days, int),
        wake_lead_seconds=get("wake_lead_seconds", None, d.wake_lead_seconds, float),
        wake_check_seconds=get("wake_check_seconds", None, d.wake_check_seconds, float),
        store_retry_seconds=get("store_retry_seconds", None, d.store_retry_seconds, float),
        clock_skew_bound_seconds=get(
            "clock_skew_bound_seconds", None, d.clock_skew_bound_seconds, float
        ),
        clock_check_seconds=get("clock_check_seconds", None, d.clock_check_seconds, float),
        intent_recheck_seconds=get("intent_recheck_seconds", None, d.intent_recheck_seconds, float),
        cluster_url=get("cluster_url", "AGENTS_CONTROL_CLUSTER", "", str),
        notify=NotifyConfig.from_env(env, os.getpid()),
        store_overrides=_store_overrides(flags, env),
        crash_in_migrate_after=_test_count(env, "AGENTS_CONTROL_TEST_CRASH_IN_MIGRATE_AFTER"),
    )
    return cfg.validate()


#: The store settings a flag or the environment may set over config.toml.
_STORE_SOURCES: Final = (
    ("store_url", "--store", "AGENTS_CONTROL_STORE"),
    ("store_endpoint", "--store-endpoint", "AGENTS_CONTROL_STORE_ENDPOINT"),
    ("store_region", "--store-region", "AGENTS_CONTROL_STORE_REGION"),
)


def _store_overrides(flags: Mapping[str, Any], env: Mapping[str, str]) -> tuple[str, ...]:
    out: list[str] = []
    for name, flag, env_key in _STORE_SOURCES:
        if flags.get(name) not in (None, ""):
            out.append(flag)
        elif env.get(env_key):
            out.append(env_key)
    return tuple(out)


def _test_count(env: Mapping[str, str], name: str) -> int:
    value = env.get(name, "") or "0"
    try:
        return int(value)
    except ValueError:
        raise ConfigError(name, f"must be a whole number, got {value[:16]!r}") from None
