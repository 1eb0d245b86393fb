"""layers/pdl.py: where programmatic dependent launch is used (the GPU tests run the kernels
with it on; here, that nothing off a Hopper GPU asks for it)."""
import torch

from adaspec.layers import pdl


def test_off_the_gpu_no_pdl():
    t = torch.zeros(1)
    assert not pdl.enabled(t) and pdl.launch_kw(t) == {}


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("ADASPEC_PDL", "0")
    if torch.cuda.is_available():
        assert pdl.launch_kw(torch.zeros(1, device="cuda")) == {}
    assert pdl.launch_kw(torch.zeros(1)) == {}


def test_on_a_hopper_gpu_both_keywords(monkeypatch):
    monkeypatch.delenv("ADASPEC_PDL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        import pytest
        pytest.skip("needs a GPU of compute capability 9+")
    assert pdl.launch_kw(torch.zeros(1, device="cuda")) == {"USE_GDC": True, "launch_pdl": True}
