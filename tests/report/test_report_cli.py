"""`rlaudit report` argument handling: every bad input exits 2 with a message naming it."""

from __future__ import annotations

import datetime as dt
import socket

import pytest

from rlaudit.cli.main import main
from rlaudit.cli.report import parse_date
from rlaudit.errors import InputError


@pytest.mark.parametrize("argv, needle", [
    (["--last", "0"], "--last must be at least 1"),
    (["--until", "2026-11-01"], "--until needs --since"),
    (["--since", "yesterday"], "not a date: 'yesterday'"),
    (["--since", "2026-11-05", "--until", "2026-11-01"], "is not after --since"),
    (["--runs", "a", "a"], "two different runs"),
])
def test_bad_selection_exits_2(argv, needle, tmp_path, capsys):
    assert main(["report", "--report-dir", str(tmp_path), *argv]) == 2
    assert needle in capsys.readouterr().err


def test_no_store_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["report", "--report-dir", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "--report-dir" in err and "no MLflow store" in err
    assert not (tmp_path / "empty").exists()   # reading never creates a store


def test_unreachable_tracking_uri_exits_2(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["report", "--tracking-uri", f"http://127.0.0.1:{port}"]) == 2
    assert "cannot reach MLflow" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys):
    for argv in (["report", "--format", "pdf"], ["report", "--last", "3", "--runs", "a", "b"],
                 ["report", "--last", "x"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2


def test_parse_date():
    end = parse_date("2026-11-07", end=True, key="--until")
    assert end.replace(tzinfo=None) == dt.datetime(2026, 11, 8)
    assert parse_date("2026-11-07", end=False, key="--since").replace(tzinfo=None) == \
        dt.datetime(2026, 11, 7)
    utc = parse_date("2026-11-07T10:30:00+00:00", end=False, key="--since")
    assert utc.utcoffset() == dt.timedelta(0) and utc.hour == 10
    with pytest.raises(InputError) as e:
        parse_date("2026-13-01", end=False, key="--since")
    assert e.value.key == "--since"
