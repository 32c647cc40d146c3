"""Every K2xx error class is documented, with its class name, in docs/errors-distributed.md."""

from pathlib import Path

import kiln.distributed  # noqa: F401  registers the classes
from kiln.errors import KilnError, all_error_classes

DOC = Path(__file__).resolve().parents[2] / "docs" / "errors-distributed.md"


def test_every_distributed_code_is_documented():
    text = DOC.read_text()
    codes = {c: cls for c, cls in all_error_classes().items() if c.startswith("K2")}
    assert len(codes) >= 10
    for code, cls in codes.items():
        assert issubclass(cls, KilnError)
        assert "| %s | `%s` |" % (code, cls.__name__) in text, code


def test_peer_failure_names_the_rank():
    err = kiln.distributed.PeerFailure(3, "rank 3 died", group="world")
    assert err.rank == 3 and err.code == "K202" and "[K202] rank 3 died" in str(err)
