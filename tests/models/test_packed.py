"""Prepacked linears against ``F.linear``: same products in fp32 and bf16, which path each dtype takes, and the
fp32 copy a bf16 weight gets where neither oneDNN nor the row kernel packs bf16."""

import pytest
import torch
import torch.nn.functional as F

from specdraft.models import packed, rowgemm

pytestmark = pytest.mark.skipif(not packed.enabled(), reason="this torch build has no oneDNN linear")


@pytest.mark.parametrize("rows", [1, 2, 5, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear_in_fp32(rows: int, bias: bool) -> None:
    weight, x = torch.randn(48, 32), torch.randn(1, rows, 32)
    b = torch.randn(48) if bias else None
    torch.testing.assert_close(packed.linear(x, weight, b, packed.pack(weight)), F.linear(x, weight, b))


@pytest.mark.parametrize("rows", [1, 5, 6, 9])
def test_bf16_weight_gets_an_fp32_copy_where_nothing_packs_bf16(monkeypatch, rows: int) -> None:
    real = packed._reorder
    monkeypatch.setattr(rowgemm, "available", lambda: False)

    def without_bf16(weight):
        if weight.dtype == torch.bfloat16:
            raise RuntimeError("bf16 path needs avx512bw")
        return real(weight)

    monkeypatch.setattr(packed, "_reorder", without_bf16)
    weight, x = torch.randn(48, 32).bfloat16(), torch.randn(1, rows, 32).bfloat16()
    copy = packed.pack(weight)
    assert copy is not None and copy.kind == "onednn" and copy.dtype == torch.float32
    out = packed.linear(x, weight, None, copy)
    assert out.dtype == torch.bfloat16
    few = rows < packed.UPCAST_MIN_ROWS
    expected = F.linear(x, weight).float() if few else F.linear(x.float(), weight.float())
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_packing_can_be_turned_off(monkeypatch) -> None:
    monkeypatch.setenv("SPECDRAFT_PREPACK", "0")
    assert packed.pack(torch.randn(4, 4)) is None


@pytest.mark.skipif(not rowgemm.available(), reason="no AVX2 CPU or C++ compiler for the row kernel")
def test_paths_per_dtype(monkeypatch) -> None:
    """Both dtypes take the row kernel where it builds; a path can be asked for; a long prefill's products go to
    F.linear where oneDNN multiplies bf16 natively, and stay on the kernel up to ROWS_MAX rows."""
    weight = torch.randn(48, 32)
    assert packed.pack(weight).kind == "rows" and not packed.pack(weight).plain_for_many
    assert packed.pack(weight, "onednn").kind == "onednn"
    monkeypatch.setenv("SPECDRAFT_PREPACK", "onednn")
    assert packed.pack(weight).kind == "onednn"
    monkeypatch.setenv("SPECDRAFT_PREPACK", "rows")
    assert packed.pack(weight.bfloat16()).kind == "rows"
    monkeypatch.delenv("SPECDRAFT_PREPACK")
    bf16 = packed.pack(weight.bfloat16())
    assert bf16.kind == "rows" and bf16.dtype == torch.bfloat16 and bf16.plain_for_many == packed._onednn_bf16()
    calls = []
    monkeypatch.setattr(rowgemm, "linear", lambda *args: calls.append(args) or F.linear(args[0], weight.bfloat16()))
    for rows in (1, 5, packed.ROWS_MAX, packed.ROWS_MAX + 1):
        x = torch.randn(1, rows, 32).bfloat16()
        torch.testing.assert_close(packed.linear(x, weight.bfloat16(), None, bf16).float(),
                                   F.linear(x.float(), weight.bfloat16().float()), atol=5e-2, rtol=2e-2)
    assert len(calls) == (3 if bf16.plain_for_many else 4)
