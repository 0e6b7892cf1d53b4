"""dtype "auto": bfloat16 only where the device computes it natively, read from the CPU's
flags; an explicit bfloat16 on a CPU that emulates it warns."""

from __future__ import annotations

import warnings

import pytest
import torch

from linnet import hardware, nest

CARD = nest.resolve("debug")


@pytest.mark.parametrize("flags, expected", [
    ({"avx2", "avx512f", "amx_bf16", "amx_tile"}, torch.bfloat16),
    ({"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16),
    ({"avx2", "fma"}, torch.float32),
    (set(), torch.float32),
])
def test_auto_reads_the_cpu_flags(monkeypatch, flags, expected):
    monkeypatch.delenv("LINNET_CPU_BF16")
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(hardware.platform, "machine", lambda: "x86_64")
    assert nest.load(CARD, weights="random", dtype="auto").dtype == expected


def test_the_environment_decides_where_flags_mislead(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2"}))
    monkeypatch.setenv("LINNET_CPU_BF16", "1")
    assert nest.load(CARD, weights="random", dtype="auto").dtype == torch.bfloat16
    monkeypatch.setenv("LINNET_CPU_BF16", "0")
    assert nest.load(CARD, weights="random", dtype="auto").dtype == torch.float32


def test_explicit_bf16_on_an_emulating_cpu_warns_with_the_factor(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2"}))
    with pytest.warns(UserWarning, match=r"emulated here, about 21x slower than float32"):
        model = nest.load(CARD, weights="random", dtype="bfloat16")
    assert model.dtype == torch.bfloat16  # it still does what was asked
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    monkeypatch.setattr(hardware.platform, "machine", lambda: "x86_64")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nest.load(CARD, weights="random", dtype="bfloat16")
        nest.load(CARD, weights="random")  # the default stays float32 on CPU


def test_cpu_flags_come_from_proc_cpuinfo():
    flags = hardware.cpu_flags()
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        assert flags == frozenset()
        return
    assert ("avx2" in flags) == (" avx2" in text)


def test_every_config_defaults_to_auto(tmp_path):
    from linnet.config import PretrainConfig, SFTConfig, load

    (tmp_path / "x.jsonl").write_text("{}\n")
    assert load(SFTConfig, None, [f"data.path={tmp_path / 'x.jsonl'}"]).model.dtype == "auto"
    assert PretrainConfig().model.dtype == "auto"
