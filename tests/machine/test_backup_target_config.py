"""``backup_target`` and the bucket settings: URL forms, credentials, refusals naming them."""

from __future__ import annotations

from pathlib import Path

import pytest

from machine.config import MachineConfig, read_backup_credentials
from shared.errors import ConfigError

HOME = Path("/nonexistent-home")
KEY_ID = "AKIAEXAMPLEKEYID0001"
SECRET = "s3cr3t/Value+With=Signs0123456789abcdef"


def _cfg(tmp_path: Path, **fields: object) -> MachineConfig:
    return MachineConfig(data_dir=tmp_path / "d", **fields).validate()  # type: ignore[arg-type]


def _refused(tmp_path: Path, field: str, *words: str, **fields: object) -> str:
    with pytest.raises(ConfigError) as err:
        _cfg(tmp_path, **fields)
    assert err.value.field == field, err.value
    for word in words:
        assert word in err.value.reason, err.value.reason
    return err.value.message


@pytest.mark.parametrize(
    ("value", "bucket", "folder"),
    [
        ("s3://backups/laptop-1", "s3://backups/laptop-1", None),
        ("s3://backups/team/laptop-1/", "s3://backups/team/laptop-1/", None),
        ("s3://backups", "s3://backups", None),
        ("s3://backups/m1?region=eu-west-1&endpoint=http://127.0.0.1:9000", "", None),
        ("/mnt/usb/agents-backups", None, Path("/mnt/usb/agents-backups")),
        ("file:///mnt/usb/agents-backups", None, Path("/mnt/usb/agents-backups")),
    ],
)
def test_backup_target_forms(
    tmp_path: Path, value: str, bucket: str | None, folder: Path | None
) -> None:
    cfg = _cfg(tmp_path, backup_target=value)
    if bucket is None:
        assert cfg.backup_bucket is None and cfg.backups_dir == folder
    else:
        assert cfg.backup_bucket == value
        # Shown without its query (which a person might have put a key in).
        assert cfg.describe_backup_bucket(value).startswith("s3://backups/")
        assert "?" not in cfg.describe_backup_bucket(value)


def test_no_target_is_the_backup_folder(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    assert cfg.backup_bucket is None and cfg.backups_dir == tmp_path / "d" / "backups"


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("", ("empty",)),
        ("backups", ("absolute folder or s3://",)),
        ("./backups", ("absolute folder or s3://",)),
        ("gs://bucket/p", ("unsupported scheme 'gs'",)),
        ("https://bucket.example/p", ("unsupported scheme 'https'",)),
        ("s3://Bad_Bucket/p", ("bucket",)),
        ("s3:///no-bucket", ("bucket",)),
        ("s3://b/p?colour=blue", ("unknown s3 URL parameter 'colour'",)),
        ("s3://b/p?endpoint=ftp://x", ("endpoint",)),
        ("s3://b/../p", ()),
        ("file://host/p", ("file:///absolute/path",)),
    ],
)
def test_a_malformed_target_is_refused_naming_it(
    tmp_path: Path, value: str, words: tuple[str, ...]
) -> None:
    _refused(tmp_path, "backup_target", *words, backup_target=value)


def test_credentials_in_the_url_are_refused_and_not_echoed(tmp_path: Path) -> None:
    url = f"s3://b/p?access_key={KEY_ID}&secret_key={SECRET}"
    message = _refused(tmp_path, "backup_target", "never go in the URL", backup_target=url)
    assert KEY_ID not in message and SECRET not in message


def test_backup_target_and_backup_dir_are_one_setting(tmp_path: Path) -> None:
    _refused(
        tmp_path, "backup_target", "not both", backup_target="s3://b/p", backup_dir=tmp_path / "b"
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("backup_store_endpoint", "ftp://127.0.0.1:9000"),
        ("backup_store_endpoint", "127.0.0.1:9000"),
        ("backup_store_endpoint", f"http://{KEY_ID}:{SECRET}@127.0.0.1:9000"),
        ("backup_store_endpoint", "http://127.0.0.1:99999"),
        ("backup_store_region", "Europe West"),
        ("backup_credentials_file", Path("creds")),
    ],
)
def test_bad_bucket_settings_are_refused_naming_them(
    tmp_path: Path, field: str, value: object
) -> None:
    message = _refused(tmp_path, field, backup_target="s3://b/p", **{field: value})
    assert SECRET not in message


def test_an_access_key_without_its_secret_is_refused(tmp_path: Path) -> None:
    _refused(tmp_path, "AWS_ACCESS_KEY_ID", "go together", backup_access_key=KEY_ID)


def test_environment_credentials_and_settings_reach_the_store_options(tmp_path: Path) -> None:
    data = tmp_path / "d"
    env = {
        "AGENTS_MACHINE_BACKUP_TARGET": "s3://backups/m1",
        "AGENTS_MACHINE_BACKUP_STORE_ENDPOINT": "http://127.0.0.1:9000",
        "AGENTS_MACHINE_BACKUP_STORE_REGION": "eu-west-1",
        "AWS_ACCESS_KEY_ID": KEY_ID,
        "AWS_SECRET_ACCESS_KEY": SECRET,
    }
    cfg = MachineConfig.build(flags={"data_dir": str(data)}, env=env, home=HOME)
    assert cfg.backup_bucket == "s3://backups/m1"
    options = cfg.backup_store_options()
    assert (options.access_key, options.secret_key) == (KEY_ID, SECRET)
    assert (options.endpoint_url, options.region) == ("http://127.0.0.1:9000", "eu-west-1")
    assert cfg.describe_backup_bucket("s3://backups/m1") == (
        "s3://backups/m1/ at http://127.0.0.1:9000"
    )
    # Never in a repr (a log line of the config, a traceback's locals).
    for shown in (repr(cfg), repr(options)):
        assert KEY_ID not in shown and SECRET not in shown


def test_the_file_gives_the_settings_but_never_the_keys(tmp_path: Path) -> None:
    data = tmp_path / "d"
    data.mkdir()
    creds = tmp_path / "creds"
    (data / "machine.toml").write_text(
        'backup_target = "s3://backups/m1"\nbackup_store_endpoint = "http://127.0.0.1:9000"\n'
        f'backup_store_region = "eu-west-1"\nbackup_credentials_file = "{creds}"\n'
    )
    cfg = MachineConfig.build(flags={"data_dir": str(data)}, env={}, home=HOME)
    assert cfg.backup_bucket == "s3://backups/m1" and cfg.backup_credentials_file == creds
    assert cfg.backup_store_region == "eu-west-1"
    (data / "machine.toml").write_text(f'backup_secret_key = "{SECRET}"\n')
    with pytest.raises(ConfigError, match="unknown key") as err:
        MachineConfig.build(flags={"data_dir": str(data)}, env={}, home=HOME)
    assert SECRET not in err.value.message


def _creds_file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "credentials"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_a_credentials_file_in_the_aws_format_wins_over_the_environment(tmp_path: Path) -> None:
    path = _creds_file(
        tmp_path,
        "# backups of this laptop\n[other]\naws_access_key_id = NOTTHIS\n"
        f"aws_secret_access_key = nope\n\n[default]\naws_access_key_id = {KEY_ID}\n"
        f"aws_secret_access_key = {SECRET}\n",
    )
    cfg = _cfg(
        tmp_path,
        backup_target="s3://b/p",
        backup_credentials_file=path,
        backup_access_key="FROMENV",
        backup_secret_key="from-env",
    )
    options = cfg.backup_store_options()
    assert (options.access_key, options.secret_key) == (KEY_ID, SECRET)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o666])
def test_a_credentials_file_others_can_reach_is_refused(tmp_path: Path, mode: int) -> None:
    path = _creds_file(tmp_path, f"[default]\naws_access_key_id={KEY_ID}\n", mode)
    with pytest.raises(ConfigError) as err:
        read_backup_credentials(path)
    assert err.value.field == "backup_credentials_file"
    assert "readable or writable by others" in err.value.reason
    assert f"chmod 600 {path}" in err.value.reason


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (f"{KEY_ID}\n{SECRET}\n", "not in the AWS shared-credentials format"),
        # A line that is neither a section nor a key: configparser's error quotes it.
        (f"[default]\naws_access_key_id = {KEY_ID}\n{KEY_ID}{KEY_ID}\n", "not in the AWS"),
        # One with an "=" in it is a key of its own: the keys wanted are then missing.
        (f"[default]\naws_access_key_id = {KEY_ID}\n{SECRET}\n", "empty or missing"),
        (f"[prod]\naws_access_key_id = {KEY_ID}\naws_secret_access_key = {SECRET}\n", "[default]"),
        (f"[default]\naws_access_key_id = {KEY_ID}\naws_secret_access_key =\n", "empty or missing"),
        (f"[default]\naws_secret_access_key = {SECRET}\n", "empty or missing"),
    ],
)
def test_a_malformed_credentials_file_is_refused_without_echoing_it(
    tmp_path: Path, text: str, words: str
) -> None:
    path = _creds_file(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        read_backup_credentials(path)
    assert err.value.field == "backup_credentials_file" and words in err.value.reason
    assert KEY_ID not in err.value.message and SECRET not in err.value.message


def test_a_missing_or_odd_credentials_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read"):
        read_backup_credentials(tmp_path / "absent")
    folder = tmp_path / "folder"
    folder.mkdir(mode=0o700)
    with pytest.raises(ConfigError, match="not a regular file"):
        read_backup_credentials(folder)
    binary = _creds_file(tmp_path, "")
    binary.write_bytes(b"\xff\xfe[default]")
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_backup_credentials(binary)
