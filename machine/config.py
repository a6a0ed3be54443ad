"""The machine daemon's configuration: one frozen dataclass, built once by the CLI.

Values come from command-line flags, then the environment (passed in as a
mapping), then a TOML file (``<data_dir>/machine.toml`` or ``--config``), then
defaults. This is the only module of the machine package that looks at
environment values (``AGENTS_MACHINE_*``, ``AGENTS_DATA_DIR``, ``TZ``,
``XDG_DATA_HOME``, the runtimes' homes, systemd's notify variables and a
backup bucket's ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``).
"""

from __future__ import annotations

import configparser
import ipaddress
import logging
import os
import re
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

from machine.backups.service import parse_daily_time
from machine.formats.cron import validate_zone
from machine.runtimes.claude_files import default_claude_home, default_codex_home
from shared.config import (
    Sources,
    check_file,
    check_folder,
    load_toml,
    parse_bool,
    parse_size,
    split_hostport,
)
from shared.durations import seconds_value
from shared.errors import ConfigError, InvalidArgument
from shared.logs import check_format, check_level, parse_format, parse_level
from shared.sd_notify import NotifyConfig
from shared.store.s3_config import S3Config
from shared.store.url import StoreOptions, describe_store, parse_store_url

__all__ = [
    "BACKUP_SETTINGS",
    "DEFAULT_ATTACHMENT_LIMIT",
    "DEFAULT_PROMPT_LIMIT",
    "FILE_KEYS",
    "SERVICE_METRICS_ADDRESS",
    "MachineConfig",
    "check_backup_target",
    "default_data_dir",
    "default_time_zone",
    "parse_hostport",
    "read_backup_credentials",
    "resolve_data_dir",
    "server_data_dir",
]

logger = logging.getLogger(__name__)

DEFAULT_PROMPT_LIMIT = 1024 * 1024
DEFAULT_ATTACHMENT_LIMIT = 20 * 1024 * 1024
DEFAULT_EVENT_RETENTION_DAYS = 7
DEFAULT_BACKUP_KEEP = 3
#: Continuous backups: what changed ships within this many seconds (10 s to 24 h).
DEFAULT_BACKUP_INTERVAL = 60.0
MIN_BACKUP_INTERVAL = 10.0
MAX_BACKUP_INTERVAL = 86400.0
DEFAULT_BACKUP_TIME = "03:30"
#: Where a machine daemon run as a service serves ``/metrics`` unless told
#: otherwise: the unit ``join --install-service`` writes passes it, as
#: deploy/systemd/agents-machine.service does, and deploy/prometheus/prometheus.yml
#: scrapes it (next to the control plane's default, 127.0.0.1:9470). A daemon
#: started by hand serves no metrics unless asked (``metrics_address``): a
#: laptop may run several, and they would fight over one port.
SERVICE_METRICS_ADDRESS: Final = "127.0.0.1:9471"
# Unix socket paths are limited to ~107 bytes on Linux (104 on macOS).
_MAX_SOCKET_PATH = 100
#: The longest shutdown grace accepted, in seconds.
_MAX_GRACE = 3600.0
#: The largest backup credentials file read (an AWS shared-credentials file is tiny).
_MAX_CREDENTIALS_FILE = 64 * 1024


def default_data_dir(env: Mapping[str, str], home: Path, platform: str | None = None) -> Path:
    """The per-user data folder: ``$XDG_DATA_HOME/Agents`` or ``~/.local/share/Agents``
    on Linux, ``~/Library/Application Support/Agents`` on macOS."""
    platform = platform or sys.platform
    if platform == "darwin":
        return home / "Library" / "Application Support" / "Agents"
    xdg = env.get("XDG_DATA_HOME", "")
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "Agents"
    return home / ".local" / "share" / "Agents"


def server_data_dir(home: Path) -> Path:
    """The data folder of a server installed by ``agents-machine join``."""
    return home / ".agents-server" / "root"


def resolve_data_dir(flag: str | Path | None, env: Mapping[str, str], home: Path) -> Path:
    """``--data-dir`` > ``$AGENTS_DATA_DIR`` > a joined server's folder when it
    exists > the platform default, made absolute.

    Every command resolves the folder this way (ARCHITECTURE §3), so that on a
    server ``agents-machine agent list`` reaches the daemon ``join`` started.
    """
    chosen: str | Path | None = flag or env.get("AGENTS_DATA_DIR") or None
    if chosen:
        path = Path(chosen).expanduser()
    elif server_data_dir(home).is_dir():
        path = server_data_dir(home)
    else:
        path = default_data_dir(env, home)
    return path.absolute()


#: The keys machine.toml may hold and the TOML types each accepts.
#: The settings a backup carries (MachineConfig.backup_settings), all of them
#: keys machine.toml may hold, so a restore can name what to set there.
BACKUP_SETTINGS: Final = (
    "prompt_limit",
    "attachment_limit",
    "event_retention_days",
    "shutdown_grace_seconds",
    "max_streams_per_client",
    "max_streams",
    "integrity_check_seconds",
    "backup_keep",
    "backup_time",
    "time_zone",
    "scheduler",
    "log_level",
    "log_format",
)


def _setting_text(value: object) -> str:
    """A setting's value as machine.toml spells it (``true``, ``3``, ``03:30``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


FILE_KEYS: dict[str, tuple[type, ...]] = {
    "socket_path": (str,),
    "tcp_address": (str,),
    "metrics_address": (str,),
    "prompt_limit": (int, str),
    "attachment_limit": (int, str),
    "event_retention_days": (int,),
    "background_loops": (bool,),
    "shutdown_grace_seconds": (int, float),
    "max_streams_per_client": (int,),
    "max_streams": (int,),
    "integrity_check_seconds": (int, float),
    "backup_keep": (int,),
    "backup_time": (str,),
    "backup_interval": (int, float, str),
    "backup_dir": (str,),
    "backup_target": (str,),
    "backup_store_endpoint": (str,),
    "backup_store_region": (str,),
    "backup_credentials_file": (str,),
    "time_zone": (str,),
    "scheduler": (bool,),
    "log_level": (str,),
    "log_format": (str,),
    # A test hook, on purpose not a flag or an environment variable: see the field.
    "schedule_test_seconds": (int,),
}


def default_time_zone(env: Mapping[str, str], etc: Path = Path("/etc")) -> str:
    """The machine's IANA zone: ``$TZ`` when it names one, else ``/etc/timezone``,
    else the zone ``/etc/localtime`` links to, else ``UTC``."""
    tz = env.get("TZ", "").removeprefix(":")
    if tz and not tz.startswith("/") and ".." not in tz:
        return tz
    try:
        named = (etc / "timezone").read_text().strip()
        if named:
            return named
    except OSError:
        pass
    try:
        target = str((etc / "localtime").readlink())
    except OSError:
        return "UTC"
    _, found, zone = target.partition("zoneinfo/")
    return zone if found and zone else "UTC"


def _parse_interval(value: object) -> float:
    # Seconds as a number, or a duration as the CLIs spell them ("90s", "5m").
    try:
        return seconds_value(value)
    except ValueError:
        raise ConfigError(
            "backup_interval",
            f'must be a duration from 10s to 24h (60, "90s", "5m"), got {value!r}',
        ) from None


def _parse_keep(value: object) -> int:
    try:
        return int(str(value))
    except ValueError:
        raise ConfigError(
            "backup_keep", f"must be a whole number from 1 to 10, got {value!r}"
        ) from None


def _test_crash_after(env: Mapping[str, str], name: str, field: str) -> int:
    value = env.get(name, "") or "0"
    try:
        return int(value)
    except ValueError:
        raise ConfigError(field, f"must be a whole number, got {value[:16]!r}") from None


def parse_hostport(value: str, field: str) -> tuple[str, int]:
    """Parse ``HOST:PORT`` where HOST must be a loopback address (127.0.0.1, ::1).

    Returns the address in its canonical form; ``[::1]:PORT`` is accepted.
    """
    host, port = split_hostport(value, field)
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(field, f"expected a loopback IP and a port, got {value!r}") from None
    if not addr.is_loopback:
        # No authentication on the machine API yet: never expose it beyond this host.
        raise ConfigError(field, f"only loopback addresses are allowed, got {host!r}")
    return str(addr), port


#: An S3 region name (us-east-1, eu-central-2, a MinIO server's own name).
_REGION: Final = re.compile(r"[a-z0-9][a-z0-9-]{0,62}", re.ASCII)


def check_backup_target(value: str) -> Path | S3Config:
    """``backup_target`` parsed: an absolute folder or an ``s3://bucket/prefix``
    bucket; ConfigError naming it otherwise (the message never echoes a URL's query,
    which might hold a key)."""
    if not value.strip():
        raise ConfigError("backup_target", "is empty; give a folder or s3://bucket/prefix")
    if "://" not in value and not Path(value).expanduser().is_absolute():
        raise ConfigError(
            "backup_target", f"must be an absolute folder or s3://bucket/prefix, got {value[:80]!r}"
        )
    scheme = value.partition("://")[0].lower() if "://" in value else ""
    if scheme not in ("", "file", "s3"):
        raise ConfigError(
            "backup_target",
            f"unsupported scheme {scheme[:16]!r} (use a folder or s3://bucket/prefix)",
        )
    try:
        parsed = parse_store_url(value)
    except InvalidArgument as e:
        raise ConfigError("backup_target", e.reason) from None
    if isinstance(parsed, S3Config) and (parsed.access_key or parsed.secret_key):
        raise ConfigError(
            "backup_target",
            "credentials never go in the URL (it is shown in status and logs): set"
            " AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or backup_credentials_file",
        )
    return parsed


def _check_endpoint(endpoint: str) -> None:
    parts = urlsplit(endpoint)
    try:
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        port_ok = False
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.username
        or parts.password
        or not port_ok
        or parts.query
        or parts.fragment
    ):
        raise ConfigError(
            "backup_store_endpoint",
            "must be an http(s) URL of the S3 server without credentials"
            " (such as http://127.0.0.1:9000)",
        )


def read_backup_credentials(path: Path) -> tuple[str, str]:
    """The access key id and secret key of the AWS shared-credentials file ``path``
    (its ``[default]`` profile). ConfigError naming ``backup_credentials_file``
    when it cannot be read, is readable or writable by others than its owner, or
    is not in that format; no message holds a line of it."""

    def refuse(why: str) -> ConfigError:
        return ConfigError("backup_credentials_file", f"{path}: {why}")

    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise refuse("not a regular file")
        if info.st_mode & 0o077:
            # As ssh does with a private key: a secret others can read is not one.
            raise refuse(
                f"readable or writable by others (mode {stat.S_IMODE(info.st_mode):04o});"
                f" make it private: chmod 600 {path}"
            )
        if info.st_size > _MAX_CREDENTIALS_FILE:
            raise refuse(f"larger than a credentials file ({info.st_size} bytes)")
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise refuse(f"cannot be read ({e.strerror or type(e).__name__})") from None
    except UnicodeDecodeError:
        raise refuse("not UTF-8 text") from None
    wanted = "a [default] profile with aws_access_key_id and aws_secret_access_key"
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(text)
    except configparser.Error:
        # configparser's messages quote the line: it may hold the secret.
        raise refuse(f"not in the AWS shared-credentials format ({wanted})") from None
    if not parser.has_section("default"):
        raise refuse(f"no [default] profile ({wanted})")
    profile = parser["default"]
    access = profile.get("aws_access_key_id", "").strip()
    secret = profile.get("aws_secret_access_key", "").strip()
    if not access or not secret:
        raise refuse(f"an empty or missing key ({wanted})")
    return access, secret


@dataclass(frozen=True)
class MachineConfig:
    """Everything the machine daemon needs to know, fixed at start."""

    data_dir: Path
    """The data folder (0700): machine.db, attachments/, keys/, backups/..."""

    socket_path: Path | None = None
    """The gRPC Unix socket; ``None`` means ``<data_dir>/machine.sock``."""

    tcp_address: str | None = None
    """Optional extra gRPC listener ``HOST:PORT`` on a loopback address only (port 0
    picks a free one). Calls on it need ``authorization: Bearer <token>`` with the
    token from ``<data_dir>/keys/local-api-token``; remote access goes through the
    control plane."""

    metrics_address: str | None = None
    """``HOST:PORT`` (loopback) for Prometheus ``/metrics``; ``None`` (the default)
    turns it off. A service unit passes :data:`SERVICE_METRICS_ADDRESS`."""

    prompt_limit: int = DEFAULT_PROMPT_LIMIT
    """Largest prompt accepted, in bytes of UTF-8 (default 1 MiB)."""

    attachment_limit: int = DEFAULT_ATTACHMENT_LIMIT
    """Largest attachment accepted, in bytes (default 20 MiB)."""

    event_retention_days: int = DEFAULT_EVENT_RETENTION_DAYS
    """Entries of the machine event log older than this are pruned (default 7)."""

    background_loops: bool = True
    """Run periodic jobs (pruning). Tests switch them off."""

    shutdown_grace_seconds: float = 10.0
    """On the first SIGTERM, runs get this long to end before they are interrupted."""

    max_streams_per_client: int = 64
    """Prompt/Replay streams one client (peer address; every Unix-socket caller is
    one) may have open at once; more are refused with RESOURCE_EXHAUSTED."""

    max_streams: int = 256
    """Prompt/Replay streams the daemon serves at once, all clients together."""

    integrity_check_seconds: float = 86400.0
    """A full ``integrity_check`` of machine.db runs this often (default daily; a
    ``quick_check`` runs at every start). Needs ``background_loops``."""

    backup_keep: int = DEFAULT_BACKUP_KEEP
    """How many backups to keep (1 to 10, default 3); older ones are pruned only
    after a newer backup succeeded."""

    backup_time: str = DEFAULT_BACKUP_TIME
    """Local time of day (``HH:MM``, 24-hour) of the daily backup (default 03:30).
    Needs ``background_loops``."""

    backup_interval: float = DEFAULT_BACKUP_INTERVAL
    """A joined machine ships what changed (continuous backups: an increment)
    within this many seconds of its commit (10 s to 24 h, default 60). Needs
    ``background_loops``."""

    backup_dir: Path | None = None
    """A stand-alone machine's backup folder; ``None`` means ``<data_dir>/backups``.
    ``status`` warns when it is on the same device as the data. ``backup_target``
    (a folder or a bucket) says the same and more; give one of the two."""

    backup_target: str | None = None
    """Where a stand-alone machine's backups go: an absolute folder (best on another
    disk) or ``s3://bucket/prefix`` (an S3-compatible bucket; a prefix of its own
    per machine). ``None``: ``backup_dir``. A joined machine backs up to its
    control plane and ignores this (a warning in the log and in ``status``)."""

    backup_store_endpoint: str | None = None
    """http(s) URL of the S3-compatible server of an ``s3://`` backup target or
    ``backup ... --from s3://...`` (MinIO, moto); ``None``: AWS itself."""

    backup_store_region: str | None = None
    """The bucket's region (request signing); ``None``: the URL's ``region`` or
    us-east-1."""

    backup_credentials_file: Path | None = None
    """A file holding the bucket's credentials, in the AWS shared-credentials format
    (``[default]`` with ``aws_access_key_id`` and ``aws_secret_access_key``), readable
    by its owner only (0600; refused otherwise). Wins over the environment's
    ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``. Read by the daemon when it opens
    the bucket, never kept in a backup, a log line or the bucket."""

    backup_access_key: str | None = field(default=None, repr=False)
    """The bucket's access key id from ``$AWS_ACCESS_KEY_ID`` (environment only:
    never a flag or a file key); see ``backup_credentials_file``."""

    backup_secret_key: str | None = field(default=None, repr=False)
    """The bucket's secret key from ``$AWS_SECRET_ACCESS_KEY`` (environment only)."""

    claude_home: Path | None = None
    """Claude Code's folder (``$CLAUDE_CONFIG_DIR`` or ``~/.claude``): deleting a
    Claude session removes its files here. ``None``: the acp runtime's default."""

    codex_home: Path | None = None
    """Codex's folder (``$CODEX_HOME`` or ``~/.codex``), as ``claude_home``."""

    time_zone: str = "UTC"
    """The IANA zone a schedule's cron is read in when it names none (default:
    the machine's own zone, from ``$TZ``, ``/etc/timezone`` or ``/etc/localtime``)."""

    scheduler: bool = True
    """Fire schedules. Independent of ``background_loops``: schedules are a
    feature people rely on, not housekeeping."""

    schedule_test_seconds: int = 0
    """Test hook (``machine.toml`` only; no flag, no environment variable): when
    above 0, every schedule also matches on seconds, firing every this many
    seconds within each minute its cron matches (``* * * * *`` every N seconds).
    0, the default, is real cron: minute resolution."""

    log_level: str = "INFO"
    """``serve``'s logging level: DEBUG, INFO, WARNING or ERROR (``--log-level``,
    ``AGENTS_MACHINE_LOG_LEVEL``, ``log_level`` in the file; any case)."""

    log_format: str = "text"
    """``serve``'s log lines: ``text`` or ``json``, one object per line
    (``--log-format``, ``AGENTS_MACHINE_LOG_FORMAT``, ``log_format``; shared.logs)."""

    notify: NotifyConfig = field(default_factory=NotifyConfig)
    """systemd's notify socket and watchdog (``$NOTIFY_SOCKET``, ``$WATCHDOG_USEC``,
    ``$WATCHDOG_PID``, set for a ``Type=notify`` unit): READY, STOPPING, STATUS and
    watchdog pings go there (shared.sd_notify). Off when unset."""

    crash_after_deliveries: int = 0
    """Test only (no flag, no file key; ``AGENTS_MACHINE_TEST_CRASH_AFTER_DELIVERIES``):
    once this many deliveries are stored durably, the daemon SIGKILLs itself
    before acknowledging the last one, so a real-process test can kill the
    machine exactly between its record and its ack. 0 (the default): off."""

    crash_in_transfer_after: int = 0
    """Test only (``AGENTS_MACHINE_TEST_CRASH_IN_TRANSFER_AFTER_AGENTS``): once a
    restore or an import loaded this many agents inside its one transaction, the
    daemon SIGKILLs itself before the commit. 0 (the default): off."""
    crash_in_history_load_after: int = 0
    """Test only (``AGENTS_MACHINE_TEST_CRASH_IN_HISTORY_LOAD_AFTER_AGENTS``): once
    the background loader committed this many restored agents' histories, the
    daemon SIGKILLs itself. 0 (the default): off."""
    crash_in_prune_after: int = 0
    """Test only (``AGENTS_MACHINE_TEST_CRASH_IN_PRUNE_AFTER_DELETES``): once a
    prune of the folder target made this many steps (each object deleted, each
    pack repacked), the daemon SIGKILLs itself. 0 (the default): off."""
    crash_after_join: int = 0
    """Test only (``AGENTS_MACHINE_TEST_CRASH_AFTER_JOIN``): at 1, ``join`` SIGKILLs
    itself once its identity committed, before anything else (a restore, a
    backup, the daemon): the machine never connects. 0 (the default): off."""

    @property
    def socket(self) -> Path:
        """The Unix socket path actually used."""
        return self.socket_path or self.data_dir / "machine.sock"

    @property
    def db_path(self) -> Path:
        """The SQLite database."""
        return self.data_dir / "machine.db"

    @property
    def attachments_dir(self) -> Path:
        """Content-addressed attachments."""
        return self.data_dir / "attachments"

    @property
    def backups_dir(self) -> Path:
        """The stand-alone backup folder actually used (unused with a bucket target)."""
        if self.backup_target is not None and "://" not in self.backup_target:
            return Path(self.backup_target).expanduser()
        if self.backup_target is not None and self.backup_target.startswith("file://"):
            parsed = parse_store_url(self.backup_target)
            assert isinstance(parsed, Path)  # validate() refused anything else
            return parsed
        return self.backup_dir or self.data_dir / "backups"

    @property
    def backup_bucket(self) -> str | None:
        """The ``s3://`` URL of a bucket backup target, or ``None`` (a folder)."""
        if self.backup_target is not None and self.backup_target.startswith("s3://"):
            return self.backup_target
        return None

    def backup_store_options(self) -> StoreOptions:
        """How to reach a backup bucket: endpoint, region and the credentials
        (``backup_credentials_file``, read now, else the environment's; neither:
        botocore's own chain, e.g. an instance role). ConfigError naming the file
        when it is not private or not in the AWS shared-credentials format; the
        message never holds a line of it."""
        access, secret = self.backup_access_key, self.backup_secret_key
        if self.backup_credentials_file is not None:
            access, secret = read_backup_credentials(self.backup_credentials_file)
        return StoreOptions(
            access_key=access,
            secret_key=secret,
            region=self.backup_store_region,
            endpoint_url=self.backup_store_endpoint,
        )

    def describe_backup_bucket(self, url: str) -> str:
        """The bucket ``url`` names for messages and ``status``: never a credential."""
        where = describe_store(url)
        endpoint = self.backup_store_endpoint
        return f"{where} at {endpoint}" if endpoint else where

    @property
    def outgoing_dir(self) -> Path:
        """Exports waiting to be read (removed once read, or after an hour)."""
        return self.data_dir / "Outgoing"

    @property
    def incoming_dir(self) -> Path:
        """Imports being staged (removed once imported, or after an hour)."""
        return self.data_dir / "Incoming"

    def backup_settings(self) -> dict[str, str]:
        """The settings every backup's manifest carries (docs/backups.md), as text.

        An allow-list, so a field added later stays out until it is judged: the
        machine's limits, retention, checks, backup schedule and time zone. Never
        a path (another disk's layout), a listener address, a test hook, the
        environment's values, or anything of ``keys/`` (no secret is a setting).
        """
        return {name: _setting_text(getattr(self, name)) for name in BACKUP_SETTINGS}

    def validate(self) -> MachineConfig:
        """Raise ConfigError naming the first bad field; return self."""
        if not self.data_dir.is_absolute():
            raise ConfigError("data_dir", f"must be an absolute path, got {self.data_dir}")
        check_folder(self.data_dir, "data_dir")
        if len(str(self.socket)) > _MAX_SOCKET_PATH:
            raise ConfigError(
                "socket_path", f"too long for a Unix socket ({len(str(self.socket))} bytes)"
            )
        if self.tcp_address is not None:
            parse_hostport(self.tcp_address, "tcp_address")
        if self.metrics_address is not None:
            parse_hostport(self.metrics_address, "metrics_address")
        if self.prompt_limit < 1:
            raise ConfigError("prompt_limit", "must be at least 1 byte")
        if self.attachment_limit < 1:
            raise ConfigError("attachment_limit", "must be at least 1 byte")
        if not 1 <= self.event_retention_days <= 3650:
            raise ConfigError("event_retention_days", "must be between 1 and 3650")
        # Bounded (NaN fails the comparison too): the service manager kills the
        # daemon after its own stop timeout anyway, and a day of grace is a typo.
        if not 0 <= self.shutdown_grace_seconds <= _MAX_GRACE:
            raise ConfigError(
                "shutdown_grace_seconds",
                f"must be 0 to {_MAX_GRACE:.0f} seconds, got {self.shutdown_grace_seconds!r}",
            )
        if not 1 <= self.max_streams_per_client <= 100_000:
            raise ConfigError("max_streams_per_client", "must be 1 to 100000")
        if not 1 <= self.max_streams <= 100_000:
            raise ConfigError("max_streams", "must be 1 to 100000")
        if not self.integrity_check_seconds > 0:
            raise ConfigError("integrity_check_seconds", "must be more than 0")
        if (
            not isinstance(self.backup_keep, int)
            or isinstance(self.backup_keep, bool)
            or not 1 <= self.backup_keep <= 10
        ):
            raise ConfigError(
                "backup_keep", f"must be a whole number from 1 to 10, got {self.backup_keep!r}"
            )
        if not MIN_BACKUP_INTERVAL <= self.backup_interval <= MAX_BACKUP_INTERVAL:
            raise ConfigError(
                "backup_interval",
                f"must be {MIN_BACKUP_INTERVAL:.0f} to {MAX_BACKUP_INTERVAL:.0f} seconds,"
                f" got {self.backup_interval!r}",
            )
        try:
            parse_daily_time(self.backup_time)
        except InvalidArgument:
            raise ConfigError(
                "backup_time",
                f"must be a local time of day as HH:MM, got {self.backup_time[:16]!r}",
            ) from None
        try:
            validate_zone(self.time_zone, "time_zone")
        except InvalidArgument as e:
            raise ConfigError("time_zone", e.reason) from None
        if not 0 <= self.schedule_test_seconds <= 59:
            raise ConfigError("schedule_test_seconds", "must be 0 (off) to 59")
        check_level(self.log_level)
        check_format(self.log_format)
        self.notify.validate()
        if self.crash_after_deliveries < 0:
            raise ConfigError("crash_after_deliveries", "must not be negative")
        if self.crash_in_transfer_after < 0:
            raise ConfigError("crash_in_transfer_after", "must not be negative")
        if self.crash_in_prune_after < 0:
            raise ConfigError("crash_in_prune_after", "must not be negative")
        if self.crash_after_join < 0:
            raise ConfigError("crash_after_join", "must not be negative")
        if self.backup_dir is not None and not self.backup_dir.is_absolute():
            raise ConfigError("backup_dir", f"must be an absolute path, got {self.backup_dir}")
        self._validate_backup_target()
        return self

    def _validate_backup_target(self) -> None:
        if self.backup_target is not None:
            if self.backup_dir is not None:
                raise ConfigError(
                    "backup_target",
                    "give backup_target or backup_dir, not both (they say one thing)",
                )
            check_backup_target(self.backup_target)
        if self.backup_store_endpoint is not None:
            _check_endpoint(self.backup_store_endpoint)
        if self.backup_store_region is not None and not _REGION.fullmatch(self.backup_store_region):
            raise ConfigError(
                "backup_store_region",
                f"must be a region name such as eu-west-1, got {self.backup_store_region[:40]!r}",
            )
        if (self.backup_access_key is None) != (self.backup_secret_key is None):
            raise ConfigError(
                "AWS_ACCESS_KEY_ID", "and AWS_SECRET_ACCESS_KEY go together; set both or neither"
            )
        creds = self.backup_credentials_file
        if creds is not None and not creds.is_absolute():
            raise ConfigError("backup_credentials_file", f"must be an absolute path, got {creds}")

    @classmethod
    def build(
        cls,
        *,
        flags: Mapping[str, Any],
        env: Mapping[str, str],
        home: Path,
        config_file: Path | None = None,
    ) -> MachineConfig:
        """Build from flags > env > file > defaults and validate.

        ``flags`` holds the CLI's values by field name (``None`` when not given).
        The file is ``config_file`` or ``<data_dir>/machine.toml`` when present.
        """
        data_dir = resolve_data_dir(flags.get("data_dir"), env, home)
        file_path = config_file or data_dir / "machine.toml"
        file = load_toml(file_path, required=config_file is not None)
        check_file(file, FILE_KEYS, file_path)

        src = Sources(flags, env, file)

        def opt(name: str, env_key: str) -> str | None:
            value: str | None = src.get(name, env_key, None)
            return value

        socket = opt("socket_path", "AGENTS_MACHINE_SOCKET")
        backup_dir = opt("backup_dir", "AGENTS_MACHINE_BACKUP_DIR")
        credentials = opt("backup_credentials_file", "AGENTS_MACHINE_BACKUP_CREDENTIALS_FILE")
        cfg = cls(
            data_dir=data_dir,
            socket_path=Path(socket).absolute() if socket else None,
            tcp_address=opt("tcp_address", "AGENTS_MACHINE_TCP"),
            metrics_address=opt("metrics_address", "AGENTS_MACHINE_METRICS"),
            prompt_limit=src.get(
                "prompt_limit", "AGENTS_MACHINE_PROMPT_LIMIT", DEFAULT_PROMPT_LIMIT, parse_size
            ),
            attachment_limit=src.get(
                "attachment_limit",
                "AGENTS_MACHINE_ATTACHMENT_LIMIT",
                DEFAULT_ATTACHMENT_LIMIT,
                parse_size,
            ),
            event_retention_days=src.get(
                "event_retention_days",
                "AGENTS_MACHINE_EVENT_RETENTION_DAYS",
                DEFAULT_EVENT_RETENTION_DAYS,
                int,
            ),
            background_loops=src.get(
                "background_loops", "AGENTS_MACHINE_BACKGROUND_LOOPS", True, parse_bool
            ),
            shutdown_grace_seconds=src.get(
                "shutdown_grace_seconds", "AGENTS_MACHINE_SHUTDOWN_GRACE", 10.0, seconds_value
            ),
            max_streams_per_client=src.get(
                "max_streams_per_client", "AGENTS_MACHINE_MAX_STREAMS_PER_CLIENT", 64, int
            ),
            max_streams=src.get("max_streams", "AGENTS_MACHINE_MAX_STREAMS", 256, int),
            integrity_check_seconds=src.get(
                "integrity_check_seconds",
                "AGENTS_MACHINE_INTEGRITY_CHECK_SECONDS",
                86400.0,
                seconds_value,
            ),
            backup_keep=src.get(
                "backup_keep", "AGENTS_MACHINE_BACKUP_KEEP", DEFAULT_BACKUP_KEEP, _parse_keep
            ),
            backup_time=src.get("backup_time", "AGENTS_MACHINE_BACKUP_TIME", DEFAULT_BACKUP_TIME),
            backup_interval=src.get(
                "backup_interval",
                "AGENTS_MACHINE_BACKUP_INTERVAL",
                DEFAULT_BACKUP_INTERVAL,
                _parse_interval,
            ),
            backup_dir=Path(backup_dir).expanduser() if backup_dir else None,
            backup_target=opt("backup_target", "AGENTS_MACHINE_BACKUP_TARGET"),
            backup_store_endpoint=opt(
                "backup_store_endpoint", "AGENTS_MACHINE_BACKUP_STORE_ENDPOINT"
            ),
            backup_store_region=opt("backup_store_region", "AGENTS_MACHINE_BACKUP_STORE_REGION"),
            backup_credentials_file=Path(credentials).expanduser() if credentials else None,
            # Secrets from the environment only, never a flag (ps shows it) or the file.
            backup_access_key=env.get("AWS_ACCESS_KEY_ID") or None,
            backup_secret_key=env.get("AWS_SECRET_ACCESS_KEY") or None,
            time_zone=src.get("time_zone", "AGENTS_MACHINE_TIME_ZONE", default_time_zone(env)),
            scheduler=src.get("scheduler", "AGENTS_MACHINE_SCHEDULER", True, parse_bool),
            schedule_test_seconds=int(file.get("schedule_test_seconds", 0)),
            log_level=src.get("log_level", "AGENTS_MACHINE_LOG_LEVEL", "INFO", parse_level),
            log_format=src.get("log_format", "AGENTS_MACHINE_LOG_FORMAT", "text", parse_format),
            claude_home=default_claude_home(env, home),
            codex_home=default_codex_home(env, home),
            notify=NotifyConfig.from_env(env, os.getpid()),
            crash_after_deliveries=_test_crash_after(
                env, "AGENTS_MACHINE_TEST_CRASH_AFTER_DELIVERIES", "crash_after_deliveries"
            ),
            crash_in_transfer_after=_test_crash_after(
                env, "AGENTS_MACHINE_TEST_CRASH_IN_TRANSFER_AFTER_AGENTS", "crash_in_transfer_after"
            ),
            crash_in_history_load_after=_test_crash_after(
                env,
                "AGENTS_MACHINE_TEST_CRASH_IN_HISTORY_LOAD_AFTER_AGENTS",
                "crash_in_history_load_after",
            ),
            crash_in_prune_after=_test_crash_after(
                env, "AGENTS_MACHINE_TEST_CRASH_IN_PRUNE_AFTER_DELETES", "crash_in_prune_after"
            ),
            crash_after_join=_test_crash_after(
                env, "AGENTS_MACHINE_TEST_CRASH_AFTER_JOIN", "crash_after_join"
            ),
        )
        return cfg.validate()
