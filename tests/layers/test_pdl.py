"""layers/pdl.py: where programmatic dependent launch is used (the GPU tests run the kernels
with it on; here, that nothing off a Hopper GPU asks for it, and how the engine chooses it)."""
import pytest
import torch

from adaspec.layers import pdl


@pytest.fixture
def fresh_choice(monkeypatch):
    """No engine's choice and no ADASPEC_PDL: each test sets what it needs."""
    monkeypatch.setattr(pdl, "_chosen", None)
    monkeypatch.delenv("ADASPEC_PDL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_off_the_gpu_no_pdl(fresh_choice):
    t = torch.zeros(1)
    assert not pdl.enabled(t) and pdl.launch_kw(t) == {}
    pdl.choose(pdl.DEVICE_BOUND_BYTES)
    assert not pdl.enabled(t) and pdl.launch_kw(t) == {}


def test_turned_off_by_the_environment(fresh_choice, monkeypatch):
    monkeypatch.setenv("ADASPEC_PDL", "0")
    assert pdl.choose(100 * pdl.DEVICE_BOUND_BYTES) is False
    if torch.cuda.is_available():
        assert pdl.launch_kw(torch.zeros(1, device="cuda")) == {}
    assert pdl.launch_kw(torch.zeros(1)) == {}


def test_chosen_by_the_bytes_of_weights_a_step_reads(fresh_choice):
    # A host-bound model (the bundled demo pair: 16 MB) launches without PDL: a graph with
    # programmatic edges costs the host about twice the time to launch, and its device waits
    # for the host anyway. A device-bound one (an 8B model: 16 GB) launches with it.
    assert pdl.choose(16 << 20) is False
    assert pdl.choose(pdl.DEVICE_BOUND_BYTES - 1) is False
    assert pdl.choose(pdl.DEVICE_BOUND_BYTES) is True
    assert pdl.choose(16 << 30) is True


def test_the_environment_overrides_the_choice(fresh_choice, monkeypatch):
    monkeypatch.setenv("ADASPEC_PDL", "1")
    assert pdl.choose(16 << 20) is True
    monkeypatch.setenv("ADASPEC_PDL", "0")
    assert pdl.choose(16 << 30) is False


def test_a_host_bound_choice_turns_launches_off_on_the_gpu(fresh_choice):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a GPU of compute capability 9+")
    t = torch.zeros(1, device="cuda")
    pdl.choose(16 << 30)
    assert pdl.launch_kw(t) == {"USE_GDC": True, "launch_pdl": True}
    pdl.choose(16 << 20)
    assert pdl.launch_kw(t) == {}


def test_on_a_hopper_gpu_both_keywords(fresh_choice, monkeypatch):
    monkeypatch.setenv("ADASPEC_PDL", "1")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a GPU of compute capability 9+")
    assert pdl.launch_kw(torch.zeros(1, device="cuda")) == {"USE_GDC": True, "launch_pdl": True}
