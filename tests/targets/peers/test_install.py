"""`make peers` (rlaudit.targets.peers.install) without the network: pip is replaced by a fake that
writes files into the --target directory it is given, so stamping, atomic replacement, the
`#! drop:` directive and the refusal to shadow the environment are checked on their own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlaudit.errors import InputError
from rlaudit.targets.peers import install


@pytest.fixture
def peers(tmp_path, monkeypatch):
    monkeypatch.setenv("RLAUDIT_PEERS_DIR", str(tmp_path / "peers"))
    monkeypatch.setattr(install, "uv_beside_interpreter", lambda: None)   # pip unless a test
    req = tmp_path / "requirements"
    req.mkdir()
    return req


def _write(req: Path, name: str, text: str) -> Path:
    path = req / name
    path.write_text(text)
    return path


def _fake_pip(monkeypatch, files: dict[str, str], returncode: int = 0) -> list:
    """Replace subprocess.run: write ``files`` under the --target directory of the pip call."""
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        target = Path(cmd[cmd.index("--target") + 1])
        for rel, text in files.items():
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            (target / rel).write_text(text)
        return subprocess.CompletedProcess(cmd, returncode, "", "boom" if returncode else "")

    monkeypatch.setattr(install.subprocess, "run", run)
    return calls


def test_every_requirement_must_be_pinned(peers):
    _write(peers, "tool-1.0.txt", "tool==1.0\nhelper>=2  # not pinned\n")
    with pytest.raises(InputError, match=r"tool-1.0.txt: line 2: .*pinned.*'helper>=2'"):
        install.pinned_peers(peers)


def test_first_requirement_is_the_peer_of_the_file_name(peers):
    _write(peers, "tool-1.0.txt", "tool==1.1\n")
    with pytest.raises(InputError, match=r"first requirement must be tool==1.0"):
        install.pinned_peers(peers)


def test_unknown_name_is_an_input_error(peers):
    _write(peers, "tool-1.0.txt", "tool==1.0\n")
    with pytest.raises(InputError,
                       match=r"no requirements/peers/other-2.txt \(or .git\); pinned: tool-1.0"):
        install.select(install.pinned_peers(peers), ["other-2"])


def test_pip_directive_allows_only_known_options(peers, monkeypatch):
    _write(peers, "tool-1.0.txt", "tool==1.0\n#! pip: --ignore-requires-python\n")
    calls = _fake_pip(monkeypatch, {"tool_pkg_zz/__init__.py": ""})
    (peer,) = install.pinned_peers(peers)
    install.install(peer)
    assert "--ignore-requires-python" in calls[0] and "--no-deps" in calls[0]
    _write(peers, "tool-1.0.txt", "tool==1.0\n#! pip: --index-url http://x\n")
    with pytest.raises(InputError, match=r"'#! pip:' accepts --ignore-requires-python"):
        install.pinned_peers(peers)


def test_uv_installs_where_the_environment_has_it_and_pip_where_a_file_needs_pip(
        peers, monkeypatch, tmp_path):
    uv = tmp_path / "bin" / "uv"
    monkeypatch.setattr(install, "uv_beside_interpreter", lambda: uv)
    _write(peers, "tool-1.0.txt", "tool==1.0\nhelper==3\n")
    _write(peers, "old-2.0.txt", "old==2.0\n#! pip: --ignore-requires-python\n")
    calls = _fake_pip(monkeypatch, {"tool_pkg_zz/__init__.py": ""})
    old, tool = install.pinned_peers(peers)
    assert "installed" in install.install(tool)
    cmd = calls[-1]
    assert cmd[:3] == [str(uv), "pip", "install"] and "--no-deps" in cmd
    assert cmd[cmd.index("--python") + 1] == sys.executable
    assert cmd[cmd.index("-r") + 1] == str(tool.requirements)
    assert (tool.target / "tool_pkg_zz" / "__init__.py").is_file()
    install.install(old)                                   # uv has no --ignore-requires-python
    assert calls[-1][:3] == [sys.executable, "-m", "pip"]
    assert "--ignore-requires-python" in calls[-1]
    _fake_pip(monkeypatch, {}, returncode=1)
    tool.requirements.write_text("tool==1.0\nhelper==4\n")
    with pytest.raises(RuntimeError, match=r"tool-1.0: uv failed \(exit 1\)"):
        install.install(tool)


def test_uv_is_looked_for_beside_the_interpreter(tmp_path, monkeypatch):
    monkeypatch.setattr(install.sys, "executable", str(tmp_path / "python"))
    assert install.uv_beside_interpreter() is None
    (tmp_path / "uv").write_text("")
    assert install.uv_beside_interpreter() is None          # not executable
    (tmp_path / "uv").chmod(0o755)
    assert install.uv_beside_interpreter() == tmp_path / "uv"


def test_install_stamps_drops_and_is_idempotent(peers, monkeypatch):
    _write(peers, "tool-1.0.txt", "tool==1.0\n#! drop: tests\nhelper==3\n")
    calls = _fake_pip(monkeypatch, {"tool_pkg_zz/__init__.py": "", "tests/__init__.py": "",
                                    "tool_pkg_zz-1.0.dist-info/METADATA": ""})
    (peer,) = install.pinned_peers(peers)
    assert "installed" in install.install(peer)
    assert (peer.target / "tool_pkg_zz" / "__init__.py").is_file()
    assert not (peer.target / "tests").exists()               # dropped before the shadow check
    assert (peer.target / install.STAMP).read_text().strip() == peer.digest()
    assert calls[0][calls[0].index("-r") + 1] == str(peer.requirements)
    assert "--no-deps" in calls[0]
    assert "up to date" in install.install(peer) and len(calls) == 1
    peer.requirements.write_text("tool==1.0\n#! drop: tests\nhelper==4\n")  # new pin: reinstall
    assert "installed" in install.install(peer) and len(calls) == 2


def test_failed_pip_leaves_the_previous_install(peers, monkeypatch):
    _write(peers, "tool-1.0.txt", "tool==1.0\n")
    _fake_pip(monkeypatch, {"tool_pkg_zz/__init__.py": "old"})
    (peer,) = install.pinned_peers(peers)
    install.install(peer)
    peer.requirements.write_text("tool==1.0\nhelper==1\n")
    _fake_pip(monkeypatch, {"tool_pkg_zz/__init__.py": "new"}, returncode=1)
    with pytest.raises(RuntimeError, match="pip failed"):
        install.install(peer)
    assert (peer.target / "tool_pkg_zz" / "__init__.py").read_text() == "old"
    assert [p.name for p in peer.target.parent.iterdir() if p.name.startswith(".tmp")] == []


def test_a_package_the_environment_has_is_refused(peers, monkeypatch):
    _write(peers, "tool-1.0.txt", "tool==1.0\n")
    _fake_pip(monkeypatch, {"tool_pkg_zz/__init__.py": "", "torch/__init__.py": "",
                            "numpy/__init__.py": ""})
    (peer,) = install.pinned_peers(peers)
    with pytest.raises(RuntimeError, match=r"installs numpy, torch, which this environment "
                                           r"already has"):
        install.install(peer)
    assert not peer.target.exists()


def test_main_exit_codes(peers, monkeypatch, capsys):
    monkeypatch.setattr(install, "REQUIREMENTS", peers)
    _write(peers, "tool-1.0.txt", "tool==1.0\n")
    assert install.main(["other-2"]) == 2
    assert "no requirements/peers/other-2.txt" in capsys.readouterr().err
    _fake_pip(monkeypatch, {}, returncode=1)
    assert install.main([]) == 1
    _fake_pip(monkeypatch, {"tool_pkg_zz/__init__.py": ""})
    assert install.main(["tool"]) == 0
    assert "tool-1.0: installed" in capsys.readouterr().out
    assert install.main(["--list"]) == 0
    assert "tool-1.0: installed" in capsys.readouterr().out


# ---- peers published only as source: requirements/peers/<name>.git ------------------------------

def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd,
                          check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def upstream(tmp_path) -> tuple[Path, list[str]]:
    """A local git repository with package ``zzsnap/`` at two commits (``VALUE = 1``, then 2)."""
    repo = tmp_path / "upstream"
    (repo / "zzsnap").mkdir(parents=True)
    _git(repo, "init", "-q")
    commits = []
    for value in (1, 2):
        (repo / "zzsnap" / "__init__.py").write_text(f"VALUE = {value}\n")
        (repo / "README").write_text("not part of the package\n")
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", f"v{value}")
        commits.append(_git(repo, "rev-parse", "HEAD"))
    return repo, commits


def test_snapshot_file_is_validated(peers):
    _write(peers, "zzsnap.git", "url: file:///x\npackage: zzsnap\ncommit: abc123\n")
    with pytest.raises(InputError, match=r"zzsnap.git.*commit.*full 40-character sha.*abc123"):
        install.pinned_snapshots(peers)
    _write(peers, "zzsnap.git", "url: file:///x\ncommit: " + "a" * 40 + "\n")
    with pytest.raises(InputError, match=r"zzsnap.git.*exactly one 'package:' line, got 0"):
        install.pinned_snapshots(peers)
    _write(peers, "zzsnap.git", "url file:///x\n")
    with pytest.raises(InputError, match=r"zzsnap.git: line 1: expected 'url: URL'"):
        install.pinned_snapshots(peers)


def test_snapshot_fetch_extracts_the_package_at_each_commit(peers, upstream):
    repo, commits = upstream
    _write(peers, "zzsnap.git", f"# two commits\nurl: file://{repo}\npackage: zzsnap\n"
                                f"commit: {commits[0]}\ncommit: {commits[1]}  # newer\n")
    snaps = install.pinned_snapshots(peers)
    assert [s.key for s in snaps] == [f"zzsnap-{c[:9]}" for c in commits]
    for snap, value in zip(snaps, (1, 2)):
        assert "fetched" in install.fetch(snap)
        assert (snap.target / "zzsnap" / "__init__.py").read_text() == f"VALUE = {value}\n"
        assert not (snap.target / "README").exists()          # only the package
        assert not (snap.target / ".git-fetch").exists()
        assert install.fetch(snap).endswith("up to date (" + str(snap.target) + ")")
    assert not [p for p in snaps[0].target.parent.iterdir() if p.name.startswith(".tmp-")]


def test_snapshot_fetch_failure_leaves_nothing_and_make_peers_goes_on(peers, upstream,
                                                                     monkeypatch, capsys):
    repo, commits = upstream
    missing = "f" * 40
    _write(peers, "zzsnap.git", f"url: file://{repo}\npackage: zzsnap\ncommit: {missing}\n")
    (snap,) = install.pinned_snapshots(peers)
    with pytest.raises(RuntimeError, match=rf"zzsnap-fffffffff: git fetch failed"):
        install.fetch(snap)
    assert not snap.target.exists()
    assert not [p for p in snap.target.parent.iterdir() if p.name.startswith(".tmp-")]
    monkeypatch.setattr(install, "REQUIREMENTS", peers)
    _write(peers, "zzsnap.git", f"url: file://{repo}\npackage: zzsnap\ncommit: {missing}\n"
                                f"commit: {'e' * 40}\n")
    assert install.main([]) == 0                              # every peer: a warning, go on
    err = capsys.readouterr().err
    assert "warning: zzsnap-fffffffff: git fetch failed" in err
    # one failed fetch per URL: a dead network costs one timeout, not one per commit
    assert f"warning: zzsnap-eeeeeeeee: not tried, file://{repo} failed above" in err
    assert install.main(["zzsnap"]) == 1                      # named: a failure


def test_snapshot_the_adapter_already_finds_is_not_fetched(peers, tmp_path, monkeypatch):
    commit = "624b824a898ab0ec1fcb4d373004c7f3852bf515"          # slime's pinned default
    held = tmp_path / "held"
    (held / commit[:9] / "slime").mkdir(parents=True)
    (held / commit[:9] / "slime" / "__init__.py").write_text("")
    monkeypatch.setenv("RLAUDIT_SLIME_DIR", str(held))
    _write(peers, "slime.git", f"url: file:///nowhere\npackage: slime\ncommit: {commit}\n")
    (snap,) = install.pinned_snapshots(peers)
    assert install.fetch(snap) == f"slime-624b824a8: found in {held / commit[:9]}"
    assert not snap.target.exists()
