"""The verifier remembers, within one graph, the result types of each (op, operand types,
exactly-typed attributes) signature it has checked (kiln/ir/verifier.py): a repeated
signature is not re-inferred, but every node is still held to the rule's result."""

import pytest

import kiln as kn
from kiln.errors import KilnVerifierError
from kiln.ir import registry
from kiln.ir.types import TensorType
from kiln.ir.verifier import verify


def twice():
    """Two reshapes of one input with the same signature, then an add of the two."""
    g = kn.trace(lambda x: x.reshape(2, 3) + x.reshape(2, 3), kn.ones(6))
    first, second = [n for n in g.body.nodes if n.op == "reshape"]
    return g, first, second


def test_a_repeated_signature_is_inferred_once(monkeypatch):
    g, _, _ = twice()
    calls = []
    real = registry.OpDef.infer
    monkeypatch.setattr(registry.OpDef, "infer", lambda self, *a: calls.append(self.name) or real(self, *a))
    verify(g)
    assert calls.count("reshape") == 1 and calls.count("add") == 1


def test_a_repeated_signature_with_a_wrong_result_type_is_refused():
    g, _, second = twice()
    second.results[0].type = TensorType(kn.float32, (3, 2))  # the rule says (2, 3)
    with pytest.raises(KilnVerifierError, match=r"node \d+ \(reshape\): results are typed f32\[3, 2\]"):
        verify(g)


@pytest.mark.parametrize("shape", [(2.0, 3.0), (2, 3.0), (True, 3)], ids=["floats", "one float", "bool"])
def test_attributes_equal_in_python_but_of_another_type_are_checked_again(shape):
    """2 == 2.0 == True in Python: the memo key tells the types apart, so the rule sees
    the second node's attribute and refuses it (the first node alone verifies)."""
    g, first, second = twice()
    verify(g)
    second.attrs["shape"] = shape
    with pytest.raises(KilnVerifierError, match=r"node \d+ \(reshape\)"):
        verify(g)
    first.attrs["shape"] = shape  # also when the odd one comes first
    second.attrs["shape"] = (2, 3)
    with pytest.raises(KilnVerifierError, match=r"node \d+ \(reshape\)"):
        verify(g)


def test_unhashable_attributes_are_checked_without_the_memo(monkeypatch):
    g, first, second = twice()
    first.attrs["shape"] = [2, 3]  # a list cannot be a memo key: each node runs the rule
    second.attrs["shape"] = [2, 3]
    calls = []
    real = registry.OpDef.infer
    monkeypatch.setattr(registry.OpDef, "infer", lambda self, *a: calls.append(self.name) or real(self, *a))
    try:
        real(registry.get("reshape"), [first.operands[0].type], {"shape": [2, 3]})
    except Exception:  # the rule refuses a list: so must the verifier
        with pytest.raises(KilnVerifierError, match=r"\(reshape\)"):
            verify(g)
    else:
        verify(g)
        assert calls.count("reshape") == 2
