"""`make peers` (rlaudit.targets.peers.install) without the network: pip is replaced by a fake that
writes files into the --target directory it is given, so stamping, atomic replacement, the
`#! drop:` directive and the refusal to shadow the environment are checked on their own."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rlaudit.errors import InputError
from rlaudit.targets.peers import install


@pytest.fixture
def peers(tmp_path, monkeypatch):
    monkeypatch.setenv("RLAUDIT_PEERS_DIR", str(tmp_path / "peers"))
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
    with pytest.raises(InputError, match=r"no requirements/peers/other-2.txt; pinned: tool-1.0"):
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
