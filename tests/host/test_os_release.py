"""os-release(5) parsed from real machines' files (tests/data/osrelease-*.txt)."""

from __future__ import annotations

import pytest
from helpers import FIXTURES

from llmgw.errors import ParseError
from llmgw.host.os_release import OsRelease, parse_os_release


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("osrelease-ubuntu-22.04.5-gpud-no-trailing-newline.txt",
         OsRelease("ubuntu", ("debian",), "22.04", "Ubuntu 22.04.5 LTS")),
        ("osrelease-debian-12-bookworm-armv7-m5stack.txt",
         OsRelease("debian", (), "12", "Debian GNU/Linux 12 (bookworm)")),
        ("osrelease-rhel-9.6.txt",
         OsRelease("rhel", ("fedora",), "9.6", "Red Hat Enterprise Linux 9.6 (Plow)")),
        ("osrelease-amazon-linux-2023.txt",
         OsRelease("amzn", ("fedora",), "2023", "Amazon Linux 2023")),
    ],
)  # fmt: skip
def test_os_release(name: str, expected: OsRelease) -> None:
    assert parse_os_release(fixture(name)) == expected


def test_os_release_quoting() -> None:
    text = '# comment\nID=\'opensuse-leap\'\nID_LIKE="suse opensuse"\n\nVERSION_ID="15.\\"6\\""'
    assert parse_os_release(text) == OsRelease("opensuse-leap", ("suse", "opensuse"), '15."6"')
    for bad in ('ID="ubuntu', "just words", ""):
        with pytest.raises(ParseError):
            parse_os_release(bad)
