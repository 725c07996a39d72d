"""The device report: CPU fields for real, the GPU half with torch.cuda faked (no device here)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import tensorscope
from tensorscope._env import EnvReport, arch_support, env


def test_cpu_report_fields_are_real_and_json_able():
    r = env()
    assert isinstance(r, EnvReport)
    d = r.to_dict()
    json.dumps(d)                                   # trace metadata stores it
    assert d["torch"] == torch.__version__
    assert d["default_dtype"] == str(torch.get_default_dtype()).replace("torch.", "")
    assert d["num_threads"] == torch.get_num_threads()
    assert d["num_interop_threads"] == torch.get_num_interop_threads()
    assert d["float32_matmul_precision"] == torch.get_float32_matmul_precision()
    assert d["tf32_cudnn"] == torch.backends.cudnn.allow_tf32
    assert d["tf32_matmul"] == torch.backends.cuda.matmul.allow_tf32
    assert d["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    if not torch.cuda.is_available():
        assert d["gpus"] == [] and d["device_count"] == 0 and d["cuda_available"] is False
    text = str(r)
    assert "torch" in text and "default dtype" in text and "threads" in text


def test_report_follows_settings_changes():
    old = torch.get_default_dtype(), torch.get_num_threads()
    try:
        torch.set_default_dtype(torch.float64)
        assert env().default_dtype == "float64"
    finally:
        torch.set_default_dtype(old[0])
    assert env().default_dtype == str(old[0]).replace("torch.", "")


def test_mimebundle_is_escaped_html_and_plain_text():
    r = env()
    r.notes.append("<script>alert(1)</script> & more")
    b = r._repr_mimebundle_()
    assert set(b) == {"text/plain", "text/html"}
    assert "<script>" not in b["text/html"] and "&lt;script&gt;" in b["text/html"]
    assert "<script>alert(1)</script>" in b["text/plain"]


@pytest.mark.parametrize("cap,arch,want", [
    ((8, 6), ["sm_50", "sm_80", "sm_90", "compute_90"], ("sass", "sm_80")),     # same major, lower minor runs
    ((9, 0), ["sm_80", "sm_90a"], ("sass", "sm_90a")),                          # arch-specific, exact match
    ((10, 0), ["sm_80", "sm_90a", "compute_90"], ("ptx", "compute_90")),        # newer major: PTX JIT
    ((7, 5), ["sm_80", "compute_80"], ("none", None)),                          # older than every entry
    ((12, 0), ["sm_100f", "sm_120", "compute_120"], ("sass", "sm_120")),
    ((8, 9), [], ("none", None)),
])
def test_arch_support(cap, arch, want):
    assert arch_support(cap, arch) == want


class _FakeProps(SimpleNamespace):
    pass


def _fake_cuda(monkeypatch, initialized):
    calls = []

    def props(i):
        calls.append(i)
        return _FakeProps(name=f"Fake GPU {i}", major=8 + i, minor=6 - 6 * i, multi_processor_count=84 + i,
                          total_memory=24 * 2**30)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_80", "compute_80"])
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    return calls


def test_gpu_half_with_faked_cuda(monkeypatch):
    calls = _fake_cuda(monkeypatch, initialized=True)
    r = env()
    assert calls == [0, 1]
    g0, g1 = r.gpus
    assert (g0.name, g0.capability, g0.sm_count, g0.total_memory) == ("Fake GPU 0", "sm_86", 84, 24 * 2**30)
    assert (g0.code, g0.code_arch, g0.bf16) == ("sass", "sm_80", True)
    assert (g1.capability, g1.code, g1.code_arch) == ("sm_90", "ptx", "compute_80")
    assert any("PTX JIT" in n for n in r.notes)
    text = str(r)
    assert "cuda:1 Fake GPU 1, sm_90, 85 SMs" in text and "PTX JIT" in text
    json.dumps(r.to_dict())


def test_metadata_report_never_initialises_cuda(monkeypatch):
    calls = _fake_cuda(monkeypatch, initialized=False)
    r = env(init_cuda=False)
    assert calls == [] and r.gpus == [] and r.device_count == 2
    assert "not queried" in r.gpu_details
    assert env(init_cuda=True).gpus and calls == [0, 1]


def test_every_trace_carries_the_report():
    with tensorscope.trace() as t:
        torch.ones(2) * 2
    dev = t.metadata["device"]
    assert dev["torch"] == torch.__version__ and "default_dtype" in dev and "gpus" in dev
    json.dumps(dev)
