"""When launches use programmatic dependent launch: only inside pdl.in_graphs(), on a device that has it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tokenmill.kernels import pdl


@pytest.fixture
def hopper(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A CUDA tensor's stand-in on a device that supports PDL."""
    monkeypatch.setattr(pdl, "_device_supports", lambda index: True)
    return SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=0))


def test_only_launches_inside_graph_captures_use_pdl(hopper: SimpleNamespace) -> None:
    assert pdl.launch_args(hopper) == {"PDL": False, "launch_pdl": False}
    with pdl.in_graphs():
        assert pdl.launch_args(hopper) == {"PDL": True, "launch_pdl": True}
        assert pdl.launch_args(hopper, allowed=False) == {"PDL": False, "launch_pdl": False}
        with pdl.in_graphs():  # nested captures (piecewise graphs inside a capture run) keep it on
            assert pdl.enabled(hopper)
        assert pdl.enabled(hopper)
    assert not pdl.enabled(hopper)


def test_in_graphs_ends_on_an_error(hopper: SimpleNamespace) -> None:
    with pytest.raises(RuntimeError), pdl.in_graphs():
        raise RuntimeError("capture failed")
    assert not pdl.enabled(hopper)


def test_never_on_the_cpu_or_without_device_support(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = SimpleNamespace(is_cuda=False, device=SimpleNamespace(index=None))
    old = SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=0))
    monkeypatch.setattr(pdl, "_device_supports", lambda index: False)
    with pdl.in_graphs():
        assert not pdl.enabled(cpu)
        assert not pdl.enabled(old)
