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


def test_every_distributed_error_class_is_on_the_package_face():
    # users catch them as dist.NcclError, dist.MpiError, ...: none may be reachable only
    # through the private module
    import inspect

    import kiln.distributed.errors as errors

    classes = [name for name, obj in vars(errors).items()
               if inspect.isclass(obj) and issubclass(obj, KilnError) and obj.__module__ == errors.__name__]
    assert len(classes) >= 20
    missing = [name for name in classes if name not in kiln.distributed.__all__
               or getattr(kiln.distributed, name) is not getattr(errors, name)]
    assert missing == []
